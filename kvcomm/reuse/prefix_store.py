"""Exact KV of earlier prompts, served for the longest identical prefix (at segment boundaries)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

from kvcomm.core.kv import KV
from kvcomm.core.segments import Prompt


def _boundary_keys(prompt: Prompt) -> list[tuple[int, bytes]]:
    """(end offset, hash of all tokens before it) for each segment boundary, in order."""
    chain = hashlib.blake2b(digest_size=16)
    keys = []
    for index, segment in enumerate(prompt.segments):
        chain.update(np.asarray(segment.token_ids, dtype=np.int64).tobytes())
        keys.append((prompt.end(index), chain.copy().digest()))
    return keys


class PrefixStore:
    """LRU store of exact, position-bound KV, capped at ``max_bytes``.

    Only KV that a dense forward pass produced may enter (never estimated KV), so what it
    serves is exact up to float rounding. Entries are whole prompts; a lookup returns the
    longest prefix of the new prompt, ending at one of its segment boundaries, that some
    stored prompt shares.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, KV] = OrderedDict()
        self._keys: dict[bytes, tuple[int, int]] = {}  # boundary hash -> (entry id, end)
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._entries.values())

    def put(self, prompt: Prompt, kv: KV) -> None:
        """Store ``kv`` (rotated, ``[.., len(prompt), ..]``) of a densely prefilled prompt."""
        if kv.length != len(prompt):
            raise ValueError(f"prefix store needs the whole prompt's KV ({len(prompt)} tokens), got {kv.length}")
        if kv.nbytes > self.max_bytes:
            return
        with self._lock:
            entry = self._next_id
            self._next_id += 1
            self._entries[entry] = kv
            for end, key in _boundary_keys(prompt):
                self._keys[key] = (entry, end)
            while self.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def drop_oldest(self) -> int:
        """Drop the least recently used entry; returns the bytes freed (0 when empty)."""
        with self._lock:
            if not self._entries:
                return 0
            entry = next(iter(self._entries))
            freed = self._entries[entry].nbytes
            self._drop(entry)
            return freed

    def _drop(self, entry: int) -> None:
        del self._entries[entry]
        for key in [k for k, (e, _) in self._keys.items() if e == entry]:
            del self._keys[key]

    def longest(self, prompt: Prompt) -> tuple[int, KV | None]:
        """Length of the longest stored prefix of ``prompt`` and its KV (a view), or ``(0, None)``."""
        best = (0, None)
        with self._lock:
            for end, key in _boundary_keys(prompt):
                hit = self._keys.get(key)
                if hit is None:
                    break
                entry, stored_end = hit
                if stored_end == end:
                    self._entries.move_to_end(entry)
                    best = (end, self._entries[entry].span(0, end))
        return best
