"""What an ``AnchorPool`` is configured with: ``PoolConfig`` (admission, estimation, eviction)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolConfig:
    """Settings of one anchor pool (admission, estimation, eviction); measurements behind the
    defaults are in docs/measurements/ (docs/results.md links them)."""

    gamma: float = 1.0
    """Admission threshold: reuse only if the entropy of p over the compatible anchors is
    <= gamma * log(#compatible); 0 reuses only a one-hot p, 1 always reuses."""
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
    max_bytes: int | None = None
    """Byte budget for the pool's tensors (None: unbounded)."""
    min_compatible: int = 2
    """Compatible anchors (a deviation for the slot) a segment needs before it is estimated;
    with fewer it goes dense and becomes one. 2 is the reference's rule."""
    min_coverage: float = 0.5
    """A segment whose anchors would cover fewer than this share of its tokens goes dense and
    becomes an anchor instead of reusing its covered first tokens."""
    shrinkage: bool = True
    """Scale each layer's estimated deviation by the slot's fitted factor in [0, 1]
    (``kvcomm.anchors.shrinkage``), fitted on the estimates the pool would have made for the
    segments it then saw densely; False serves the weighted deviations as they are (the reference)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.gamma >= 0:
            problems.append(f"gamma must be >= 0 (got {self.gamma})")
        for name, least in (("max_anchors", 1), ("eviction_window", 1), ("min_compatible", 1), ("max_candidates", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{name} must be an integer >= {least} (got {value!r})")
        if self.max_candidates == 1:
            problems.append("max_candidates must be 0 (all) or >= 2 (got 1)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0 (got {self.temperature})")
        if not 0 <= self.min_coverage <= 1:
            problems.append(f"min_coverage must be in [0, 1] (got {self.min_coverage})")
        if not isinstance(self.shrinkage, bool):
            problems.append(f"shrinkage must be true or false (got {self.shrinkage!r})")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
                                           or self.max_bytes <= 0):
            problems.append(f"max_bytes must be a positive integer or None (got {self.max_bytes!r})")
        if problems:
            raise ValueError("invalid anchor pool config: " + "; ".join(problems))
