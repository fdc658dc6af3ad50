"""Where token KV is written to (or read from): a contiguous KV buffer or a paged cache.

Both are one addressing rule (``kvcomm.core.triton_kernels``): element ``(l, h, t, d)`` of
keys is at ``layer_ptrs[l] + tok[t] + koff[off[t], h, d]`` (values: ``voff``), in elements of
the destination's dtype. A ``KVTarget`` holds those tables (host int64 tensors, moved to the
device with a call's other tables) and, for the torch composite, the tensors they address.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvcomm.core.device import pointer_table
from kvcomm.core.kv import KV


@dataclass(frozen=True)
class Paged:
    """A paged cache: one tensor per layer (same geometry), and where a token's elements sit
    inside a block.

    caches: per layer, the cache tensor (any shape; only its storage and ``storage_offset()``
    matter). key_offsets, value_offsets: int64 ``[block_size, kv_heads, head_dim]``: storage
    element of the key (value) of a slot's ``(offset in block, head, channel)``, relative to the
    block's first element. block_stride: elements between two blocks' first elements."""

    caches: tuple[torch.Tensor, ...]
    key_offsets: torch.Tensor
    value_offsets: torch.Tensor
    block_stride: int

    @property
    def block_size(self) -> int:
        return self.key_offsets.shape[0]

    def __post_init__(self) -> None:
        for name in ("key_offsets", "value_offsets"):  # the fused writer's tables: host copies, made once
            object.__setattr__(self, f"host_{name}", getattr(self, name).cpu().numpy().astype(np.int64))
        object.__setattr__(self, "contiguous_channels",
                           _channels_contiguous(self.host_key_offsets) and _channels_contiguous(self.host_value_offsets))


@dataclass(frozen=True)
class KVTarget:
    """``n`` tokens of every layer in ``buffer`` (a contiguous KV, tokens ``[start, start + n)``)
    or in ``paged`` (at ``slots``, ``[n]`` int64 on the host). Exactly one of the two is set."""

    n: int
    buffer: KV | None = None
    start: int = 0
    paged: Paged | None = None
    slots: torch.Tensor | None = None
    _indices: dict = field(default_factory=dict, compare=False, repr=False)
    """(device, at, m) -> ``_element_indices``: made once per target, shared by every layer."""

    @staticmethod
    def contiguous(buffer: KV, start: int, n: int) -> "KVTarget":
        """Tokens ``[start, start + n)`` of ``buffer`` (``[layers, kv_heads, T, head_dim]`` keys
        and values with equal strides, the last axis contiguous)."""
        k, v = buffer.keys, buffer.values
        if k.stride() != v.stride() or k.stride(3) != 1 or k.dtype != v.dtype or not 0 <= start <= start + n <= k.shape[2]:
            raise ValueError(f"a contiguous target needs keys and values of equal strides, channels contiguous, and "
                             f"tokens [{start}, {start + n}) inside {k.shape[2]}")
        return KVTarget(n, buffer=buffer, start=start)

    @staticmethod
    def at_slots(paged: Paged, slots: torch.Tensor) -> "KVTarget":
        return KVTarget(int(slots.numel()), paged=paged, slots=slots.to("cpu", torch.int64))

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.keys.dtype if self.buffer is not None else self.paged.caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.keys.device if self.buffer is not None else self.paged.caches[0].device

    @property
    def contiguous_channels(self) -> bool:
        """Whether a token's channels sit next to each other in the target (``koff``/``voff``
        ``[..., d]`` = ``[..., 0]`` + d): kernels then read the offset tables per token."""
        return True if self.buffer is not None else self.paged.contiguous_channels

    @property
    def layers(self) -> int:
        return self.buffer.keys.shape[0] if self.buffer is not None else len(self.paged.caches)

    def tables(self) -> dict[str, np.ndarray]:
        """The addressing tables (host int64, numpy): ``layer_ptrs [L]``, ``tok [n]``, ``off [n]``,
        ``koff``/``voff [block_size, H, D]`` (block size 1 for a buffer)."""
        if self.buffer is not None:
            k, v = self.buffer.keys, self.buffer.values
            item = k.element_size()
            sl, sh, st, _ = k.stride()
            layer_ptrs = k.data_ptr() + item * sl * np.arange(k.shape[0], dtype=np.int64)
            heads = np.arange(k.shape[1], dtype=np.int64)[:, None] * sh + np.arange(k.shape[3], dtype=np.int64)
            gap = (v.data_ptr() - k.data_ptr()) // item
            return {"layer_ptrs": layer_ptrs, "tok": (self.start + np.arange(self.n, dtype=np.int64)) * st,
                    "off": np.zeros(self.n, dtype=np.int64), "koff": heads[None], "voff": (heads + gap)[None]}
        p = self.paged
        slots = self.slots.numpy()
        return {"layer_ptrs": pointer_table(p.caches), "tok": slots // p.block_size * p.block_stride,
                "off": slots % p.block_size, "koff": p.host_key_offsets, "voff": p.host_value_offsets}

    def write(self, layer: int, at: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The torch composite's write of one layer: ``keys``/``values`` ``[H, m, D]`` (the
        target's dtype) to the target's tokens ``[at, at + m)``."""
        m = keys.shape[1]
        if self.buffer is not None:
            self.buffer.keys[layer, :, self.start + at : self.start + at + m].copy_(keys)
            self.buffer.values[layer, :, self.start + at : self.start + at + m].copy_(values)
            return
        storage = _storage_view(self.paged.caches[layer])
        k_at, v_at = self._element_indices(storage.device, at, m)
        # index_copy_ (slots are distinct): about half index_put_'s time on a CPU; reshape is a
        # view when keys are contiguous, as the composite's are
        storage.index_copy_(0, k_at, keys.reshape(-1))
        storage.index_copy_(0, v_at, values.reshape(-1))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values at the target's tokens, ``[H, n, D]`` each (copies)."""
        if self.buffer is not None:
            span = self.buffer.span(self.start, self.start + self.n)
            return span.keys[layer].clone(), span.values[layer].clone()
        storage = _storage_view(self.paged.caches[layer])
        k_at, v_at = self._element_indices(storage.device, 0, self.n)
        heads, dim = self.paged.key_offsets.shape[1:]
        return (storage.index_select(0, k_at).view(heads, self.n, dim),
                storage.index_select(0, v_at).view(heads, self.n, dim))

    def _element_indices(self, device: torch.device, at: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat storage indices (relative to a cache's first element) of every key and value
        element of the target's tokens ``[at, at + m)``, ``[H * m * D]`` each, in ``[H, m, D]``
        order (a contiguous layer of KV flattens onto them without a copy)."""
        held = self._indices.get((device, at, m))
        if held is not None:
            return held
        p = self.paged
        slots = self.slots[at : at + m].to(device)
        start = (slots // p.block_size * p.block_stride)[:, None, None]
        inner = slots % p.block_size
        held = self._indices[(device, at, m)] = ((start + p.key_offsets.to(device)[inner]).transpose(0, 1).reshape(-1),
                                                 (start + p.value_offsets.to(device)[inner]).transpose(0, 1).reshape(-1))
        return held


def _channels_contiguous(offsets: np.ndarray) -> bool:
    """Whether ``offsets`` ``[block_size, H, D]`` step by one element along channels."""
    return bool(np.array_equal(offsets - offsets[..., :1], np.broadcast_to(np.arange(offsets.shape[-1]), offsets.shape)))


def _storage_view(cache: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage ``cache`` spans, from its first element."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return cache.as_strided((extent,), (1,))
