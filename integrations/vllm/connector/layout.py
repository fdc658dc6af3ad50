"""Reading and writing token KV in one vLLM attention layer's paged cache, on any backend.

Every standard vLLM attention backend (CPU, FlashAttention, FlashInfer, Triton) keeps one
tensor per layer whose *logical* shape is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
but whose element order inside a block is the backend's own (strided views, keys stored
transposed per block on some CPU ISAs). We never hand-code any of those layouts: where each
key and value element of a block is stored is learned once per cache geometry (backend
implementation, block shape, strides, dtype, device, KV cache dtype) by writing known values
through the layer's own op, ``layer.impl.do_kv_cache_update(layer, key, value, kv_cache,
slot_mapping)`` (the very call vLLM's forward uses to store computed KV), into a one-block
probe cache with the real cache's strides and finding where each element landed. A round trip
of random KV through the op and the learned offsets must be exact before they are used
(``LayoutError`` otherwise). The connector's worker writes and reads every layer at once
through those offsets (``KvIO.offsets``, ``kvcomm.core.kv_target.Paged``); ``KvIO.write``
and ``KvIO.read`` do one layer through the op and the offsets.

A slot is ``block * block_size + offset`` with ``block_size = kv_cache.shape[2]`` (the
kernel block size), the flat numbering of vLLM's slot mappings. Quantized (fp8) caches are
not readable this way: ``KvIO`` refuses them (the connector refuses them at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DIGIT = 128
"""Probe digit base: every integer below it is exact in fp16 and bf16 (8-bit mantissa)."""

READABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LayoutError(RuntimeError):
    """The layer's cache layout could not be learned or failed its round-trip check."""


@dataclass(frozen=True)
class _Gather:
    """Where inside one block every key and value element is stored.

    Each tensor is ``[block_size, kv_heads, head_dim]`` int64 (on the cache's device): the
    key (value) of token offset ``o``, head ``h``, channel ``d`` of block ``b`` is the storage
    element ``kv_cache.storage_offset() + b * kv_cache.stride(0) + offsets[o, h, d]``. Storage
    offsets rather than logical coordinates, so a read is one 1-D ``index_select`` (a gather
    with four index tensors costs several times more on the CPU).
    """

    key_offsets: torch.Tensor
    value_offsets: torch.Tensor


_GATHERS: dict[tuple, _Gather] = {}


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.ndim != 4 or kv_cache.shape[-1] % 2:
        raise LayoutError(
            f"expected an attention KV cache with logical shape [num_blocks, kv_heads, block_size, 2 * head_dim], "
            f"got shape {tuple(kv_cache.shape)}; this attention backend's cache is not supported by kvcomm"
        )
    if kv_cache.dtype not in READABLE_DTYPES:
        raise LayoutError(
            f"KV cache dtype {kv_cache.dtype} is not readable by kvcomm (supported: fp32, fp16, bf16); "
            "start vLLM with kv_cache_dtype='auto'"
        )


