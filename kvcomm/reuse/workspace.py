"""Reusable memory for the KV the engine assembles for one request at a time.

A fresh tensor of many MiB is new memory to the operating system: every 4 KiB page costs a
page fault on its first write, and that recurs whenever the allocator returns the memory to
the system between requests (glibc always does for blocks over 32 MiB, often for smaller
ones). A ``KVWorkspace`` lends the same memory to request after request instead (what the
faults cost: docs/measurements/2026-11-history.md).

Invariants: a buffer is lent to one holder at a time; what a lease yields is valid only until
the lease ends (the next lease may overwrite it), so a holder copies what must outlive it; idle
buffers never total more than ``max_idle_bytes`` (a buffer returned beyond that is freed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvcomm.core.kv import KV

_ALIGN = 64
"""Values start on a 64-byte boundary (a cache line, a full AVX-512 vector)."""

_GROWTH_STEP = 1 << 20
"""New buffers are 1.25x the request, rounded up to whole MiB."""


class KVWorkspace:
    """Idle byte buffers, lent as contiguous KV by ``lease``; thread-safe.

    max_idle_bytes: most bytes kept between leases (0: keep nothing, every lease allocates).
    """

    def __init__(self, max_idle_bytes: int):
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0 (got {max_idle_bytes})")
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []  # uint8 [bytes], smallest first
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)

    @contextmanager
    def lease(self, shape: tuple[int, int, int, int], key_dtype: torch.dtype, value_dtype: torch.dtype,
              device: torch.device | str = "cpu") -> Iterator[KV]:
        """Contiguous uninitialized KV of ``shape`` ``[layers, kv_heads, tokens, head_dim]`` on
        ``device`` for the ``with`` block: an idle buffer's memory there when one is large enough,
        else new memory."""
        elements = shape[0] * shape[1] * shape[2] * shape[3]
        key_bytes = -(-elements * key_dtype.itemsize // _ALIGN) * _ALIGN
        needed = key_bytes + elements * value_dtype.itemsize
        buffer = self._take(needed, torch.device(device))
        try:
            yield KV(buffer[: elements * key_dtype.itemsize].view(key_dtype).view(shape),
                     buffer[key_bytes:needed].view(value_dtype).view(shape))
        finally:
            self._give_back(buffer)

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The smallest idle buffer of >= ``nbytes`` on ``device``, else a new one with room to
        grow: prompts in a pipeline lengthen agent by agent, and pages never written cost no memory."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if buffer.numel() >= nbytes and buffer.device == device:
                    return self._idle.pop(i)
        return torch.empty(-(-nbytes * 5 // 4 // _GROWTH_STEP) * _GROWTH_STEP, dtype=torch.uint8, device=device)

    def _give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` idle if it fits under the cap, dropping smaller idle buffers to make room
        (the largest buffers serve the most requests)."""
        with self._lock:
            kept = sorted([*self._idle, buffer], key=lambda b: b.numel(), reverse=True)
            self._idle, total = [], 0
            for b in kept:
                if total + b.numel() <= self.max_idle_bytes:
                    self._idle.append(b)
                    total += b.numel()
            self._idle.reverse()
