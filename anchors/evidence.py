"""Whether a slot's anchor estimate has earned its place: measured closer to dense than plain
realignment of the same segments.

Both ways of serving a shared segment start from the same stored base: realignment serves the
base as it is (its error is the real deviation ``r``), an estimate serves the base plus the
anchors' estimated deviation ``alpha * e`` (``alpha``: the slot's shrinkage factors in force at
the time, 1 before shrinkage has pairs or with shrinkage off; its error is ``alpha * e - r``).
Every time a slot's segment is seen densely while its pool could have estimated it (a computed
call, a calibration call, a quality guard's twin), both errors are known at no forward pass:
``Evidence`` adds them up, prequentially (the estimate is the one the pool would have served
before it saw the truth). The rule (docs/anchor-pool.md, docs/decisions.md 2026-12-07):

    a slot serves its estimate only when it holds at least ``EVIDENCE_MIN_PAIRS`` pairs and the
    estimate's summed squared error is below realignment's, for keys and for values alike;
    otherwise it serves the realigned base.

Sums are Python floats (fp64), per row (keys, values), over every layer, head, token and channel
of every pair: host numbers, so the rule costs the reuse path no tensor op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

EVIDENCE_MIN_PAIRS = 2
"""Prequential pairs a slot needs before its estimate may be served (the shrinkage fit's own minimum)."""


@dataclass
class Evidence:
    """Running prequential sums of one slot part ("shared" or "following"): ``estimate_sq``, the
    squared error of the estimate the slot would have served, ``realign_sq``, that of its
    realigned base (the real deviation's square), each ``[keys, values]``; ``pairs``."""

    estimate_sq: list[float] = field(default_factory=lambda: [0.0, 0.0])
    realign_sq: list[float] = field(default_factory=lambda: [0.0, 0.0])
    pairs: int = 0

    def add(self, alpha: torch.Tensor, cross: torch.Tensor, estimate_sq: torch.Tensor, real_sq: torch.Tensor) -> None:
        """One pair, from its per-layer sums (each fp64 ``[2, layers]``: <e, r>, <e, e>, <r, r>)
        and ``alpha``, the factors the served estimate would have carried (``[2, layers]``, in [0, 1]):
        ``||alpha e - r||^2 = <r, r> - 2 alpha <e, r> + alpha^2 <e, e>`` per layer."""
        alpha = alpha.to(torch.float64).cpu()
        served = (real_sq - 2 * alpha * cross + alpha * alpha * estimate_sq).clamp_min(0).sum(1).tolist()
        self.estimate_sq = [held + new for held, new in zip(self.estimate_sq, served)]
        self.realign_sq = [held + new for held, new in zip(self.realign_sq, real_sq.sum(1).tolist())]
        self.pairs += 1

    def ratio(self) -> tuple[float, float] | None:
        """(keys, values): the estimate's summed squared error over realignment's; None before any pair."""
        if self.pairs == 0:
            return None
        keys, values = (served / max(realigned, 1e-300) for served, realigned in zip(self.estimate_sq, self.realign_sq))
        return keys, values

    @property
    def earned(self) -> bool:
        """The rule of the module docstring: at least ``EVIDENCE_MIN_PAIRS`` pairs and the estimate's
        summed squared error strictly below realignment's for keys and for values (where
        realignment is exact, nothing is left to earn)."""
        return self.pairs >= EVIDENCE_MIN_PAIRS and all(served < realigned for served, realigned in zip(self.estimate_sq, self.realign_sq))

    def words(self) -> str:
        """"estimate error 0.62x / 0.71x realignment's (keys / values) over 3 pairs", or "no pairs yet"."""
        ratio = self.ratio()
        if ratio is None:
            return "no measured pairs yet"
        return f"estimate error {ratio[0]:.2f}x / {ratio[1]:.2f}x realignment's (keys / values) over {self.pairs} pairs"
