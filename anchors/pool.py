"""The anchor pool of one slot family: admission, weighting, eviction (KVCOMM §3).

Invariants, held under the pool's lock after every public call:
- ``len(pool) <= config.max_anchors`` (never V+1, not even transiently visible);
- ``pool.nbytes <= config.max_bytes`` when a byte budget is set;
- the embedding index holds exactly the anchors in the pool.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvcomm.anchors.anchor import Anchor, Deviation, SlotKey
from kvcomm.anchors.distance import estimate_distances, value_l2
from kvcomm.anchors.index import EmbeddingIndex
from kvcomm.kv import KV


@dataclass(frozen=True)
class PoolConfig:
    """gamma: entropy threshold factor; a sample reuses only if H(p) <= gamma * log(#compatible).
    max_anchors: V, the most anchors a pool holds. eviction_window: W, how many of the
    earliest-inserted anchors eviction chooses among. top_p: mass whose anchors get an access.
    temperature: tau in the delta weights softmax(-d / tau). max_candidates: narrow the
    compatible anchors to this many nearest by embedding (0 keeps all). partial_coverage:
    a segment longer than every anchor reuses the covered head instead of going dense.
    max_bytes: byte budget for the pool's tensors (None: unbounded).
    """

    gamma: float = 0.3
    max_anchors: int = 20
    eviction_window: int = 5
    top_p: float = 0.9
    temperature: float = 1.0
    max_candidates: int = 8
    partial_coverage: bool = True
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.gamma >= 0:
            problems.append(f"gamma must be >= 0 (got {self.gamma})")
        if self.max_anchors < 1:
            problems.append(f"max_anchors (V) must be >= 1 (got {self.max_anchors})")
        if self.eviction_window < 1:
            problems.append(f"eviction_window (W) must be >= 1 (got {self.eviction_window})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0 (got {self.temperature})")
        if self.max_candidates == 1 or self.max_candidates < 0:
            problems.append(f"max_candidates must be 0 (all) or >= 2 (got {self.max_candidates})")
        if self.max_bytes is not None and self.max_bytes <= 0:
            problems.append(f"max_bytes must be positive or None (got {self.max_bytes})")
        if problems:
            raise ValueError("invalid anchor pool config: " + "; ".join(problems))


@dataclass(frozen=True)
class Match:
    """A decision to reuse a segment in ``slot``: estimate its first ``covered`` tokens from ``anchors``.

    Every anchor here has a deviation for ``slot`` and at least ``covered`` tokens.
    ``identical`` means the anchor is this very segment: its deviation is used as is.
    """

    slot: SlotKey
    anchors: tuple[Anchor, ...]
    covered: int
    identical: bool = False


_ENTROPY_TOLERANCE = 1e-9


class AnchorPool:
    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        self._anchors: dict[str, Anchor] = {}  # insertion order == serial order
        self._by_serial: dict[int, str] = {}
        self._index: EmbeddingIndex | None = None
        self._next_serial = 0
        self._lock = threading.RLock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._anchors)

    @property
    def anchors(self) -> tuple[Anchor, ...]:
        with self._lock:
            return tuple(self._anchors.values())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._anchors.values())

    def get(self, segment_id: str) -> Anchor | None:
        return self._anchors.get(segment_id)

    # -- admission -------------------------------------------------------------------------

    def decide(
        self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray, commit: bool = True
    ) -> Match | None:
        """Reuse decision for a new segment (position-free ``base``, ``T`` tokens) in ``slot``.

        Returns None when the sample must be densely prefilled and become an anchor: the
        pool holds <= 1 anchor, <= 1 anchor is compatible (has a deviation for ``slot`` and,
        without partial coverage, >= T tokens), or the entropy of softmax(-d) over the
        compatible anchors exceeds gamma * log(#compatible), d being the L2 distance of base
        values. Otherwise the anchors carrying the top-p mass get an access (only when
        ``commit``: a decision asked for learning alone leaves access counts untouched).
        """
        length = base.length
        with self._lock:
            same = self._anchors.get(segment_id)
            if same is not None and slot in same.deviations and same.length == length:
                same.accesses += int(commit)
                return Match(slot, (same,), length, identical=True)
            compatible = [
                a for a in self._anchors.values()
                if slot in a.deviations and (self.config.partial_coverage or a.length >= length)
            ]
            if len(self._anchors) <= 1 or len(compatible) <= 1:
                return None
            compatible = self._narrow(compatible, embedding)
            distances = torch.stack([value_l2(a.base, base, min(length, a.length)) for a in compatible])
            # fp64 and a rounding tolerance: in fp32 a uniform p has an entropy just above
            # log(n), so gamma = 1 (which must always reuse) would never reuse.
            p = torch.softmax(-distances.double(), dim=0)
            entropy = float(-(p * torch.log(p.clamp_min(1e-300))).sum())
            if entropy > self.config.gamma * math.log(len(compatible)) + _ENTROPY_TOLERANCE:
                return None
            if commit:
                self._count_access(compatible, p)
            covered = min(length, max(a.length for a in compatible))
            users = tuple(a for a in compatible if a.length >= covered)
            return Match(slot, users, covered)

    def _narrow(self, compatible: list[Anchor], embedding: np.ndarray) -> list[Anchor]:
        k = self.config.max_candidates
        if k == 0 or len(compatible) <= k or self._index is None:
            return compatible
        wanted = {a.serial for a in compatible}
        ranked = [s for s in self._index.nearest(embedding, len(self._index)) if s in wanted]
        return [self._anchors[self._by_serial[s]] for s in ranked[:k]]

    def _count_access(self, anchors: list[Anchor], p: torch.Tensor) -> None:
        order = torch.argsort(p, descending=True).tolist()
        mass = 0.0
        for i in order:
            anchors[i].accesses += 1
            mass += float(p[i])
            if mass >= self.config.top_p:
                break

    # -- estimation ------------------------------------------------------------------------

    def estimate(
        self, match: Match, base: KV, onto: KV | None = None, onto_following: KV | None = None
    ) -> tuple[KV, KV | None]:
        """Estimated deviations for a matched segment: (shared ``[.., covered, ..]``, following or None).

        Shared tokens are weighted per token by softmax(-d/tau) of the mean absolute base
        difference; the following fixed segment per (layer, head, channel) by softmax(-d/tau)
        of the L2 base difference over the same ``covered`` tokens. Keys and values each use
        their own distances. All position-free; the caller realigns. With ``onto`` /
        ``onto_following`` (fp32 KV of matching shape) the estimates are accumulated into
        them in place and returned, which saves the caller an addition pass.
        """
        n = match.covered
        deviations = [a.deviations[match.slot] for a in match.anchors]
        if match.identical:
            shared, following = deviations[0].shared.span(0, n), deviations[0].following
            shared = shared if onto is None else _accumulate(onto, [shared], [1.0], [1.0])
            if following is not None and onto_following is not None:
                following = _accumulate(onto_following, [following.span(0, onto_following.length)], [1.0], [1.0])
            return shared, following
        tau = self.config.temperature
        dist = [estimate_distances(a.base, base, n) for a in match.anchors]
        wk = torch.softmax(-torch.stack([d.token_keys for d in dist]) / tau, dim=0)  # [A, n]
        wv = torch.softmax(-torch.stack([d.token_values for d in dist]) / tau, dim=0)
        shared = _accumulate(
            onto, [d.shared.span(0, n) for d in deviations], wk[:, None, None, :, None], wv[:, None, None, :, None]
        )
        following = None
        if all(d.following is not None for d in deviations) and len({d.following.length for d in deviations}) == 1:
            fk = torch.softmax(-torch.stack([d.channel_keys for d in dist]) / tau, dim=0)  # [A, L, H, D]
            fv = torch.softmax(-torch.stack([d.channel_values for d in dist]) / tau, dim=0)
            following = _accumulate(
                onto_following, [_cut(d.following, onto_following) for d in deviations], fk[:, :, :, None, :], fv[:, :, :, None, :]
            )
        return shared, following

    # -- learning and eviction -------------------------------------------------------------

    def record(self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray, deviation: Deviation) -> list[Anchor]:
        """Store the deviation ``slot`` showed for a densely prefilled segment; admit it if new.

        Returns the anchors evicted to make room (least-accessed among the W earliest).
        An anchor too large for the byte budget on its own is not admitted, and a held anchor
        that this deviation would make too large on its own does not store it.
        """
        with self._lock:
            anchor = self._anchors.get(segment_id)
            evicted: list[Anchor] = []
            if anchor is not None and self.config.max_bytes is not None:
                replaced = anchor.deviations.get(slot)
                grown = anchor.nbytes - (replaced.nbytes if replaced is not None else 0) + deviation.nbytes
                if grown > self.config.max_bytes:
                    return evicted  # alone over budget with this deviation: keep the anchor as it was
            if anchor is None:
                anchor = Anchor(segment_id, base, np.asarray(embedding, dtype=np.float32), self._next_serial)
                if self.config.max_bytes is not None and anchor.nbytes + deviation.nbytes > self.config.max_bytes:
                    return evicted
                while len(self._anchors) >= self.config.max_anchors:
                    evicted.append(self._evict_one())
                self._insert(anchor)
            anchor.deviations[slot] = deviation
            if self.config.max_bytes is not None:
                while self.nbytes > self.config.max_bytes and len(self._anchors) > 1:
                    evicted.append(self._evict_one(protect=anchor))
            return evicted

    def _insert(self, anchor: Anchor) -> None:
        self._next_serial += 1
        self._anchors[anchor.segment_id] = anchor
        self._by_serial[anchor.serial] = anchor.segment_id
        if self._index is None:
            self._index = EmbeddingIndex(anchor.embedding.shape[0])
        self._index.add(anchor.serial, anchor.embedding)

    def _evict_one(self, protect: Anchor | None = None) -> Anchor:
        window = [a for a in self._anchors.values() if a is not protect][: self.config.eviction_window]
        victim = min(window, key=lambda a: (a.accesses, a.serial))
        del self._anchors[victim.segment_id]
        del self._by_serial[victim.serial]
        self._index.remove(victim.serial)
        self.evictions += 1
        return victim


def _accumulate(onto: KV | None, parts: list[KV], key_weights, value_weights) -> KV:
    """``onto + sum_a w_a * part_a`` for keys and values, in place in ``onto`` (fp32 zeros if
    None), without stacking the parts. Weights broadcast against the parts (or are floats)."""
    if onto is None:
        onto = KV(torch.zeros_like(parts[0].keys, dtype=torch.float32), torch.zeros_like(parts[0].values, dtype=torch.float32))
    for i, part in enumerate(parts):
        onto.keys.addcmul_(part.keys.float(), torch.as_tensor(key_weights[i], dtype=torch.float32))
        onto.values.addcmul_(part.values.float(), torch.as_tensor(value_weights[i], dtype=torch.float32))
    return onto


def _cut(part: KV, like: KV | None) -> KV:
    """``part`` cut to ``like``'s token count (a following segment may be cut short so the
    last prompt token is computed), or whole if ``like`` is None."""
    return part if like is None else part.span(0, like.length)
