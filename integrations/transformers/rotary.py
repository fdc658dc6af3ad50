"""Read a transformers model's rotary embedding and prove realignment exact on it.

``rotary_from_model`` takes the inverse frequencies and attention scaling from the
model's own rotary module (so every scaling type transformers implements is covered by
construction), finds the channel pairing by trying both, and runs ``self_check``: keys
the model computes for a token run placed at position ``s`` must equal the keys computed
at position 0 shifted by ``s``, to within ``self_check_tolerance`` of the dtype the model
caches its keys in. Reuse is refused (``RopeError``) for models without RoPE, with
non-attention layers, or that fail the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcomm.core.rope import RopeError, Rotary

SELF_CHECK_TOLERANCE = 1e-4
"""Max absolute key error (relative to max(1, |k|max)) for the self-check of fp32 and fp64 keys."""

MODEL_ROPE_ROUNDING = 1.5 * math.sqrt(2)
"""The model's own RoPE rounding of one cached key, in units of ``eps(dtype) * |k|max``.

transformers rounds cos and sin to the model dtype and rounds both products and their sum,
each to within ``eps / 2`` relative: a channel of a pair ``(x1, x2)`` of norm ``r`` is off by
at most ``eps * (|x1 cos| + |x2 sin|) + eps / 2 * r <= 1.5 * eps * r``, and ``r <= sqrt(2) |k|max``."""


def self_check_tolerance(dtype: torch.dtype) -> float:
    """Max realignment error the self-check accepts, relative to ``max(1, |k|max)``, for keys cached in ``dtype``.

    fp32/fp64: ``SELF_CHECK_TOLERANCE``. bf16/fp16: twice what a faithful realignment can
    show, ``2 * (2 * MODEL_ROPE_ROUNDING + 0.5) * eps(dtype)``: the check compares the model
    with itself at two positions, each run carrying its own RoPE rounding, and the shifted keys
    are rounded once more (half an ulp) to the cache dtype. A wrong rotary (frequency, pairing,
    width, scaling) is off by a fraction of ``|k|`` itself, far above this for every float dtype.
    """
    if not dtype.is_floating_point:
        raise RopeError(f"keys must be floating point for the RoPE self-check, got {dtype}")
    faithful = (2 * MODEL_ROPE_ROUNDING + 0.5) * torch.finfo(dtype).eps
    return max(SELF_CHECK_TOLERANCE, 2 * faithful)

_ATTENTION_LAYER_TYPES = {"full_attention"}


@dataclass(frozen=True)
class SelfCheck:
    """Result of realigning a model's own keys: errors are max absolute differences.

    dtype: the dtype the model caches keys in (and the realigned keys are rounded to);
    ``tolerance`` is ``self_check_tolerance(dtype)``, relative to ``max(1, key_scale)``.
    """

    max_abs_error: float
    layer0_abs_error: float
    key_scale: float
    shift: int
    tokens: int
    dtype: torch.dtype = torch.float32

    @property
    def tolerance(self) -> float:
        return self_check_tolerance(self.dtype)

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance * max(1.0, self.key_scale)


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
    """Cached keys of ``ids`` placed at ``[start, start + T)``: ``[layers, kv_heads, T, head_dim]``,
    in the dtype the model caches them in, on the model's device."""
    device = next(model.parameters()).device
    positions = torch.arange(start, start + ids.shape[-1], device=device)[None]
    with torch.no_grad():
        out = model(input_ids=ids[None].to(device), position_ids=positions, use_cache=True)
    return torch.stack([layer.keys[0] for layer in out.past_key_values.layers])


def self_check(model: torch.nn.Module, rotary: Rotary, tokens: int = 24, shift: int = 37, seed: int = 0) -> SelfCheck:
    """Compare ``rotary.shift(keys at 0, shift)`` with the model's keys at ``shift``, all layers.

    The shifted keys are rounded to the model's cache dtype, as reused KV is, before the comparison."""
    limit = rotary.max_exact_length
    if limit is not None:
        shift = max(1, min(shift, limit - tokens))
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    at_zero, at_shift = _keys(model, ids, 0), _keys(model, ids, shift)
    error = (rotary.shift(at_zero, shift).float() - at_shift.float()).abs()
    scale = float(at_shift.float().abs().max())
    return SelfCheck(float(error.max()), float(error[0].max()), scale, shift, tokens, at_shift.dtype)


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
        f"target position by up to {best.max_abs_error:.3g} (tolerance for {str(best.dtype).removeprefix('torch.')} "
        f"keys {best.tolerance:.3g} x max(1, key scale {best.key_scale:.3g})); reuse is refused for this model"
    )
