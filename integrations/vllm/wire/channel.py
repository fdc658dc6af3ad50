"""The in-process channel between a vLLM engine's kvcomm connector and its callers.

One process-level ``Channel`` per engine (keyed by ``KVTransferConfig.engine_id``) carries
state between the connector instances and callers that share a process: in the worker, the
planner (``vllm.planning.worker_plans``) and the layer hooks (``vllm.connector.worker``); with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler, worker and caller in one process) also
in-process callers such as ``VllmExecutor``. Across processes the connector sends metadata only (``vllm.wire.messages``).
It holds KV to inject per request handle, the real KV captured for it (copied once, when its
request finished, and kept on the KV cache's device until taken), the served model's ``Rotary`` (read from vLLM's rotary module
and self-checked by the worker side at start-up), and why the connector is off if it refused
the engine's configuration at start-up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcomm.core.kv import KV
from kvcomm.core.place import Piece
from kvcomm.core.rope import Rotary


@dataclass
class Capture:
    """Real KV read back from vLLM's cache for one request, rotated at absolute positions.

    keys, values: ``[layers, kv_heads, capacity, head_dim]`` holding positions
    ``[start, start + capacity)`` (buffer index ``p - start``); position ``p`` is valid once
    ``filled[p - start]`` is set (``[capacity]`` bool).
    """

    keys: torch.Tensor
    values: torch.Tensor
    filled: torch.Tensor
    start: int = 0

    @staticmethod
    def empty(layers: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu", start: int = 0) -> "Capture":
        """Buffers for positions ``[start, start + capacity)`` on ``device`` (the KV cache's: the
        connector copies a finished request's tokens there, every layer at once, and the engine
        learns from them there; nothing goes through the host), keys and values views of one
        allocation; ``filled`` on the host."""
        both = torch.empty(layers, 2, heads, capacity, head_dim, dtype=dtype, device=device)
        return Capture(both[:, 0], both[:, 1], torch.zeros(capacity, dtype=torch.bool), start)

    @property
    def end(self) -> int:
        """One past the last position the buffers hold."""
        return self.start + self.filled.numel()

    def has(self, start: int, end: int) -> bool:
        """Whether every position of ``[start, end)`` was captured."""
        return self.start <= start <= end <= self.end and bool(self.filled[start - self.start : end - self.start].all())

    def mark(self, positions: torch.Tensor) -> None:
        """Positions (absolute) now captured."""
        self.filled[positions - self.start] = True

    @property
    def kv(self) -> KV:
        return KV(self.keys, self.values)

    def span(self, start: int, end: int) -> KV:
        """Captured KV of positions ``[start, end)``; raises if any was not captured."""
        if not self.has(start, end):
            missing = [p for p in range(start, end) if not self.has(p, p + 1)]
            raise RuntimeError(f"kvcomm connector did not capture positions {missing[:8]}... of [{start}, {end})")
        a, b = start - self.start, end - self.start
        return KV(self.keys[:, :, a:b].clone(), self.values[:, :, a:b].clone())


@dataclass(frozen=True)
class Injection:
    """KV to write for prompt positions ``[0, length)``: the fused writer's pieces (target token
    = prompt position), written straight into the request's cache slots when they are known."""

    pieces: tuple[Piece, ...]
    length: int

    @staticmethod
    def of_kv(kv: KV) -> "Injection":
        """KV already rotated at its positions ``[0, kv.length)`` (e.g. a materialized prefix)."""
        return Injection((Piece(kv, 0, 0, rotate=False),), kv.length)


@dataclass
class Order:
    """What the caller asks of the connector for one request handle.

    inject: what to load for prompt positions ``[0, inject.length)`` (None: load nothing).
    capture_from, capture_to: prompt+output positions whose real KV to keep (``capture_to`` 0:
    capture nothing).
    """

    inject: Injection | None = None
    capture_from: int = 0
    capture_to: int = 0

    def __post_init__(self) -> None:
        if self.inject is not None and not isinstance(self.inject, Injection):
            raise TypeError(f"Order.inject must be an Injection (Injection.of_kv(kv) for rotated KV), got {type(self.inject).__name__}")


@dataclass
class Channel:
    """One engine's orders, captures and prompt completion times (``time.perf_counter()``
    when the forward computing a request's last prompt token ended), keyed by request handle.

    ``finals``: handles of in-process orders whose request finished and whose capture the
    worker copies in a later engine step (``messages.FinalCapture``); their caller steps the
    engine until ``awaits_final`` is False, then takes the capture."""

    orders: dict[str, Order] = field(default_factory=dict)
    captures: dict[str, Capture] = field(default_factory=dict)
    prompt_done_at: dict[str, float] = field(default_factory=dict)
    finals: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    refusal: str | None = None
    """Why this engine's connector is off (set once at start-up; None: it is on)."""
    rotary: Rotary | None = None
    """The served model's rotary numbers, from vLLM's own module (set at start-up when the connector is on)."""
    rope_check: Any = None
    """The ``SelfCheck`` that ``rotary`` passed against vLLM's keys."""

    def place(self, handle: str, order: Order) -> None:
        with self.lock:
            if handle in self.orders:
                raise ValueError(f"request handle {handle!r} is already in use")
            self.orders[handle] = order

    def order(self, handle: str) -> Order | None:
        with self.lock:
            return self.orders.get(handle)

    def expect_final(self, handle: str) -> None:
        """The handle's request finished; its capture is copied in a later engine step."""
        with self.lock:
            self.finals.add(handle)

    def awaits_final(self, handle: str) -> bool:
        """Whether the handle's finished request still waits for its capture to be copied."""
        with self.lock:
            return handle in self.finals

    def put_final(self, handle: str, capture: Capture | None) -> None:
        """The handle's final capture (None: not copied, e.g. its order was taken back) is done."""
        with self.lock:
            self.finals.discard(handle)
            if capture is not None:
                self.captures[handle] = capture

    def take(self, handle: str) -> tuple[Capture | None, float | None]:
        """Remove the handle's state; return its capture (on the KV cache's device) and prompt
        completion time (None if absent; ``prompt_done_at`` may hold a ``DeviceClock`` reading,
        resolved here). A final capture not copied yet is then skipped (its order is gone)."""
        with self.lock:
            self.orders.pop(handle, None)
            self.finals.discard(handle)
            capture, done_at = self.captures.pop(handle, None), self.prompt_done_at.pop(handle, None)
        return capture, done_at() if callable(done_at) else done_at


_CHANNELS: dict[str, Channel] = {}
_LOCK = threading.Lock()


def channel(engine_id: str) -> Channel:
    """The channel of engine ``engine_id`` (created on first use)."""
    with _LOCK:
        if engine_id not in _CHANNELS:
            _CHANNELS[engine_id] = Channel()
        return _CHANNELS[engine_id]


def drop_channel(engine_id: str) -> None:
    """Forget engine ``engine_id``'s channel (its engine has shut down); absent: nothing."""
    with _LOCK:
        _CHANNELS.pop(engine_id, None)
