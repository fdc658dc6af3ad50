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
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvcomm.anchors.anchor import Anchor, Deviation, SlotKey
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.distance import (
    ADMISSION_TEMPERATURE, DeviceDistances, EstimateDistances, admission_logits, estimate_distances_many, value_l2_many,
)
from kvcomm.anchors.distance_cache import DistanceCache
from kvcomm.anchors.evidence import Evidence
from kvcomm.anchors.index import EmbeddingIndex
from kvcomm.anchors.matching import Candidates, decide_all
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.estimate import Estimate
from kvcomm.core.kv import KV


SHRINKAGE_MIN_PAIRS = 2
"""Observed (estimate, real) pairs a slot needs before its shrinkage factors are used; until
then its estimates are served unshrunk."""

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




class AnchorPool:
    def __init__(self, config: PoolConfig | None = None, head_shards: HeadShards = ALL_HEADS):
        """head_shards: the KV heads this process holds (``kvcomm.core.heads``); every KV given to
        the pool holds those, and its decisions are those of one process holding all heads."""
        self.config = config or PoolConfig()
        self.head_shards = head_shards
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
        self._alphas: dict[tuple, tuple[int, torch.Tensor]] = {}
        """``_alpha``'s device copies of the fitted factors, with the pair count they were made at."""
        self.evidence: dict[tuple[SlotKey, str], Evidence] = {}
        """Per (slot, "shared" or "following"): whether its estimate beats realignment (``observe``;
        ``kvcomm.anchors.evidence``). Saved and restored with the pool (``kvcomm.services.persist``)."""

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

    def set_gamma(self, gamma: float) -> None:
        """Admit under ``gamma`` from the next decision on (``PoolConfig.gamma``; the quality
        guard tightens and loosens it). Raises ValueError, changing nothing, for a gamma
        ``PoolConfig`` refuses."""
        config = replace(self.config, gamma=gamma)
        with self._lock:
            self.config = config

    # -- admission -------------------------------------------------------------------------

    def decide(
        self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray, commit: bool = True,
        admission: bool = True, refusals: list[str] | None = None,
    ) -> Match | None:
        """Reuse decision for a new segment (position-free ``base``, ``T`` tokens) in ``slot``:
        ``kvcomm.anchors.matching.decide_all`` for this one segment (a plan decides all its
        segments at once that way).

        Returns None when the sample must be densely prefilled and become an anchor: fewer
        than ``config.min_compatible`` anchors are compatible (have a deviation for ``slot``),
        the anchors would cover fewer than ``min_coverage * T`` tokens (the longest compatible
        anchor's length), or the entropy of the admission distribution p (``admission_logits``)
        over the compatible anchors exceeds gamma * log(#compatible). Otherwise, with
        ``commit``, the anchors carrying the top-p mass of p get an access (a decision asked for
        learning alone leaves access counts untouched). ``admission=False`` skips the entropy
        test: the match the pool could estimate from, whether or not it would reuse
        (``observe`` measures it). ``refusals``: when given and the answer is None, the reason
        is appended to it, in words (for provenance notes).
        """
        (decision,) = decide_all([self.candidates(slot, segment_id, base, embedding)])
        if commit:
            decision.commit()
        match = decision.match if admission else decision.estimable
        if match is None and refusals is not None:
            refusals.append(decision.refusal)
        return match

    def candidates(self, slot: SlotKey, segment_id: str, base: KV, embedding: np.ndarray):
        """What this pool can match the segment against (``matching.Candidates``), decided on
        the host: the identical anchor, or the compatible anchors narrowed by embedding and
        the tokens they cover, or why it refuses before any distance."""
        length = base.length
        found = Candidates(self, slot, segment_id, base, embedding)
        with self._lock:
            same = self._anchors.get(segment_id)
            if same is not None and slot in same.deviations and same.length == length:
                found.anchors, found.covered, found.identical = (same,), length, same
                return found
            compatible = [a for a in self._anchors.values() if slot in a.deviations]
            if len(compatible) < self.config.min_compatible:
                found.refusal = f"{len(compatible)} compatible anchors, {self.config.min_compatible} needed"
                found.cold = True
                return found
            compatible = self._narrow(compatible, embedding)
            covered = self._coverage(compatible, length)
            found.anchors, found.covered = tuple(compatible), covered
            if covered < self.config.min_coverage * length:  # mostly uncovered: computing it densely makes it an anchor
                found.refusal = f"anchors cover {covered} of {length} tokens, under min_coverage {self.config.min_coverage:g}"
            return found

    def distances(self, candidates) -> list[EstimateDistances | torch.Tensor]:
        """The torch path's distances of ``candidates``: full ones (cached) for the anchors an
        estimate would use, the value L2 alone for the others."""
        with self._lock:
            return self._distances(candidates.segment_id, candidates.base, list(candidates.anchors), candidates.covered, True)

    def admission(self, candidates, l2: list[torch.Tensor]) -> torch.Tensor:
        """The admission distribution p over ``candidates.anchors``, fp64 ``[A]``, from their value L2 distances."""
        return self._admission(list(candidates.anchors), candidates.base, l2)

    def match_from(self, candidates, distances) -> Match:
        """The match of admitted ``candidates``: their anchors at least ``covered`` long, with
        ``distances`` (their ``EstimateDistances``, or the fused path's ``DeviceDistances``)."""
        used = candidates.used
        if not isinstance(distances, tuple):  # the fused path's distances of every candidate
            return Match(candidates.slot, used, candidates.covered, distances=distances)
        known = tuple(d for d in distances if isinstance(d, EstimateDistances))
        return Match(candidates.slot, used, candidates.covered, distances=known if len(known) == len(used) else None)

    @staticmethod
    def identical_match(candidates) -> Match:
        return Match(candidates.slot, candidates.anchors, candidates.covered, identical=True)

    def count_access(self, candidates, p: list[float]) -> None:
        """A reuse decision taken: the identical anchor, or the anchors carrying the top-p mass
        of admission's ``p`` (host floats over ``candidates.anchors``), get an access."""
        with self._lock:
            if candidates.identical is not None:
                candidates.identical.accesses += 1
                self.accesses_granted += 1
            else:
                self._count_access(list(candidates.anchors), list(p))

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
            [compatible[i].base for i in todo], base, [ns[i] for i in todo], self.head_shards,
        )):
            found[i] = d
            cache.put(segment_id, base, compatible[i].serial, ns[i], d)
        missing = [i for i, f in enumerate(found) if f is None]
        l2 = dict(zip(missing, value_l2_many([compatible[i].base for i in missing], base, [ns[i] for i in missing], self.head_shards)))
        return [f if f is not None else l2[i] for i, f in enumerate(found)]

    def _admission(self, compatible: list[Anchor], base: KV, l2: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The admission distribution p over ``compatible``, fp64 ``[A]``; ``l2``: their value L2
        distances to ``base`` if already known."""
        counts = [min(base.length, a.length) for a in compatible]
        l2 = torch.stack(l2 if l2 is not None else value_l2_many([a.base for a in compatible], base, counts, self.head_shards))
        per_token = base.values.shape[0] * base.values.shape[1] * self.head_shards.size * base.values.shape[3]
        logits = admission_logits(l2, torch.tensor(counts, device=l2.device) * per_token, ADMISSION_TEMPERATURE)
        # fp64 and a rounding tolerance: in fp32 a uniform p has an entropy just above
        # log(n), so gamma = 1 (which must always reuse) would never reuse.
        return torch.softmax(logits, dim=0)

    @staticmethod
    def _coverage(compatible: list[Anchor], length: int) -> int:
        """Tokens to estimate: the segment's first tokens, as many as the longest compatible
        anchor holds (its coverage)."""
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

    def _count_access(self, anchors: list[Anchor], p: list[float]) -> None:
        """Anchors in decreasing p (ties: pool order) get an access until they carry top_p of the mass."""
        mass = 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            anchors[i].accesses += 1
            self.accesses_granted += 1
            mass += p[i]
            if mass >= self.config.top_p:
                break

    # -- estimation ------------------------------------------------------------------------

    def estimate(self, match: Match, base: KV) -> tuple[KV, KV | None]:
        """Estimated deviations for a matched segment, summed: (shared ``[.., n, ..]``, following
        or None), fp32 (what ``estimate_terms`` serves, as plain KV)."""
        shared, following = self.estimate_terms(match, base)
        return shared.add_into(), None if following is None else following.add_into()

    def estimate_terms(self, match: Match, base: KV, shrink: bool = True) -> tuple[Estimate, Estimate | None]:
        """What estimates a matched segment (shared, following or None), as ``Estimate`` terms
        the fused writer adds to the realigned base.

        Shared tokens are weighted per token by softmax(-d/tau) of the mean absolute base-value
        difference; the following fixed segment per (layer, head, channel) by softmax(-d/tau)
        of the per-token RMS base-value difference (L2 over the compared tokens / sqrt(their
        count)). Keys and values share the value distances (half the distance work; the
        reference's key distances tied them: docs/measurements/2026-11-history.md). All
        position-free; the writer realigns. An ``identical`` match uses its anchor's deviations
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
        device = base.keys.device
        layers = base.keys.shape[0] - first
        if match.identical:
            ones = self._alpha(None, "", False, first, layers, device)
            shared = Estimate(shared_parts, _zeros(device, n)[None], (1.0,), 1.0, ones, first, per_token=True)
            following = None if following_parts is None else Estimate(
                following_parts, _zeros(device, following_parts[0].length)[None], (1.0,), 1.0, ones, first, per_token=True)
            return shared, following
        tau = self.config.temperature
        dist = match.distances or estimate_distances_many(
            [a.base for a in match.anchors], base, [match.covered] * len(match.anchors), self.head_shards,
        )
        same_length = following_parts is not None and len({p.length for p in following_parts}) == 1
        alpha_shared = self._alpha(match.slot, "shared", shrink, first, layers, device)
        alpha_following = self._alpha(match.slot, "following", shrink, first, layers, device) if same_length else None
        if isinstance(dist, DeviceDistances):  # the fused path's raw sums, a row per candidate
            shared = Estimate(shared_parts, dist.token, (1.0,) * len(dist.rows), tau, alpha_shared, first, per_token=True,
                              scale=dist.scale, rows=dist.rows)
            following = None if not same_length else Estimate(
                following_parts, dist.channel[:, first:], tuple(math.sqrt(dist.counts[r]) for r in dist.rows), tau,
                alpha_following, first, per_token=False, sqrt=True, rows=dist.rows)
            return shared, following
        shared = Estimate(shared_parts, torch.stack([d.token_values[:n] for d in dist]), (1.0,) * len(dist), tau,
                          alpha_shared, first, per_token=True)
        following = None
        if same_length:
            # per-token RMS (L2 / sqrt(tokens compared)): a raw L2 grows with the segment's length
            # and makes the weights one-hot on long segments
            following = Estimate(following_parts, torch.stack([d.channel_values[first:] for d in dist]),
                                 tuple(math.sqrt(d.token_keys.shape[0]) for d in dist), tau, alpha_following, first,
                                 per_token=False)
        return shared, following

    def _alpha(self, slot: SlotKey | None, part: str, shrink: bool, first_layer: int, layers: int,
               device: torch.device) -> torch.Tensor:
        """The per-layer (key, value) weight factors of model layers ``first_layer..``, fp32
        ``[2, layers]`` on ``device``: the slot's fitted shrinkage when ``shrink`` and
        ``config.shrinkage`` (once it has ``SHRINKAGE_MIN_PAIRS`` pairs), else ones. Kept on the
        device between calls (a fit changes only when the pool learns), so a plan uploads none."""
        fit = self.fits.get((slot, part)) if shrink and self.config.shrinkage and slot is not None else None
        if fit is None or fit.pairs < SHRINKAGE_MIN_PAIRS:
            return _ones(device, layers)
        key = (slot, part, first_layer, str(device))
        held = self._alphas.get(key)
        if held is None or held[0] != fit.pairs:
            factors = fit.factors(SHRINKAGE_MIN_PAIRS)
            value = torch.stack([factors[0][first_layer:], factors[1][first_layer:]]).to(device, torch.float32)
            held = self._alphas[key] = (fit.pairs, value)
        return held[1]

    def earned(self, slot: SlotKey, part: str = "shared") -> bool:
        """Whether ``slot``'s estimate of ``part`` ("shared" or "following") has been measured
        closer to dense than realignment (``Evidence.earned``): only then is it served."""
        with self._lock:
            evidence = self.evidence.get((slot, part))
            return evidence is not None and evidence.earned

    def evidence_words(self, slot: SlotKey, part: str = "shared") -> str:
        """``Evidence.words`` of ``slot``'s ``part``, for provenance notes."""
        with self._lock:
            return self.evidence.get((slot, part), Evidence()).words()

    def observe(self, match: Match, base: KV, real_shared: KV, real_following: KV | None = None) -> None:
        """Fit the slot's shrinkage on one segment seen densely: compare what ``match`` would have
        estimated (unshrunk) with the real deviations the forward revealed. The slot's evidence
        (``evidence``) gets the same pair, with the factors the served estimate carried before it.

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
            self._observe_part(match.slot, "shared", layers, estimate, real_shared.span(0, estimate.length))
            if following is not None and real_following is not None and following.parts[0].length == real_following.length:
                self._observe_part(match.slot, "following", layers, following.add_into(), real_following)
            for part in ("shared", "following"):  # the device copies of the factors, made here rather than on the reuse path
                self._alpha(match.slot, part, True, shared.first_layer, layers - shared.first_layer, base.keys.device)

    def _observe_part(self, slot: SlotKey, part: str, layers: int, estimate: KV, real: KV) -> None:
        """One (unshrunk estimate, real deviation) pair of ``slot``'s ``part``: its evidence, with
        the factors served until now, then its shrinkage fit."""
        fit = self.fits.setdefault((slot, part), ShrinkageFit.empty(layers))
        served = fit.factors(SHRINKAGE_MIN_PAIRS) if self.config.shrinkage else None
        alpha = torch.ones(2, layers, dtype=torch.float64) if served is None else torch.stack(served)
        cross, estimate_sq, real_sq = fit.observe(estimate, real, self.head_shards)
        self.evidence.setdefault((slot, part), Evidence()).add(alpha, cross, estimate_sq, real_sq)

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


def _same_kv(a: KV, b: KV) -> bool:
    """Whether ``a`` and ``b`` are the same KV: the very tensors, or equal shapes, dtypes and values."""
    if a.keys is b.keys and a.values is b.values:
        return True
    return (a.keys.shape == b.keys.shape and a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
            and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values))


def _from_layer(kv: KV, layer: int) -> KV:
    """``kv``'s layers from ``layer`` on (a view)."""
    return kv if layer == 0 else KV(kv.keys[layer:], kv.values[layer:])


_ZEROS: dict[str, torch.Tensor] = {}
_ONES: dict[tuple[str, int], torch.Tensor] = {}


def _ones(device: torch.device, layers: int) -> torch.Tensor:
    """fp32 ones ``[2, layers]`` on ``device``, kept (the factors of an unshrunk estimate)."""
    key = (str(device), layers)
    held = _ONES.get(key)
    if held is None:
        held = _ONES[key] = torch.ones(2, layers, dtype=torch.float32, device=device)
    return held


def _zeros(device: torch.device, n: int) -> torch.Tensor:
    """fp32 zeros ``[n]`` on ``device``, a view of one kept buffer (the distances of an identical
    match: its one weight is 1 whatever they are)."""
    held = _ZEROS.get(str(device))
    if held is None or held.numel() < n:
        held = _ZEROS[str(device)] = torch.zeros(max(n, 4096), dtype=torch.float32, device=device)
    return held[:n]
