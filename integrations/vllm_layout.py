"""Reading and writing token KV in vLLM's paged KV cache (CPU attention backend).

The CPU backend keeps one tensor per attention layer, ``[num_blocks, kv_heads, block_size,
2 * head_dim]``, whose block interiors are laid out by ISA-specific kernels (keys are stored
transposed per block on some ISAs). We never hand-write that layout: writes go through the
backend's own op (``cpu_attn_reshape_and_cache``), and reads use a gather index learned once
per (cache shape, dtype, ISA) by writing known values through the same op and finding where
each element landed. A slot is ``block_id * block_size + offset``, the same flat numbering
vLLM's slot mappings use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DIGIT = 128
"""Probe digit base: every integer below it is exact in fp16 and bf16 (8-bit mantissa)."""


def _check(kv_cache: torch.Tensor) -> None:
    if kv_cache.ndim != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            f"expected a CPU attention KV cache [num_blocks, kv_heads, block_size, 2 * head_dim], "
            f"got shape {tuple(kv_cache.shape)}; only vLLM's CPU attention backend is supported (GPU is untested)"
        )


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views of one layer's cache, as the CPU backend makes them."""
    _check(kv_cache)
    blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)


def write_slots(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write ``keys``/``values`` (``[N, kv_heads, head_dim]``) into ``slots`` (``[N]`` int64)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = split_cache(kv_cache)
    dtype = kv_cache.dtype
    ops.cpu_attn_reshape_and_cache(
        keys.to(dtype).contiguous(), values.to(dtype).contiguous(), key_cache, value_cache,
        slots.to(torch.int64).contiguous(), isa,
    )


@dataclass(frozen=True)
class _Gather:
    """Flat offsets inside one block (``[block_size, kv_heads, head_dim]`` each) of every key
    and value element, for one cache geometry."""

    keys: torch.Tensor
    values: torch.Tensor


_GATHERS: dict[tuple, _Gather] = {}


def _gather(kv_cache: torch.Tensor, isa: str) -> _Gather:
    _check(kv_cache)
    _, heads, block_size, twice_dim = kv_cache.shape
    key = (heads, block_size, twice_dim, kv_cache.dtype, isa)
    if key not in _GATHERS:
        _GATHERS[key] = _probe(heads, block_size, twice_dim // 2, kv_cache.dtype, isa)
    return _GATHERS[key]


def _probe(heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str) -> _Gather:
    """Locate every key and value element of one block by writing it through the op."""
    return _Gather(_locate(heads, block_size, head_dim, dtype, isa, keys=True),
                   _locate(heads, block_size, head_dim, dtype, isa, keys=False))


def _locate(heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str, keys: bool) -> torch.Tensor:
    """Flat in-block offset of each key (or value) element, ``[block_size, kv_heads, head_dim]``.

    Element indices are written in base-128 digits, one pass per digit (exact in any float
    dtype), the other half of the KV filled with a sentinel; the positions holding
    non-negative values are ours, and their digits spell which element each holds.
    """
    count = block_size * heads * head_dim
    index = torch.arange(count, dtype=torch.int64).view(block_size, heads, head_dim)
    slots = torch.arange(block_size, dtype=torch.int64)
    sentinel = torch.full((block_size, heads, head_dim), -2.0, dtype=dtype)
    element = torch.zeros(2 * count, dtype=torch.int64)
    where = None
    scale, power = 1, 0
    while scale < count or power == 0:
        cache = torch.full((1, heads, block_size, 2 * head_dim), -1.0, dtype=dtype)
        digit = ((index // scale) % _DIGIT).to(dtype)
        write_slots(cache, digit, sentinel, slots, isa) if keys else write_slots(cache, sentinel, digit, slots, isa)
        flat = cache.view(-1).to(torch.float32)
        held = flat >= 0
        if where is not None and not torch.equal(held, where):
            raise RuntimeError("KV layout probe: the op wrote different positions on different passes")
        where = held
        element += flat.clamp(min=0).to(torch.int64) * scale
        scale *= _DIGIT
        power += 1
    positions = torch.nonzero(where).view(-1)
    found = element[positions]
    if positions.numel() != count or not torch.equal(torch.sort(found).values, torch.arange(count)):
        raise RuntimeError(
            f"KV layout probe: expected {count} distinct {'key' if keys else 'value'} elements per block, "
            f"found {positions.numel()}; this cache layout is not supported"
        )
    offsets = torch.empty(count, dtype=torch.int64)
    offsets[found] = positions
    return offsets.view(block_size, heads, head_dim)


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values stored at ``slots`` (``[N]``): two ``[N, kv_heads, head_dim]`` tensors
    (copies, in the cache dtype)."""
    gather = _gather(kv_cache, isa)
    blocks = kv_cache.shape[0]
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(blocks, -1)
    slots = slots.to(torch.int64)
    block, offset = (slots // block_size)[:, None, None], slots % block_size
    return flat[block, gather.keys[offset]], flat[block, gather.values[offset]]
