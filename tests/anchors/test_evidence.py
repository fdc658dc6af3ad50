"""Evidence that a slot's estimate beats realignment (anchors/evidence.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.anchors.evidence import EVIDENCE_MIN_PAIRS, Evidence
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.core.kv import KV

LAYERS, HEADS, T, DIM = 3, 2, 5, 4


def _kv(gen: torch.Generator) -> KV:
    return KV(torch.randn(LAYERS, HEADS, T, DIM, generator=gen), torch.randn(LAYERS, HEADS, T, DIM, generator=gen))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_the_sums_are_the_squared_errors_of_the_served_estimate_and_of_realignment(seed, a, b):
    """Law: from a pair's per-layer sums, ``add`` gives ||alpha e - r||^2 and ||r||^2 per row."""
    gen = torch.Generator().manual_seed(seed)
    e, r = _kv(gen), _kv(gen)
    alpha = torch.tensor([[a] * LAYERS, [b] * LAYERS], dtype=torch.float64)
    evidence = Evidence()
    evidence.add(alpha, *ShrinkageFit.empty(LAYERS).observe(e, r))
    served = [float(((a * e.keys - r.keys) ** 2).sum()), float(((b * e.values - r.values) ** 2).sum())]
    assert evidence.estimate_sq == pytest.approx(served, rel=1e-5)
    assert evidence.realign_sq == pytest.approx([float((r.keys ** 2).sum()), float((r.values ** 2).sum())], rel=1e-6)


def test_an_estimate_is_earned_only_after_enough_pairs_closer_than_realignment():
    gen = torch.Generator().manual_seed(0)
    good, bad, half = Evidence(), Evidence(), Evidence()
    ones = torch.ones(2, LAYERS, dtype=torch.float64)
    for i in range(EVIDENCE_MIN_PAIRS):
        assert not good.earned  # too few pairs, however good
        r, noise = _kv(gen), _kv(gen)
        close = KV(r.keys + 0.1 * noise.keys, r.values + 0.1 * noise.values)
        good.add(ones, *ShrinkageFit.empty(LAYERS).observe(close, r))
        bad.add(ones, *ShrinkageFit.empty(LAYERS).observe(noise, r))  # unrelated: about twice realignment's error
        # keys predicted, values not: not earned (both must beat realignment)
        half.add(ones, *ShrinkageFit.empty(LAYERS).observe(KV(close.keys, noise.values), r))
    assert good.earned and not bad.earned and not half.earned
    assert good.ratio()[0] < 0.05 and bad.ratio()[1] > 1.5
    assert "over 2 pairs" in good.words() and Evidence().words() == "no measured pairs yet"


def test_where_realignment_is_exact_nothing_is_earned():
    zero = KV(torch.zeros(LAYERS, HEADS, T, DIM), torch.zeros(LAYERS, HEADS, T, DIM))
    evidence = Evidence()
    for _ in range(EVIDENCE_MIN_PAIRS + 1):
        evidence.add(torch.ones(2, LAYERS, dtype=torch.float64), *ShrinkageFit.empty(LAYERS).observe(zero, zero))
    assert not evidence.earned
