"""A linear estimate of a segment's deviation from its own base KV, fitted on matched anchors.

The weighted estimate (``AnchorPool.estimate_terms``) averages the anchors' deviations token
index by token index, so it can only say what deviation the *index* showed before. The
deviation a slot's context causes also depends on the token's own content: how much it attends
to the text before it, and what it reads there. ``LinearDeviations`` learns that per (layer,
KV head) as a ridge regression from a token's position-free base key and value (and its index
in the segment) to its deviation, on every token of the matched anchors, and applies it to the
new segment's base.

Features of token ``i`` of a segment, per (layer, head), fp32 ``[F]`` with
``F = 2 * head_dim + POSITION_FEATURES + 2``: its base key, its base value, a one-hot of ``i``
for the first ``POSITION_FEATURES`` indices (segment starts deviate most), ``log(1 + i)``, 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcomm.core.kv import KV

POSITION_FEATURES = 8
"""Leading token indices that get a one-hot feature of their own."""


def token_features(base: KV, first_layer: int, n: int) -> torch.Tensor:
    """Features of the first ``n`` tokens of position-free ``base`` for model layers
    ``first_layer..``: fp32 ``[layers - first_layer, kv_heads, n, 2 * head_dim + POSITION_FEATURES + 2]``."""
    keys = base.keys[first_layer:, :, :n].float()
    values = base.values[first_layer:, :, :n].float()
    index = torch.arange(n, dtype=torch.float32, device=keys.device)
    position = torch.zeros(n, POSITION_FEATURES + 2, dtype=torch.float32, device=keys.device)
    leading = min(n, POSITION_FEATURES)
    diagonal = torch.arange(leading, device=keys.device)
    position[diagonal, diagonal] = 1.0
    position[:, POSITION_FEATURES] = torch.log1p(index)
    position[:, POSITION_FEATURES + 1] = 1.0
    return torch.cat([keys, values, position.expand(*keys.shape[:2], n, -1)], dim=-1)


@dataclass(frozen=True)
class LinearDeviations:
    """Per (layer, head) ridge maps from token features to deviations.

    keys, values: fp32 ``[layers - first_layer, kv_heads, F, head_dim]``; the deviation estimate
        of a token is ``features @ map``.
    first_layer: the first model layer the maps cover (below it the base is served exact).
    """

    keys: torch.Tensor
    values: torch.Tensor
    first_layer: int

    @classmethod
    def fit(cls, bases: Sequence[KV], deviations: Sequence[KV], first_layer: int, ridge: float) -> "LinearDeviations":
        """Least squares over every token of every anchor, with a ridge of ``ridge`` times the
        mean diagonal of the (layer, head)'s normal matrix (scale-free: the same ``ridge`` suits
        any model's KV magnitude). Normal matrices are summed in fp32, solved in fp64.

        bases: position-free base KV per anchor, ``[layers, kv_heads, T_a, head_dim]``;
        deviations: the matching deviations for model layers ``first_layer..``,
        ``[layers - first_layer, kv_heads, T_a, head_dim]``."""
        if not bases or len(bases) != len(deviations):
            raise ValueError(f"need one deviation per base and at least one anchor (got {len(bases)} bases, "
                             f"{len(deviations)} deviations)")
        gram = target_keys = target_values = None
        for base, deviation in zip(bases, deviations):
            x = token_features(base, first_layer, base.length)
            xt = x.transpose(-1, -2)
            g, k, v = xt @ x, xt @ deviation.keys.float(), xt @ deviation.values.float()
            if gram is None:
                gram, target_keys, target_values = g, k, v
            else:
                gram += g
                target_keys += k
                target_values += v
        gram, target_keys, target_values = gram.double(), target_keys.double(), target_values.double()
        scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
        regularized = gram + ridge * scale * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        solution = torch.linalg.solve(regularized, torch.cat([target_keys, target_values], dim=-1))
        dim = target_keys.shape[-1]
        return cls(solution[..., :dim].float().contiguous(), solution[..., dim:].float().contiguous(), first_layer)

    def predict(self, base: KV, n: int) -> KV:
        """The estimated deviation of the first ``n`` tokens of position-free ``base``: fp32 KV
        ``[layers - first_layer, kv_heads, n, head_dim]``."""
        x = token_features(base, self.first_layer, n)
        return KV(x @ self.keys, x @ self.values)
