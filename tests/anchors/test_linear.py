"""The linear deviation estimator: its features, the ridge fit's law, its errors."""

from __future__ import annotations

import math

import pytest
import torch

from kvcomm.anchors.linear import POSITION_FEATURES, LinearDeviations, token_features
from kvcomm.core.kv import KV

L, H, D = 3, 2, 4
F = 2 * D + POSITION_FEATURES + 2


def rand_kv(t: int, seed: int, layers: int = L) -> KV:
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(layers, H, t, D, generator=g), torch.randn(layers, H, t, D, generator=g))


def test_features_are_base_key_value_leading_one_hot_log_index_and_one():
    base = rand_kv(11, 0)
    x = token_features(base, 1, 10)
    assert x.shape == (L - 1, H, 10, F) and x.dtype == torch.float32
    assert torch.equal(x[..., :D], base.keys[1:, :, :10])
    assert torch.equal(x[..., D:2 * D], base.values[1:, :, :10])
    position = x[0, 0, :, 2 * D:]
    assert torch.equal(position[:, :POSITION_FEATURES], torch.eye(10)[:, :POSITION_FEATURES])
    assert position[:, POSITION_FEATURES].tolist() == pytest.approx([math.log1p(i) for i in range(10)])
    assert position[:, POSITION_FEATURES + 1].tolist() == [1.0] * 10
    assert torch.equal(x[1, 1, :, 2 * D:], position)  # the same for every layer and head


def test_features_of_a_segment_shorter_than_the_one_hot():
    x = token_features(rand_kv(3, 0), 0, 3)
    assert torch.equal(x[0, 0, :, 2 * D:2 * D + POSITION_FEATURES], torch.eye(3, POSITION_FEATURES))


@pytest.mark.parametrize("first_layer", [0, 1])
def test_a_deviation_linear_in_the_features_is_recovered_exactly(first_layer):
    # Law: when every anchor's deviation is features @ W per (layer, head), the fit is W and
    # predicts a new segment's deviation exactly, whatever the anchors' lengths.
    g = torch.Generator().manual_seed(1)
    wk, wv = torch.randn(L - first_layer, H, F, D, generator=g), torch.randn(L - first_layer, H, F, D, generator=g)
    bases = [rand_kv(t, seed) for seed, t in enumerate((12, 20, 9))]
    deviations = [KV(token_features(b, first_layer, b.length) @ wk, token_features(b, first_layer, b.length) @ wv)
                  for b in bases]
    fit = LinearDeviations.fit(bases, deviations, first_layer, ridge=1e-12)
    new = rand_kv(15, 99)
    predicted = fit.predict(new, 14)
    x = token_features(new, first_layer, 14)
    assert predicted.keys.shape == (L - first_layer, H, 14, D)
    torch.testing.assert_close(predicted.keys, x @ wk, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(predicted.values, x @ wv, atol=1e-3, rtol=1e-4)


def test_the_ridge_shrinks_the_maps_towards_zero():
    bases = [rand_kv(10, seed) for seed in range(3)]
    deviations = [rand_kv(10, 10 + seed) for seed in range(3)]
    norms = [LinearDeviations.fit(bases, deviations, 0, ridge).keys.norm() for ridge in (1e-4, 1.0, 100.0)]
    assert norms[0] > norms[1] > norms[2]


def test_fit_refuses_unmatched_inputs():
    with pytest.raises(ValueError, match="one deviation per base"):
        LinearDeviations.fit([rand_kv(4, 0)], [], 0, 1e-4)
    with pytest.raises(ValueError, match="at least one anchor"):
        LinearDeviations.fit([], [], 0, 1e-4)