class KvIO:
    """Writes and reads token KV of one attention layer.

    layer: the vLLM attention module (``Attention``) that owns ``kv_cache``; its
    ``impl.do_kv_cache_update`` is the only thing that ever writes the cache here.
    kv_cache: the layer's cache tensor (logical ``[num_blocks, kv_heads, block_size,
    2 * head_dim]``). Building a ``KvIO`` learns (or reuses) the gather index for this
    geometry; raises ``LayoutError`` with what to change when that fails.
    """

    def __init__(self, layer: Any, kv_cache: torch.Tensor):
        _check_cache(kv_cache)
        impl = getattr(layer, "impl", None)
        if not callable(getattr(impl, "do_kv_cache_update", None)):
            raise LayoutError(
                f"attention implementation {type(impl).__name__} has no do_kv_cache_update; kvcomm needs a backend "
                "that writes the KV cache with it (CPU_ATTN, FLASH_ATTN, TRITON_ATTN, FLASHINFER)"
            )
        self.layer = layer
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.dtype = kv_cache.dtype
        self.block_size = int(kv_cache.shape[2])
        self.heads = int(kv_cache.shape[1])
        self.head_dim = int(kv_cache.shape[3]) // 2
        key = (type(impl).__module__, type(impl).__qualname__, str(getattr(impl, "kv_cache_dtype", "auto")),
               tuple(kv_cache.shape[1:]), tuple(kv_cache.stride()[1:]), kv_cache.dtype, str(kv_cache.device))
        if key not in _GATHERS:
            _GATHERS[key] = _learn(layer, kv_cache)
        self._gather = _GATHERS[key]
        self.geometry = (key, kv_cache.stride(0))
        """Layers with equal ``geometry`` store a slot's KV at the same storage indices
        (relative to their first element): one ``read_index`` serves them all."""

    @property
    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) storage offsets ``[block_size, kv_heads, head_dim]`` int64 inside a block,
        relative to the block's first element (``kvcomm.core.kv_target.Paged``'s tables)."""
        return self._gather.key_offsets, self._gather.value_offsets

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``keys``/``values`` (``[N, kv_heads, head_dim]``, the cache's dtype and
        device, contiguous) into ``slots`` (``[N]`` int64, same device)."""
        _write(self.layer, self.kv_cache, keys, values, slots)

    def read_index(self, slots: torch.Tensor) -> "ReadIndex":
        """Where the KV of ``slots`` (``[N]`` int64 on the cache's device) is stored, for
        ``read_at`` on this layer or any of the same ``geometry``."""
        return _read_index(self._gather, self.kv_cache.stride(0), slots)

    def read_at(self, index: "ReadIndex") -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``index``'s slots: two ``[N, kv_heads, head_dim]`` tensors
        (copies, cache dtype and device), one 1-D gather each."""
        return _read_at(self.kv_cache, index)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values stored at ``slots``: ``read_at(read_index(slots))``."""
        return self.read_at(self.read_index(slots))


@dataclass(frozen=True)
class ReadIndex:
    """Storage indices of the keys and of the values of ``N`` slots, each ``[N, kv_heads,
    head_dim]`` int64, relative to the first element of a cache of one geometry."""

    keys: torch.Tensor
    values: torch.Tensor


def _read_index(gather: _Gather, block_stride: int, slots: torch.Tensor) -> ReadIndex:
    block_size = gather.key_offsets.shape[0]
    block, offset = slots // block_size, slots % block_size
    start = (block * block_stride)[:, None, None]
    return ReadIndex(start + gather.key_offsets[offset], start + gather.value_offsets[offset])


def _read_at(kv_cache: torch.Tensor, index: ReadIndex) -> tuple[torch.Tensor, torch.Tensor]:
    storage = _storage_view(kv_cache)
    keys = storage.index_select(0, index.keys.view(-1)).view(index.keys.shape)
    values = storage.index_select(0, index.values.view(-1)).view(index.values.shape)
    return keys, values


def _storage_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage ``kv_cache`` spans, from its first element."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(kv_cache.shape, kv_cache.stride()))
    return kv_cache.as_strided((extent,), (1,))


def _write(layer: Any, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)


def _probe_cache(kv_cache: torch.Tensor, fill: float) -> torch.Tensor:
    """A one-block cache with the real cache's block shape and strides (so the op lays it out
    the same way), every logical element set to ``fill``."""
    shape = (1, *kv_cache.shape[1:])
    probe = torch.empty_strided(shape, kv_cache.stride(), dtype=kv_cache.dtype, device=kv_cache.device)
    return probe.fill_(fill)


