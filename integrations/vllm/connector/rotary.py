"""The served model's ``Rotary``, read from vLLM's own rotary embedding module and checked
against the keys that module computes.

vLLM writes the KV cache with its own rotary numbers, which differ from transformers' for
some scaling types (vLLM's dynamic NTK and longrope are static: one frequency set chosen at
start-up, where transformers switches by sequence length), so realignment must use vLLM's.

The module is found in vLLM's ``get_rope`` cache (``vllm.model_executor.layers.rotary_embedding._ROPE_DICT``),
which holds the very instances the loaded models keep as ``rotary_emb``: no KV connector hook
hands the connector the model itself. Types whose numbers a ``Rotary`` represents exactly are
read field by field; any other type raises ``RopeError`` saying what is unsupported.
``self_check`` runs the module's forward on random keys at several positions and requires
realigned keys to equal directly rotated ones within ``self_check_tolerance`` of the dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcomm.core.rope import RopeError, Rotary
from kvcomm.integrations.transformers.rotary import SelfCheck

SUPPORTED = ("RotaryEmbedding", "LinearScalingRotaryEmbedding (one factor)", "Llama3RotaryEmbedding",
             "DynamicNTKScalingRotaryEmbedding", "YaRNScalingRotaryEmbedding", "Phi3LongRoPEScaledRotaryEmbedding")
"""vLLM rotary classes kvcomm reads (exact classes, not subclasses)."""


def _unsupported(module: Any, why: str = "") -> RopeError:
    return RopeError(
        f"vLLM rotary embedding {type(module).__name__} is not supported by kvcomm's realignment{why}; kvcomm "
        f"supports {', '.join(SUPPORTED)}. Serve a model with default, linear, llama3, dynamic (factor), yarn or "
        "longrope RoPE, or run vLLM without the kvcomm connector"
    )


def rotary_from_vllm(module: Any) -> Rotary:
    """The ``Rotary`` of vLLM rotary module ``module``, or RopeError if it cannot be represented exactly."""
    from vllm.model_executor.layers.rotary_embedding import (
        DynamicNTKScalingRotaryEmbedding, LinearScalingRotaryEmbedding, Llama3RotaryEmbedding,
        Phi3LongRoPEScaledRotaryEmbedding, RotaryEmbedding, YaRNScalingRotaryEmbedding,
    )

    kind = type(module)
    scaling, limit = 1.0, None
    if kind in (RotaryEmbedding, Llama3RotaryEmbedding):
        inv_freq = module._compute_inv_freq(module.base)
    elif kind is LinearScalingRotaryEmbedding:
        if len(module.scaling_factors) != 1:
            raise _unsupported(module, f" with several scaling factors {module.scaling_factors}")
        inv_freq = module._compute_inv_freq(module.base) / float(module.scaling_factors[0])
    elif kind is DynamicNTKScalingRotaryEmbedding:
        # vLLM's dynamic NTK is static: its cos/sin cache uses this one enlarged base for every position.
        rd, factor = module.rotary_dim, module.scaling_factor
        base = module.base * ((factor * module.max_position_embeddings / module.max_trained_positions)
                              - (factor - 1)) ** (rd / (rd - 2))
        inv_freq = module._compute_inv_freq(base)
    elif kind is YaRNScalingRotaryEmbedding:
        inv_freq, scaling = module._compute_inv_freq(module.scaling_factor), float(module.mscale)
    elif kind is Phi3LongRoPEScaledRotaryEmbedding:
        # vLLM picks the long or the short factors once, from max_model_len, for every position.
        if module.use_long_rope:
            inv_freq, scaling = module._compute_inv_freq(module.long_factor), float(module.long_mscale)
        else:
            inv_freq, scaling = module._compute_inv_freq(module.short_factor), float(module.short_mscale)
            limit = int(module.original_max_position_embeddings)
    else:
        raise _unsupported(module)
    if module.rotary_dim % 2 or inv_freq.numel() * 2 != module.rotary_dim:
        raise _unsupported(module, f" with rotary_dim {module.rotary_dim} and {inv_freq.numel()} frequencies")
    interleaved = not bool(getattr(module, "is_neox_style", True))
    return Rotary(inv_freq, scaling, int(module.head_size), interleaved, limit)


def find_rotary_module(head_size: int, rope_parameters: dict | None = None) -> Any:
    """vLLM's rotary module for a model with ``head_size`` (and ``rope_parameters``, to tell
    models apart when several are loaded in this process), or RopeError."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    found = {id(m): m for key, m in list(_ROPE_DICT.items()) if key[0] == head_size}
    if len(found) > 1 and rope_parameters:
        wanted = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rope_parameters.items())
        found = {id(m): m for key, m in list(_ROPE_DICT.items()) if key[0] == head_size and key[4] == wanted} or found
    if not found:
        raise RopeError(
            f"vLLM built no rotary embedding with head size {head_size} through get_rope; kvcomm realigns RoPE keys "
            "with the served model's own rotary numbers and cannot reuse KV for this model"
        )
    modules = list(found.values())
    if len(modules) > 1:
        names = sorted({type(m).__name__ for m in modules})
        raise RopeError(
            f"this process holds {len(modules)} different vLLM rotary embeddings for head size {head_size} ({', '.join(names)}); "
            "kvcomm cannot tell which one the served model's layers use (models with several RoPEs are not supported)"
        )
    return modules[0]


