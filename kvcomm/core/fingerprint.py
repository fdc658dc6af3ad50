"""Model fingerprints: which checkpoint, tokenizer, KV dtype and RoPE produced a piece of KV.

Anchors and base KV are only valid for the model that computed them: persisted pools carry a ``ModelFingerprint`` and are refused for any other.
Works on any ``torch.nn.Module`` with a ``config`` (``to_dict``) and any tokenizer with
``get_vocab``; this module imports no model library.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

import torch

from kvcomm.core.rope import Rotary

WEIGHT_SAMPLES = 4096
"""Values hashed per weight tensor (evenly spaced) unless ``full_weights``: any retraining
or fine-tune changes them, and a 135M model is fingerprinted in well under a second."""

# Config keys that name where or how a checkpoint was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset", "name_or_path"}


@dataclass(frozen=True)
class ModelFingerprint:
    """checkpoint: digest of the config and weights. tokenizer: digest of vocabulary, special
    tokens and chat template. kv_dtype: dtype of the KV the model caches (e.g. "float32").
    rope: digest of the rotary numbers (``rope_digest``)."""

    checkpoint: str
    tokenizer: str
    kv_dtype: str
    rope: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "ModelFingerprint":
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names) or not all(isinstance(data[n], str) for n in names):
            raise ValueError(f"a model fingerprint is an object with string fields {', '.join(names)}; got {str(data)[:200]}")
        return cls(**data)

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Human-readable differences, e.g. ``"checkpoint: saved 1a2b.., this model 3c4d.."``."""
        return [
            f"{f.name}: saved {getattr(self, f.name)[:16]}, this model {getattr(other, f.name)[:16]}"
            for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)
        ]


def _digest(parts) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def rope_digest(rotary: Rotary) -> str:
    """Digest of every number realignment uses: inverse frequencies (exact fp32 bytes),
    attention scaling, head dim, pairing and exact-length limit."""
    return _digest([
        rotary.inv_freq.contiguous().numpy().tobytes(), repr(float(rotary.attention_scaling)), rotary.head_dim,
        rotary.interleaved, rotary.max_exact_length,
    ])


def _tensor_bytes(tensor: torch.Tensor, full: bool) -> bytes:
    flat = tensor.detach().reshape(-1)
    if not full and flat.numel() > WEIGHT_SAMPLES:
        flat = flat[torch.arange(WEIGHT_SAMPLES, dtype=torch.int64) * (flat.numel() - 1) // (WEIGHT_SAMPLES - 1)]
    flat = flat.to("cpu")
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: hash its raw bits
        flat = flat.view(torch.int16)
    return flat.contiguous().numpy().tobytes()


def checkpoint_digest(model: torch.nn.Module, full_weights: bool = False) -> str:
    """Digest of the model's config (without load-location keys) and of every parameter and
    buffer: name, shape, dtype and ``WEIGHT_SAMPLES`` evenly spaced values (all with ``full_weights``)."""
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    config_dict = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    parts: list = [type(model).__name__, json.dumps(config_dict, sort_keys=True, default=str)]
    for name, tensor in sorted(model.state_dict().items()):
        parts += [name, tuple(tensor.shape), str(tensor.dtype), _tensor_bytes(tensor, full_weights)]
    return _digest(parts)


def tokenizer_digest(tokenizer) -> str:
    """Digest of the vocabulary (token -> id), the special tokens and the chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(getattr(tokenizer, "all_special_tokens", []) or [])
    template = getattr(tokenizer, "chat_template", None) or ""
    return _digest([json.dumps(vocab, ensure_ascii=False), json.dumps(special), template])


def model_fingerprint(
    model: torch.nn.Module, tokenizer, rotary: Rotary, kv_dtype: torch.dtype | None = None, full_weights: bool = False,
) -> ModelFingerprint:
    """The fingerprint of ``model`` + ``tokenizer`` with its (self-checked) ``rotary``;
    ``kv_dtype`` defaults to the dtype of the model's first floating-point parameter."""
    if kv_dtype is None:
        kv_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return ModelFingerprint(
        checkpoint_digest(model, full_weights), tokenizer_digest(tokenizer), str(kv_dtype).removeprefix("torch."),
        rope_digest(rotary),
    )
