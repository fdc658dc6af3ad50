"""Context handles: callers retain and release the base KV of shared content by ``context_id``.

A handle names one shared segment's content (``context_id`` is its ``shared_id``: the hash of
its token ids, or the caller's id). While retained, the engine keeps the segment's base KV,
so any prompt that carries the same content reuses it. Handles never change what a prompt
says: the caller still sends the text, and a released handle, or one whose KV was evicted
(a byte budget, a tenant cap), falls back to that text: the base is recomputed from the
tokens on next use, which costs one standalone prefill and is never an error.

The registry also bounds the bases it sees that nobody retains: beyond ``max_unretained_bytes``
the least recently used are dropped from the engine (retained bases are never dropped here).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from kvcomm.reuse.engine import BaseProvider, ReuseEngine
from kvcomm.core.kv import KV
from kvcomm.core.segments import Segment

HandleState = Literal["live", "evicted", "released", "unknown"]


@dataclass(frozen=True)
class ContextHandle:
    """A retained reference to one shared segment's base KV.

    context_id: the segment's ``shared_id``. token_count: its length in tokens.
    """

    context_id: str
    token_count: int


class ContextRegistry:
    """Reference counts on base KV held by one engine, plus an LRU bound on unretained bases.

    Thread-safe. ``max_unretained_bytes`` caps the bytes of bases that were seen through
    ``note`` (or ``provider``) and are not retained; None disables the cap.
    """

    def __init__(self, engine: ReuseEngine, max_unretained_bytes: int | None = 256 << 20):
        if max_unretained_bytes is not None and max_unretained_bytes < 0:
            raise ValueError(f"max_unretained_bytes must be >= 0 or None (got {max_unretained_bytes})")
        self.engine = engine
        self.max_unretained_bytes = max_unretained_bytes
        self._counts: dict[str, int] = {}
        self._released: set[str] = set()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # shared_id -> base bytes, LRU first
        self._lock = threading.RLock()

    # -- handles ---------------------------------------------------------------------------

    def retain(self, segment: Segment, provide: BaseProvider) -> ContextHandle:
        """Keep ``segment``'s base KV (computing it now if the engine has none) until released.

        Retaining the same content again returns an equal handle and adds a reference.
        """
        if not segment.is_shared:
            raise ValueError("only shared segments have context handles; give the segment a slot")
        with self._lock:
            if not self.engine.has_base(segment.shared_id):
                base = provide(segment)
                self.engine.register_base(segment, base)
                self._seen(segment.shared_id, base.nbytes)
            self._counts[segment.shared_id] = self._counts.get(segment.shared_id, 0) + 1
            self._released.discard(segment.shared_id)
            return ContextHandle(segment.shared_id, len(segment))

    def release(self, handle: ContextHandle | str) -> bool:
        """Drop one reference; returns False (and changes nothing) for an id not retained.

        The base stays in the engine as an unretained base (subject to the LRU bound) once
        the last reference goes: content still in use keeps being reused until evicted.
        """
        context_id = handle.context_id if isinstance(handle, ContextHandle) else handle
        with self._lock:
            count = self._counts.get(context_id, 0)
            if count == 0:
                return False
            if count == 1:
                del self._counts[context_id]
                self._released.add(context_id)
                self._shrink()
            else:
                self._counts[context_id] = count - 1
            return True

    def state(self, context_id: str) -> HandleState:
        """"live": retained and its base is held; "evicted": retained but its base was dropped
        (it comes back from the text on next use); "released": no longer retained; "unknown"."""
        with self._lock:
            if context_id in self._counts:
                return "live" if self.engine.has_base(context_id) else "evicted"
            return "released" if context_id in self._released else "unknown"

    def retained(self) -> dict[str, int]:
        """context_id -> reference count, for every retained handle."""
        with self._lock:
            return dict(self._counts)

    # -- unretained bases ------------------------------------------------------------------

    def provider(self, provide: BaseProvider) -> BaseProvider:
        """``provide`` that also notes each base it computes (so the LRU bound sees it)."""

        def noted(segment: Segment) -> KV:
            base = provide(segment)
            self._seen(segment.shared_id, base.nbytes)
            return base

        return noted

    def note(self, shared_id: str, nbytes: int) -> None:
        """Record that the engine holds (or just used) a base of ``nbytes`` for ``shared_id``."""
        self._seen(shared_id, nbytes)

    def touch(self, shared_ids: list[str]) -> None:
        """Mark bases as just used (most recently used last), then enforce the bound."""
        with self._lock:
            for shared_id in shared_ids:
                if shared_id in self._sizes:
                    self._sizes.move_to_end(shared_id)
            self._shrink()

    @property
    def unretained_bytes(self) -> int:
        with self._lock:
            return sum(n for s, n in self._sizes.items() if s not in self._counts and self.engine.has_base(s))

    def _seen(self, shared_id: str, nbytes: int) -> None:
        with self._lock:
            self._sizes[shared_id] = nbytes
            self._sizes.move_to_end(shared_id)

    def _shrink(self) -> None:
        if self.max_unretained_bytes is None:
            return
        for shared_id in [s for s in self._sizes if not self.engine.has_base(s)]:
            del self._sizes[shared_id]  # evicted elsewhere (tenant budgets): forget the size
        total = self.unretained_bytes
        for shared_id in list(self._sizes):
            if total <= self.max_unretained_bytes:
                return
            if shared_id in self._counts:
                continue
            total -= self._sizes.pop(shared_id)
            self.engine.drop_base(shared_id)
