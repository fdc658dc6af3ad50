"""What an ``AnchorPool`` is configured with: ``PoolConfig`` (admission, estimation, eviction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcomm.anchors.distance import ADMISSION_DISTANCES

ESTIMATORS = ("anchors", "linear")
"""``PoolConfig.estimator`` choices."""


@dataclass(frozen=True)
class PoolConfig:
    """Settings of one anchor pool (admission, estimation, eviction); measurements behind the
    defaults are in docs/measurements/."""

    gamma: float = 1.0
    """Admission threshold: reuse only if the entropy of p over the compatible anchors is
    <= gamma * log(#compatible); 0 reuses only a one-hot p, 1 always reuses."""
    admission_distance: str = "relative"
    """How p is made from base-value distances (``admission_logits``): "relative" (per-element
    RMS, length-normalized and scale-free) or "l2" (the reference's raw L2)."""
    admission_temperature: float = 0.0075
    """Relative distance scale of "relative": an anchor this fraction farther than the nearest
    gets 1/e of its weight."""
    max_anchors: int = 20
    """V, the most anchors a pool holds."""
    eviction_window: int = 5
    """W: eviction takes the least-accessed among the W earliest-inserted anchors."""
    top_p: float = 0.9
    """Mass of p whose anchors get an access on a reuse decision."""
    temperature: float = 1.0
    """tau in the deviation weights softmax(-d / tau)."""
    max_candidates: int = 8
    """Narrow the compatible anchors to this many nearest by embedding (0 keeps all)."""
    partial_coverage: bool = True
    """A segment longer than every anchor may reuse the covered head (see ``min_coverage``)."""
    max_bytes: int | None = None
    """Byte budget for the pool's tensors (None: unbounded)."""
    min_estimate_anchors: int = 1
    """With partial coverage, estimate only the head at least this many compatible anchors
    cover (0: all of them)."""
    key_distances: bool = False
    """Weight key deviations by base-key distances (True, the reference) or by base-value
    distances as value deviations are (False: half the distance work)."""
    min_compatible: int = 2
    """Compatible anchors (a deviation for the slot) a segment needs before it is estimated;
    with fewer it goes dense and becomes one. 2 is the reference's rule; 1 estimates a slot
    from its first anchor alone."""
    min_coverage: float = 0.5
    """A segment whose anchors would cover fewer than this share of its tokens goes dense and
    becomes an anchor instead of reusing its head."""
    shrinkage: bool = True
    """Scale each layer's estimated deviation by the slot's fitted factor in [0, 1]
    (``kvcomm.anchors.shrinkage``), fitted on the estimates the pool would have made for the
    segments it then saw densely; False serves the weighted deviations as they are."""
    shrinkage_min_pairs: int = 2
    """Observed (estimate, real) pairs a slot needs before its factors are used; until then
    its estimates are served unshrunk."""
    context_temperature: float = 0.0
    """Weight anchors also by the text before the slot: each anchor's deviation weights get the
    factor exp(cos(request context, anchor context) / context_temperature), the contexts being
    the embeddings of the shared content that preceded the slot (``Deviation.context``); 0
    (default) weights by the segment's own base distances alone, as the reference does."""
    estimator: str = "anchors"
    """How a matched segment's shared tokens are estimated: "anchors" (the reference: the
    matched anchors' deviations, weighted token by token) or "linear" (a ridge regression per
    layer and KV head from a token's base key and value to its deviation, fitted on every
    token of the matched anchors: ``kvcomm.anchors.linear``). The fixed segment after the slot
    is estimated by the anchors in both."""
    linear_ridge: float = 1e-4
    """Ridge of the "linear" estimator, relative to the mean diagonal of each normal matrix."""
    estimate_scale: float = 1.0
    """Factor on every served estimated deviation (after shrinkage; identical matches keep their
    own deviation): 1 serves the estimate, 0 serves the pool's reuse decisions with plain RoPE
    realignment, so comparing the two measures what the estimate adds at equal decisions."""

    def __post_init__(self) -> None:
        problems = []
        if not self.gamma >= 0:
            problems.append(f"gamma must be >= 0 (got {self.gamma})")
        if self.admission_distance not in ADMISSION_DISTANCES:
            problems.append(
                f"admission_distance must be one of {', '.join(ADMISSION_DISTANCES)} (got {self.admission_distance!r})"
            )
        if not self.admission_temperature > 0:
            problems.append(f"admission_temperature must be > 0 (got {self.admission_temperature})")
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
        if isinstance(self.min_estimate_anchors, bool) or not isinstance(self.min_estimate_anchors, int) \
                or self.min_estimate_anchors < 0:
            problems.append(f"min_estimate_anchors must be an integer >= 0 (got {self.min_estimate_anchors!r})")
        if isinstance(self.shrinkage_min_pairs, bool) or not isinstance(self.shrinkage_min_pairs, int) \
                or self.shrinkage_min_pairs < 1:
            problems.append(f"shrinkage_min_pairs must be an integer >= 1 (got {self.shrinkage_min_pairs!r})")
        if isinstance(self.min_compatible, bool) or not isinstance(self.min_compatible, int) \
                or self.min_compatible < 1:
            problems.append(f"min_compatible must be an integer >= 1 (got {self.min_compatible!r})")
        if self.estimator not in ESTIMATORS:
            problems.append(f"estimator must be one of {', '.join(ESTIMATORS)} (got {self.estimator!r})")
        if not (math.isfinite(self.linear_ridge) and self.linear_ridge > 0):
            problems.append(f"linear_ridge must be a finite number > 0 (got {self.linear_ridge})")
        if not (math.isfinite(self.estimate_scale) and self.estimate_scale >= 0):
            problems.append(f"estimate_scale must be a finite number >= 0 (got {self.estimate_scale})")
        if not (math.isfinite(self.context_temperature) and self.context_temperature >= 0):
            problems.append(f"context_temperature must be a finite number >= 0 (got {self.context_temperature})")
        if not 0 <= self.min_coverage <= 1:
            problems.append(f"min_coverage must be in [0, 1] (got {self.min_coverage})")
        if self.max_bytes is not None and self.max_bytes <= 0:
            problems.append(f"max_bytes must be positive or None (got {self.max_bytes})")
        if problems:
            raise ValueError("invalid anchor pool config: " + "; ".join(problems))
