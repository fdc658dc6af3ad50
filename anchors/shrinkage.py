"""How far to trust a slot's anchor estimate: per-layer shrinkage fitted on the pool's own misses.

Every time a slot prefills a segment densely (a miss, which is how anchors are made), the pool
can first estimate that segment's deviation from the anchors it already holds and compare it
with the real deviation the forward just revealed. Those prequential pairs (estimate made
before the truth was known) are the only honest measure of the estimate a pool has, and they
cost no forward pass. For layer ``l`` and keys or values, with ``e`` the estimate and ``r`` the
real deviation summed over every observed pair,

    alpha_l = clamp(<e, r> / <e, e>, 0, 1)

is the least-squares factor of the estimate: serving ``base + alpha_l * e`` minimizes the
squared KV error over what was observed, and ``alpha_l = 0`` is plain realignment. So a
shrunk estimate is, on the observed pairs, never worse than realignment, and a slot whose
anchors do not predict its deviations decays to realignment instead of making it worse.

The error ratio ``||alpha e - r||^2 / ||r||^2`` (over all layers) is what the estimate leaves
of realignment's error; 1 means it adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV


@dataclass
class ShrinkageFit:
    """Running sums of one slot's prequential (estimate, real deviation) pairs.

    Each sum is fp64 ``[2, layers]`` (row 0 keys, row 1 values) over tokens, heads and
    channels of every observed pair: ``cross`` = <e, r>, ``estimate_sq`` = <e, e>,
    ``real_sq`` = <r, r>. ``pairs``: how many were observed.
    """

    cross: torch.Tensor
    estimate_sq: torch.Tensor
    real_sq: torch.Tensor
    pairs: int = 0

    @classmethod
    def empty(cls, layers: int) -> "ShrinkageFit":
        return cls(*(torch.zeros(2, layers, dtype=torch.float64) for _ in range(3)))

    def observe(self, estimate: KV, real: KV, head_shards: HeadShards = ALL_HEADS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add one pair: both ``[layers, kv_heads, T, head_dim]``, any float dtype, same shape
        (this rank's heads under split heads: the sums are over all heads, per head first).
        ``real`` may leave out the first layers (a deviation stored from a later layer): the
        sums of those layers are left as they are. Returns this pair's own sums (<e, r>, <e, e>,
        <r, r>, each fp64 ``[2, layers]`` on the host, zero on the left-out layers)."""
        skip = estimate.keys.shape[0] - real.keys.shape[0]
        if skip < 0 or estimate.keys.shape[1:] != real.keys.shape[1:] or estimate.values.shape[1:] != real.values.shape[1:]:
            raise ValueError(f"estimate {tuple(estimate.keys.shape)} and real deviation {tuple(real.keys.shape)} differ in shape")
        if skip:
            estimate = KV(estimate.keys[skip:], estimate.values[skip:])
        per_head = torch.empty(3, 2, *estimate.keys.shape[:2], dtype=torch.float64, device=estimate.keys.device)  # [sum, row, layers, heads]
        for row, (e, r) in enumerate(((estimate.keys, real.keys), (estimate.values, real.values))):
            e, r = e.double().flatten(2), r.double().flatten(2)
            per_head[0, row], per_head[1, row], per_head[2, row] = (e * r).sum(2), (e * e).sum(2), (r * r).sum(2)
        (per_head,) = head_shards.gather([per_head], [3])
        pair = torch.zeros(3, *self.cross.shape, dtype=torch.float64)
        pair[:, :, skip:] = per_head.sum(3).cpu()  # the sums stay in host memory: a few numbers per layer
        self.cross += pair[0]
        self.estimate_sq += pair[1]
        self.real_sq += pair[2]
        self.pairs += 1
        return pair[0], pair[1], pair[2]

    def factors(self, min_pairs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key, value) factors, fp32 ``[layers]`` each in [0, 1]; None before ``min_pairs`` pairs."""
        if self.pairs < min_pairs:
            return None
        alpha = self._alpha()
        return alpha[0].float(), alpha[1].float()

    def error_ratio(self) -> tuple[float, float] | None:
        """(keys, values): squared error of the shrunk estimate over realignment's, on the pairs seen."""
        if self.pairs == 0:
            return None
        alpha = self._alpha()
        left = self.real_sq - 2 * alpha * self.cross + alpha * alpha * self.estimate_sq
        ratio = left.sum(1) / self.real_sq.sum(1).clamp_min(1e-300)
        return float(ratio[0]), float(ratio[1])

    def _alpha(self) -> torch.Tensor:
        """fp64 ``[2, layers]`` least-squares factors clamped to [0, 1] (0 where no estimate was seen)."""
        return torch.where(self.estimate_sq > 0, self.cross / self.estimate_sq.clamp_min(1e-300), 0.0).clamp(0, 1)