def _learn(layer: Any, kv_cache: torch.Tensor) -> _Gather:
    _, heads, block_size, twice_dim = kv_cache.shape
    dim = twice_dim // 2
    block_shape = (heads, block_size, twice_dim)
    keys = _locate(layer, kv_cache, dim, for_keys=True)
    values = _locate(layer, kv_cache, dim, for_keys=False)
    if bool(torch.isin(keys, values).any()):
        raise LayoutError("KV layout probe: keys and values landed on the same cache elements")
    _, head_stride, row_stride, column_stride = kv_cache.stride()
    offsets = []
    for flat in (keys, values):
        head, rest = flat // (block_size * twice_dim), flat % (block_size * twice_dim)
        offsets.append((head * head_stride + rest // twice_dim * row_stride + rest % twice_dim * column_stride).to(kv_cache.device))
    gather = _Gather(*offsets)
    _round_trip(layer, kv_cache, gather, block_shape)
    return gather


def _locate(layer: Any, kv_cache: torch.Tensor, dim: int, for_keys: bool) -> torch.Tensor:
    """Logical flat index inside ``[kv_heads, block_size, 2 * head_dim]`` of each key (or
    value) element of one block, ``[block_size, kv_heads, head_dim]``.

    Element indices are written in base-128 digits, one pass per digit (exact in any float
    dtype), the other half of the KV set to a negative sentinel and the cache prefilled with
    another; the elements holding non-negative values are ours, their digits spell which
    element each holds.
    """
    _, heads, block_size, _ = kv_cache.shape
    device, dtype = kv_cache.device, kv_cache.dtype
    count = block_size * heads * dim
    index = torch.arange(count, dtype=torch.int64, device=device).view(block_size, heads, dim)
    slots = torch.arange(block_size, dtype=torch.int64, device=device)
    sentinel = torch.full((block_size, heads, dim), -2.0, dtype=dtype, device=device)
    element = torch.zeros(heads * block_size * 2 * dim, dtype=torch.int64, device=device)
    where = None
    scale, passes = 1, 0
    while scale < count or passes == 0:
        probe = _probe_cache(kv_cache, -1.0)
        digit = ((index // scale) % _DIGIT).to(dtype)
        if for_keys:
            _write(layer, probe, digit, sentinel, slots)
        else:
            _write(layer, probe, sentinel, digit, slots)
        flat = probe[0].reshape(-1).to(torch.float32)
        held = flat >= 0
        if where is not None and not torch.equal(held, where):
            raise LayoutError("KV layout probe: the backend op wrote different elements on different passes")
        where = held
        element += flat.clamp(min=0).to(torch.int64) * scale
        scale *= _DIGIT
        passes += 1
    positions = torch.nonzero(where).view(-1)
    found = element[positions]
    expected = torch.arange(count, device=device)
    if positions.numel() != count or not torch.equal(torch.sort(found).values, expected):
        raise LayoutError(
            f"KV layout probe: expected {count} distinct {'key' if for_keys else 'value'} elements per block, "
            f"found {positions.numel()}; this attention backend's cache layout is not supported by kvcomm"
        )
    offsets = torch.empty(count, dtype=torch.int64, device=device)
    offsets[found] = positions
    return offsets.view(block_size, heads, dim).cpu()


def _round_trip(layer: Any, kv_cache: torch.Tensor, gather: _Gather, block_shape: tuple[int, int, int]) -> None:
    """Random KV written through the op into two probe blocks (in shuffled slot order) must
    read back bit for bit through ``gather``."""
    heads, block_size, twice_dim = block_shape
    device, dtype = kv_cache.device, kv_cache.dtype
    generator = torch.Generator().manual_seed(0)
    shape = (2, *kv_cache.shape[1:])
    probe = torch.empty_strided(shape, kv_cache.stride(), dtype=dtype, device=device).fill_(0.0)
    count = 2 * block_size
    slots = torch.randperm(count, generator=generator).to(device)
    keys = torch.randn(count, heads, twice_dim // 2, generator=generator).to(dtype).to(device)
    values = torch.randn(count, heads, twice_dim // 2, generator=generator).to(dtype).to(device)
    _write(layer, probe, keys, values, slots)
    got_keys, got_values = _read_at(probe, _read_index(gather, probe.stride(0), slots))
    if not (torch.equal(got_keys, keys) and torch.equal(got_values, values)):
        raise LayoutError(
            "KV layout self-check failed: KV written through the backend's do_kv_cache_update did not read back "
            "exactly; this attention backend is not supported by kvcomm"
        )
