"""The anchor pool of one slot family: admission, weighting, eviction (KVCOMM §3).

Invariants, held under the pool's lock after every public call:
- ``len(pool) <= config.max_anchors`` (never V+1, not even transiently visible);
- ``pool.nbytes <= config.max_bytes`` when a byte budget is set;
- the embedding index holds exactly the anchors in the pool;
- access counts add up: the accesses of held anchors plus those of evicted ones equal the
  accesses ever granted (``accesses_granted``).
``problems()`` checks all of them (a concurrency stress test and the server's metrics use it).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcomm.anchors.anchor import Anchor, Deviation, SlotKey
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.distance import EstimateDistances, admission_logits, estimate_distances_many, value_l2_many
from kvcomm.anchors.deviations import WeightedDeviations
from kvcomm.anchors.distance_cache import DistanceCache
from kvcomm.anchors.index import EmbeddingIndex
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV


SHRINKAGE_MIN_PAIRS = 2
"""Observed (estimate, real) pairs a slot needs before its shrinkage factors are used; until
then its estimates are served unshrunk."""

ADMISSION_TEMPERATURE = 0.0075
"""Relative distance scale of admission: an anchor this fraction farther than the nearest gets
1/e of its weight in p (``admission_logits``)."""


@dataclass(frozen=True)
class Match:
    """A decision to reuse a segment in ``slot``: estimate its first ``covered`` tokens from ``anchors``.

    Every anchor here has a deviation for ``slot`` and at least ``covered`` tokens.
    ``identical`` means the anchor is this very segment: its deviation is used as is.
    ``distances``: per anchor, its distances to the segment on the first ``covered`` tokens,
    as admission computed them (None: ``estimate`` computes them).
    """

    slot: SlotKey
    anchors: tuple[Anchor, ...]
    covered: int
    identical: bool = False
    distances: tuple[EstimateDistances, ...] | None = field(default=None, compare=False, repr=False)


_ENTROPY_TOLERANCE = 1e-9


class AnchorPool:
    def __init__(self, config: PoolConfig | None = None, heads: HeadShards = ALL_HEADS):
        """heads: the KV heads this process holds (``kvcomm.core.heads``); every KV given to
        the pool holds those, and its decisions are those of one process holding all heads."""
        self.config = config or PoolConfig()
        self.heads = heads
        self._anchors: dict[str, Anchor] = {}  # insertion order == serial order
        self._by_serial: dict[int, str] = {}
        self._index: EmbeddingIndex | None = None
        self._next_serial = 0
        self._lock = threading.RLock()
        self.evictions = 0
        self.accesses_granted = 0
        self.evicted_accesses = 0
        self.distance_cache = DistanceCache()
        self.fits: dict[tuple[SlotKey, str], ShrinkageFit] = {}
        """Per (slot, "shared" or "following"): the prequential fit of its estimates (``observe``)."""

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

    @property
    def next_serial(self) -> int:
        """The serial the next admitted anchor gets (persisted with the pool)."""
        return self._next_serial

    def get(self, segment_id: str) -> Anchor | None:
        return self._anchors.get(segment_id)

    # -- admission -------------------------------------------------------------------------

    def decide(
        self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray, commit: bool = True,
        admission: bool = True, refusals: list[str] | None = None,
    ) -> Match | None:
        """Reuse decision for a new segment (position-free ``base``, ``T`` tokens) in ``slot``.

        Returns None when the sample must be densely prefilled and become an anchor: the
        fewer than ``config.min_compatible`` anchors are compatible (have a deviation for
        ``slot``), the anchors would cover fewer than ``min_coverage * T`` tokens (the longest
        compatible anchor's length), or the entropy of the admission distribution p
        (``admission_logits``) over the compatible anchors exceeds
        gamma * log(#compatible). Otherwise the anchors carrying the top-p mass of p get an
        access (only when ``commit``: a decision asked for learning alone leaves access
        counts untouched). ``admission=False`` skips the entropy test: the match the pool
        could estimate from, whether or not it would reuse (``observe`` measures it).
        ``refusals``: when given and the answer is None, the reason is appended to it, in words
        (for provenance notes).
        """
        length = base.length
        with self._lock:
            same = self._anchors.get(segment_id)
            if same is not None and slot in same.deviations and same.length == length:
                same.accesses += int(commit)
                self.accesses_granted += int(commit)
                return Match(slot, (same,), length, identical=True)
            compatible = [a for a in self._anchors.values() if slot in a.deviations]
            if len(compatible) < self.config.min_compatible:
                return _refused(refusals, f"{len(compatible)} compatible anchors, {self.config.min_compatible} needed")
            compatible = self._narrow(compatible, embedding)
            covered = self._coverage(compatible, length)
            if covered < self.config.min_coverage * length:  # mostly uncovered: computing it densely makes it an anchor
                return _refused(refusals, f"anchors cover {covered} of {length} tokens, under min_coverage {self.config.min_coverage:g}")
            distances = self._distances(segment_id, base, compatible, covered, commit)
            p = self._admission(compatible, base, [d if isinstance(d, torch.Tensor) else d.value_l2 for d in distances])
            entropy = float(-(p * torch.log(p.clamp_min(1e-300))).sum())
            if admission and entropy > self.config.gamma * math.log(len(compatible)) + _ENTROPY_TOLERANCE:
                return _refused(refusals, f"admission entropy {entropy:.2f} over {len(compatible)} anchors above gamma {self.config.gamma:g}")
            if commit:
                self._count_access(compatible, p)
            used = [(a, d) for a, d in zip(compatible, distances) if a.length >= covered]
            known = tuple(d for _, d in used if isinstance(d, EstimateDistances))
            return Match(slot, tuple(a for a, _ in used), covered, distances=known if len(known) == len(used) else None)

    def _distances(
        self, segment_id: str, base: KV, compatible: list[Anchor], covered: int, full: bool
    ) -> list[EstimateDistances | torch.Tensor]:
        """Per compatible anchor: its cached ``EstimateDistances`` to ``base``, else (``full``
        and the anchor will estimate the ``covered`` tokens) freshly computed and cached ones,
        else just the admission's value L2 (a probe for learning, or an anchor too short to
        estimate). Compared on the first min(T, length) tokens: ``covered`` for the users."""
        ns = [min(base.length, a.length) for a in compatible]
        cache = self.distance_cache
        found: list[EstimateDistances | None] = [cache.get(segment_id, base, a.serial, n) for a, n in zip(compatible, ns)]
        todo = [i for i, a in enumerate(compatible) if found[i] is None and full and a.length >= covered]
        for i, d in zip(todo, estimate_distances_many(
            [compatible[i].base for i in todo], base, [ns[i] for i in todo], self.heads,
        )):
            found[i] = d
            cache.put(segment_id, base, compatible[i].serial, ns[i], d)
        missing = [i for i, f in enumerate(found) if f is None]
        l2 = dict(zip(missing, value_l2_many([compatible[i].base for i in missing], base, [ns[i] for i in missing], self.heads)))
        return [f if f is not None else l2[i] for i, f in enumerate(found)]

    def _admission(self, compatible: list[Anchor], base: KV, l2: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The admission distribution p over ``compatible``, fp64 ``[A]``; ``l2``: their value L2
        distances to ``base`` if already known."""
        counts = [min(base.length, a.length) for a in compatible]
        l2 = torch.stack(l2 if l2 is not None else value_l2_many([a.base for a in compatible], base, counts, self.heads))
        per_token = base.values.shape[0] * base.values.shape[1] * self.heads.size * base.values.shape[3]
        logits = admission_logits(l2, torch.tensor(counts, device=l2.device) * per_token, ADMISSION_TEMPERATURE)
        # fp64 and a rounding tolerance: in fp32 a uniform p has an entropy just above
        # log(n), so gamma = 1 (which must always reuse) would never reuse.
        return torch.softmax(logits, dim=0)

    @staticmethod
    def _coverage(compatible: list[Anchor], length: int) -> int:
        """Tokens to estimate: the head of the segment the longest compatible anchor covers."""
        return min(length, max(a.length for a in compatible))

    def _narrow(self, compatible: list[Anchor], embedding: np.ndarray) -> list[Anchor]:
        k = self.config.max_candidates
        if k == 0 or len(compatible) <= k or self._index is None:
            return compatible
        wanted = {a.serial for a in compatible}
        asked = k
        while True:  # widen the search only while too few of the nearest are compatible
            ranked = [s for s in self._index.nearest(embedding, asked) if s in wanted]
            if len(ranked) >= k or asked >= len(self._index):
                return [self._anchors[self._by_serial[s]] for s in ranked[:k]]
            asked *= 4

    def _count_access(self, anchors: list[Anchor], p: torch.Tensor) -> None:
        order = torch.argsort(p, descending=True).tolist()
        mass = 0.0
        for i in order:
            anchors[i].accesses += 1
            self.accesses_granted += 1
            mass += float(p[i])
            if mass >= self.config.top_p:
                break

    # -- estimation ------------------------------------------------------------------------

    def estimate(
        self, match: Match, base: KV, onto: KV | None = None, onto_following: KV | None = None
    ) -> tuple[KV, KV | None]:
        """Estimated deviations for a matched segment: (shared ``[.., covered, ..]``, following or None),
        summed from ``estimate_terms``. With ``onto`` / ``onto_following`` (fp32 KV of matching
        shape) the estimates are accumulated into them in place and returned, which saves the
        caller an addition pass."""
        shared, following = self.estimate_terms(match, base)
        return shared.add_into(onto), None if following is None else following.add_into(onto_following)

    def estimate_terms(
        self, match: Match, base: KV, shrink: bool = True
    ) -> tuple[WeightedDeviations, WeightedDeviations | None]:
        """The weighted deviations that estimate a matched segment (shared, following or None).

        Shared tokens are weighted per token by softmax(-d/tau) of the mean absolute base-value
        difference; the following fixed segment per (layer, head, channel) by softmax(-d/tau)
        of the per-token RMS base-value difference (L2 over the compared tokens / sqrt(their
        count)). Keys and values share the value distances (half the distance work; the
        reference's key distances tied them: docs/measurements/2026-11-history.md). All
        position-free; the caller realigns. An ``identical`` match uses its anchor's deviations
        with weight 1. Weights are over all matched anchors. With ``shrink`` and
        ``config.shrinkage``, each layer's weights are scaled by the slot's fitted factor once it
        has ``SHRINKAGE_MIN_PAIRS`` pairs (``observe``).
        """
        n = min(match.covered, base.length)  # a plan cuts a segment that ends the prompt short
        deviations = [a.deviations[match.slot] for a in match.anchors]
        first = max(d.first_layer for d in deviations)  # below it every anchor's layers are served exact
        shared_parts = tuple(_from_layer(d.shared, first - d.first_layer).span(0, n) for d in deviations)
        following_parts = None if any(d.following is None for d in deviations) else tuple(
            _from_layer(d.following, first - d.first_layer) for d in deviations)
        if match.identical:
            one = torch.ones((), dtype=torch.float32, device=base.keys.device)
            return (WeightedDeviations(shared_parts, (one,), (one,), first),
                    None if following_parts is None else WeightedDeviations(following_parts, (one,), (one,), first))
        tau = self.config.temperature
        dist = match.distances or estimate_distances_many(
            [a.base for a in match.anchors], base, [match.covered] * len(match.anchors), self.heads,
        )
        ak, av = self._factors(match.slot, "shared", shrink, first, base.keys.device)
        wk = torch.softmax(-torch.stack([d.token_keys[:n] for d in dist]) / tau, dim=0)  # [A, n]
        wv = torch.softmax(-torch.stack([d.token_values[:n] for d in dist]) / tau, dim=0)
        shared = WeightedDeviations(
            shared_parts, tuple(wk[:, None, None, :, None] * ak), tuple(wv[:, None, None, :, None] * av), first,
        )
        following = None
        if following_parts is not None and len({p.length for p in following_parts}) == 1:
            # per-token RMS (L2 / sqrt(tokens compared)): a raw L2 grows with the segment's length
            # and makes the weights one-hot on long segments
            rms = [math.sqrt(d.token_keys.shape[0]) for d in dist]
            fk = torch.softmax(-torch.stack([d.channel_keys[first:] / r for d, r in zip(dist, rms)]) / tau, dim=0)  # [A, L', H, D]
            fv = torch.softmax(-torch.stack([d.channel_values[first:] / r for d, r in zip(dist, rms)]) / tau, dim=0)
            ak, av = self._factors(match.slot, "following", shrink, first, fk.device)
            following = WeightedDeviations(
                following_parts, tuple(fk[:, :, :, None, :] * ak), tuple(fv[:, :, :, None, :] * av), first
            )
        return shared, following

    def _factors(self, slot: SlotKey, part: str, shrink: bool, first_layer: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer (key, value) factors broadcastable against per-anchor weights: fp32
        ``[layers - first_layer, 1, 1, 1]`` each (model layers ``first_layer..``), or scalar ones
        when not shrinking (yet). ``shrink``: the served estimate (fitted factors); False: the
        raw one. On ``device`` (the weights')."""
        fit = self.fits.get((slot, part)) if shrink and self.config.shrinkage else None
        factors = fit.factors(SHRINKAGE_MIN_PAIRS) if fit is not None else None
        if factors is None:
            one = torch.ones((), dtype=torch.float32, device=device)
            return one, one
        return tuple(f.to(device)[first_layer:, None, None, None] for f in factors)

    def observe(self, match: Match, base: KV, real_shared: KV, real_following: KV | None = None) -> None:
        """Fit the slot's shrinkage on one segment seen densely: compare what ``match`` would have
        estimated (unshrunk) with the real deviations the forward revealed.

        real_shared: real KV minus ``base`` on the match's first ``covered`` tokens (or more);
        real_following: the same for the following fixed segment, against the fixed base the
        anchors' following deviations were measured against (None: not observed). Identical
        matches are not observations (their deviation is the truth)."""
        if match.identical:
            return
        shared, following = self.estimate_terms(match, base, shrink=False)
        estimate = shared.add_into()
        if real_shared.length < estimate.length:
            raise ValueError(f"real deviation covers {real_shared.length} tokens, the estimate {estimate.length}")
        with self._lock:
            layers = base.keys.shape[0]
            fit = self.fits.setdefault((match.slot, "shared"), ShrinkageFit.empty(layers))
            fit.observe(estimate, real_shared.span(0, estimate.length), self.heads)
            if following is not None and real_following is not None and following.parts[0].length == real_following.length:
                self.fits.setdefault((match.slot, "following"), ShrinkageFit.empty(layers)).observe(
                    following.add_into(), real_following, self.heads)

    # -- learning and eviction -------------------------------------------------------------

    def record(self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray, deviation: Deviation) -> list[Anchor]:
        """Store the deviation ``slot`` showed for a densely prefilled segment; admit it if new.

        ``deviation`` must be real KV minus ``base``; a held anchor keeps its base, so for a
        held anchor ``base`` must be that base (the same tensors or equal values), else
        ValueError: one anchor never mixes deviations measured against different bases.

        Returns the anchors evicted to make room (least-accessed among the W earliest).
        An anchor too large for the byte budget on its own is not admitted, and a held anchor
        that this deviation would make too large on its own does not store it.
        """
        layers = deviation.first_layer + deviation.shared.keys.shape[0]
        if layers != base.keys.shape[0]:
            raise ValueError(f"segment {segment_id!r}: a deviation from layer {deviation.first_layer} with "
                             f"{deviation.shared.keys.shape[0]} layers does not fit a base of {base.keys.shape[0]} layers")
        with self._lock:
            anchor = self._anchors.get(segment_id)
            evicted: list[Anchor] = []
            if anchor is not None and not _same_kv(anchor.base, base):
                raise ValueError(
                    f"segment {segment_id!r}: the deviation was measured against another base than the one "
                    "its anchor holds; measure it as real KV minus anchor.base (one base per content)"
                )
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

    def restore(self, anchors: list[Anchor], next_serial: int, evictions: int = 0) -> None:
        """Fill this empty pool with persisted ``anchors`` (in insertion order) exactly as they
        were: serials, access counts, deviations, embedding index. State that would break the
        pool's invariants is refused with ValueError and the pool stays empty."""
        with self._lock:
            problems = []
            serials = [a.serial for a in anchors]
            if self._anchors:
                problems.append(f"the pool already holds {len(self._anchors)} anchors")
            if len(anchors) > self.config.max_anchors:
                problems.append(f"{len(anchors)} anchors exceed max_anchors (V) = {self.config.max_anchors}")
            if serials != sorted(set(serials)) or (serials and not (0 <= serials[0] and serials[-1] < next_serial)):
                problems.append(f"serials {serials} are not increasing and below next_serial {next_serial}")
            if len({a.segment_id for a in anchors}) != len(anchors):
                problems.append("two anchors share a segment id")
            held = sum(a.nbytes for a in anchors)
            if self.config.max_bytes is not None and held > self.config.max_bytes:
                problems.append(f"{held} bytes exceed max_bytes = {self.config.max_bytes}")
            if problems:
                raise ValueError("cannot restore anchor pool: " + "; ".join(problems))
            for anchor in anchors:
                self._insert(anchor)
            self._next_serial, self.evictions = next_serial, evictions
            self.accesses_granted, self.evicted_accesses = sum(a.accesses for a in anchors), 0

    def evict(self) -> Anchor | None:
        """Evict one anchor by the eviction rule (least-accessed among the W earliest); None
        if the pool is empty. For budgets shared with other pools (``kvcomm.services.tenants``)."""
        with self._lock:
            return self._evict_one() if self._anchors else None

    def _evict_one(self, protect: Anchor | None = None) -> Anchor:
        window = [a for a in self._anchors.values() if a is not protect][: self.config.eviction_window]
        victim = min(window, key=lambda a: (a.accesses, a.serial))
        del self._anchors[victim.segment_id]
        del self._by_serial[victim.serial]
        self._index.remove(victim.serial)
        self.distance_cache.forget_anchor(victim.serial)
        self.evictions += 1
        self.evicted_accesses += victim.accesses
        return victim

    def problems(self) -> list[str]:
        """Violated invariants (see the module docstring), as readable sentences; empty when consistent."""
        with self._lock:
            found = []
            if len(self._anchors) > self.config.max_anchors:
                found.append(f"{len(self._anchors)} anchors exceed V = {self.config.max_anchors}")
            held = sum(a.nbytes for a in self._anchors.values())
            if self.config.max_bytes is not None and held > self.config.max_bytes:
                found.append(f"{held} bytes exceed max_bytes = {self.config.max_bytes}")
            indexed = len(self._index) if self._index is not None else 0
            serials = sorted(a.serial for a in self._anchors.values())
            if indexed != len(self._anchors) or sorted(self._by_serial) != serials:
                found.append(f"index holds {indexed} entries and {len(self._by_serial)} serials for {len(self._anchors)} anchors")
            accesses = sum(a.accesses for a in self._anchors.values())
            if accesses + self.evicted_accesses != self.accesses_granted:
                found.append(f"access counts do not add up: held {accesses} + evicted {self.evicted_accesses} "
                             f"!= granted {self.accesses_granted}")
            return found


def _refused(refusals: list[str] | None, reason: str) -> None:
    if refusals is not None:
        refusals.append(reason)
    return None


def _same_kv(a: KV, b: KV) -> bool:
    """Whether ``a`` and ``b`` are the same KV: the very tensors, or equal shapes, dtypes and values."""
    if a.keys is b.keys and a.values is b.values:
        return True
    return (a.keys.shape == b.keys.shape and a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
            and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))


def _from_layer(kv: KV, layer: int) -> KV:
    """``kv``'s layers from ``layer`` on (a view)."""
    return kv if layer == 0 else KV(kv.keys[layer:], kv.values[layer:])