def _module_keys(module: Any, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[T, heads, head_dim]`` rotated by vLLM's module at ``positions`` (its forward, as the model calls it)."""
    tokens, heads, dim = keys.shape
    query = torch.zeros(tokens, dim, dtype=keys.dtype, device=keys.device)
    _, rotated = module(positions, query, keys.reshape(tokens, heads * dim).clone())
    return rotated.reshape(tokens, heads, dim)


def self_check(module: Any, rotary: Rotary, dtype: torch.dtype, max_length: int, tokens: int = 8, heads: int = 2,
               seed: int = 0) -> SelfCheck:
    """Realign random keys that vLLM's ``module`` rotated at ``[0, T)`` to several targets up to
    ``max_length`` and compare with the module's own keys there, and with ``rotary.rotate``
    of the raw keys. Errors are max absolute differences, relative to ``max(1, |k|max)``."""
    limit = min(max_length, rotary.max_exact_length or max_length)
    if limit <= tokens:
        raise RopeError(f"the RoPE self-check needs more than {tokens} positions, this engine allows {limit}")
    device = next(iter(module.buffers())).device
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(tokens, heads, rotary.head_dim, generator=generator).to(device, dtype)
    base = torch.arange(tokens, device=device)
    worst, shift, scale = 0.0, 0, 1.0
    with torch.no_grad():
        at_zero = _module_keys(module, raw, base)
        for delta in sorted({1, 37 % (limit - tokens) or 1, limit - tokens}):
            at_delta = _module_keys(module, raw, base + delta)
            shifted = rotary.shift(at_zero.transpose(0, 1), delta).transpose(0, 1).to(dtype)
            direct = rotary.rotate(raw.transpose(0, 1), base + delta).transpose(0, 1).to(dtype)
            error = max(float((shifted.float() - at_delta.float()).abs().max()),
                        float((direct.float() - at_delta.float()).abs().max()))
            scale = max(scale, float(at_delta.float().abs().max()))
            if error >= worst:
                worst, shift = error, delta
    return SelfCheck(worst, worst, scale, shift, tokens, dtype)


def served_rotary(vllm_config: Any) -> tuple[Rotary, SelfCheck]:
    """The served model's ``Rotary`` from vLLM's module, self-checked, or RopeError saying why not."""
    model_config = vllm_config.model_config
    text = model_config.hf_text_config
    module = find_rotary_module(model_config.get_head_size(), getattr(text, "rope_parameters", None))
    rotary = rotary_from_vllm(module)
    check = self_check(module, rotary, model_config.dtype, int(model_config.max_model_len))
    if not check.passed:
        raise RopeError(
            f"RoPE self-check failed against vLLM's {type(module).__name__}: realigned keys differ from the keys vLLM "
            f"computes at the target position by up to {check.max_abs_error:.3g} (tolerance for "
            f"{str(check.dtype).removeprefix('torch.')} keys {check.tolerance:.3g} x max(1, key scale {check.key_scale:.3g})); "
            "reuse is refused for this model"
        )
    return rotary, check
