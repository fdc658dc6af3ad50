"""Read a transformers model's rotary embedding and prove realignment exact on it.

``rotary_from_model`` takes the inverse frequencies and attention scaling from the
model's own rotary module (so every scaling type transformers implements is covered by
construction), finds the channel pairing by trying both, and runs ``self_check``: keys
the model computes for a token run placed at position ``s`` must equal the keys computed
at position 0 shifted by ``s``. Reuse is refused (``RopeError``) for models without RoPE,
with non-attention layers, or that fail the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomm.rope import RopeError, Rotary

SELF_CHECK_TOLERANCE = 1e-4
"""Max absolute key error (relative to max(1, |k|max)) for the self-check, fp32."""

_ATTENTION_LAYER_TYPES = {"full_attention"}


@dataclass(frozen=True)
class SelfCheck:
    """Result of realigning a model's own keys: errors are max absolute differences."""

    max_abs_error: float
    layer0_abs_error: float
    key_scale: float
    shift: int
    tokens: int

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= SELF_CHECK_TOLERANCE * max(1.0, self.key_scale)


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    candidates = [m for _, m in model.named_modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not candidates:
        raise RopeError(
            f"{type(model).__name__} has no rotary embedding module with inv_freq; kvcomm realigns RoPE keys "
            "and cannot reuse KV for this model (use dense prefill)"
        )
    if len({id(m) for m in candidates}) > 1 and len({tuple(m.inv_freq.tolist()) for m in candidates}) > 1:
        raise RopeError(f"{type(model).__name__} uses several different rotary embeddings; reuse is not supported")
    return candidates[0]


def _layer_kinds(text) -> set[str]:
    """Attention kinds of the layers, inferred the way transformers' ``DynamicCache`` does.

    Without ``layer_types``, a config with ``sliding_window`` (e.g. Mistral v0.1, whose default
    is 4096) or ``attention_chunk_size`` gets sliding/chunked cache layers that drop old keys.
    """
    kinds = getattr(text, "layer_types", None)
    if kinds:
        return set(kinds)
    if getattr(text, "sliding_window", None) is not None:
        return {"sliding_attention"}
    if getattr(text, "attention_chunk_size", None) is not None:
        return {"chunked_attention"}
    return {"full_attention"}


def _check_layer_types(config) -> None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = _layer_kinds(text)
    if not kinds <= _ATTENTION_LAYER_TYPES:
        raise RopeError(
            f"model has layer types {sorted(kinds)}; only full-attention layers keep a KV cache that "
            "kvcomm can realign (hybrid linear-attention / sliding-window models are refused)"
        )


def _frequency_limit(module: torch.nn.Module, rope_type: str) -> int | None:
    """Length beyond which transformers recomputes this rope type's frequencies, or None."""
    if rope_type == "longrope":
        return module.config.rope_parameters["original_max_position_embeddings"]
    if rope_type == "dynamic":
        # transformers resets to the original frequencies only when max(position) + 1 is strictly
        # below original_max_seq_len: after a longer sequence has grown them, a sequence of exactly
        # that length keeps the grown frequencies.
        return module.original_max_seq_len - 1
    return None


def _candidate(module: torch.nn.Module, head_dim: int, interleaved: bool) -> Rotary:
    inv_freq = getattr(module, "original_inv_freq", module.inv_freq)
    rope_type = getattr(module, "rope_type", "default")
    limit = _frequency_limit(module, rope_type) if isinstance(rope_type, str) else None
    return Rotary(inv_freq, float(getattr(module, "attention_scaling", 1.0)), head_dim, interleaved, limit)


def _keys(model: torch.nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Cached keys of ``ids`` placed at ``[start, start + T)``: ``[layers, kv_heads, T, head_dim]``."""
    positions = torch.arange(start, start + ids.shape[-1])[None]
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=positions, use_cache=True)
    return torch.stack([layer.keys[0] for layer in out.past_key_values.layers]).float()


def self_check(model: torch.nn.Module, rotary: Rotary, tokens: int = 24, shift: int = 37, seed: int = 0) -> SelfCheck:
    """Compare ``rotary.shift(keys at 0, shift)`` with the model's keys at ``shift``, all layers."""
    limit = rotary.max_exact_length
    if limit is not None:
        shift = max(1, min(shift, limit - tokens))
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    at_zero, at_shift = _keys(model, ids, 0), _keys(model, ids, shift)
    error = (rotary.shift(at_zero, shift) - at_shift).abs()
    return SelfCheck(float(error.max()), float(error[0].max()), float(at_shift.abs().max()), shift, tokens)


def rotary_from_model(model: torch.nn.Module) -> tuple[Rotary, SelfCheck]:
    """The model's Rotary (pairing detected) and its passing self-check, or RopeError saying why not."""
    _check_layer_types(model.config)
    module = _rotary_module(model)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    results = []
    for interleaved in (False, True):
        rotary = _candidate(module, head_dim, interleaved)
        check = self_check(model, rotary)
        if check.passed:
            return rotary, check
        results.append(check)
    best = min(results, key=lambda c: c.max_abs_error)
    raise RopeError(
        f"RoPE self-check failed for {type(model).__name__}: realigned keys differ from keys computed at the "
        f"target position by up to {best.max_abs_error:.3g} (tolerance {SELF_CHECK_TOLERANCE:g} x key scale "
        f"{best.key_scale:.3g}); reuse is refused for this model"
    )
