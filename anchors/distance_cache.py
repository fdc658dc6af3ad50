"""Distances between recently matched segments and anchors, kept for the next decision on the same content.

A segment's distances to an anchor depend only on the two base KVs and the token count,
not on the slot or the position, so every agent that sees the same shared content (the user
task, an earlier agent's reply) after the first can reuse them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from kvcomm.anchors.distance import EstimateDistances
from kvcomm.core.kv import KV


class DistanceCache:
    """LRU over the last ``segments`` segment ids; per segment, ``(anchor serial, n) -> distances``.

    An entry is valid only for the very base-value tensor it was computed from (held weakly):
    a segment id registered again with other KV misses rather than serving stale distances,
    and the cache never keeps a base alive. Anchor serials are never reused within a pool;
    the pool calls ``forget_anchor`` on eviction so dead entries do not linger. Not
    thread-safe on its own: the pool calls it under its lock.
    """

    def __init__(self, segments: int = 8):
        if segments < 1:
            raise ValueError(f"a distance cache needs room for >= 1 segment (got {segments})")
        self.segments = segments
        self._entries: OrderedDict[str, tuple[weakref.ref, dict[tuple[int, int], EstimateDistances]]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """Number of cached (segment, anchor, n) distances."""
        return sum(len(per_anchor) for _, per_anchor in self._entries.values())

    def get(self, segment_id: str, base: KV, serial: int, n: int) -> EstimateDistances | None:
        entry = self._entries.get(segment_id)
        found = None
        if entry is not None and entry[0]() is base.values:
            self._entries.move_to_end(segment_id)
            found = entry[1].get((serial, n))
        self.hits += found is not None
        self.misses += found is None
        return found

    def put(self, segment_id: str, base: KV, serial: int, n: int, distances: EstimateDistances) -> None:
        entry = self._entries.get(segment_id)
        if entry is None or entry[0]() is not base.values:
            entry = (weakref.ref(base.values), {})
            self._entries[segment_id] = entry
        self._entries.move_to_end(segment_id)
        entry[1][(serial, n)] = distances
        while len(self._entries) > self.segments:
            self._entries.popitem(last=False)

    def forget_anchor(self, serial: int) -> None:
        for _, per_anchor in self._entries.values():
            for key in [k for k in per_anchor if k[0] == serial]:
                del per_anchor[key]

    def clear(self) -> None:
        self._entries.clear()
