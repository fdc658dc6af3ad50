"""Per-layer shrinkage of anchor estimates, fitted on the pool's own misses (anchors/shrinkage.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import SHRINKAGE_MIN_PAIRS, AnchorPool
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.reuse import ReuseConfig, ReuseEngine
from kvcomm.core.kv import KV
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment

LAYERS, HEADS, T, DIM = 3, 2, 6, 8
SLOT = ("agent", "doc")


def _kv(gen: torch.Generator, scale: float = 1.0) -> KV:
    return KV(scale * torch.randn(LAYERS, HEADS, T, DIM, generator=gen), scale * torch.randn(LAYERS, HEADS, T, DIM, generator=gen))


def _squared_error(fit_pairs, alpha_k, alpha_v) -> float:
    return sum(float(((alpha_k[:, None, None, None] * e.keys - r.keys) ** 2).sum()
                     + ((alpha_v[:, None, None, None] * e.values - r.values) ** 2).sum()) for e, r in fit_pairs)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), pairs=st.integers(1, 4), signal=st.floats(-2.0, 2.0))
def test_fitted_factors_are_never_worse_than_realignment_or_the_raw_estimate(seed, pairs, signal):
    """Law: on the observed pairs, the fitted factors give a squared error <= that of factor 0
    (realignment) and factor 1 (the unshrunk estimate), and the reported error ratio is it."""
    gen = torch.Generator().manual_seed(seed)
    fit, seen = ShrinkageFit.empty(LAYERS), []
    for _ in range(pairs):
        e, noise = _kv(gen), _kv(gen)
        r = KV(signal * e.keys + noise.keys, signal * e.values + noise.values)
        fit.observe(e, r)
        seen.append((e, r))
    ak, av = fit.factors(1)
    assert bool(((ak >= 0) & (ak <= 1)).all()) and bool(((av >= 0) & (av <= 1)).all())
    fitted = _squared_error(seen, ak, av)
    zeros, ones = torch.zeros(LAYERS), torch.ones(LAYERS)
    assert fitted <= _squared_error(seen, zeros, zeros) * (1 + 1e-6)
    assert fitted <= _squared_error(seen, ones, ones) * (1 + 1e-6)
    ratio_k, ratio_v = fit.error_ratio()
    real_sq = sum(float((r.keys ** 2).sum() + (r.values ** 2).sum()) for _, r in seen)
    key_sq = sum(float((r.keys ** 2).sum()) for _, r in seen)
    assert ratio_k * key_sq + ratio_v * (real_sq - key_sq) == pytest.approx(fitted, rel=1e-5)


def test_a_perfect_estimate_keeps_factor_one_and_an_opposite_one_decays_to_realignment():
    gen = torch.Generator().manual_seed(0)
    perfect, opposite = ShrinkageFit.empty(LAYERS), ShrinkageFit.empty(LAYERS)
    for _ in range(3):
        e = _kv(gen)
        perfect.observe(e, e)
        opposite.observe(e, KV(-e.keys, -e.values))
    assert torch.allclose(perfect.factors(1)[0], torch.ones(LAYERS)) and perfect.error_ratio()[0] == pytest.approx(0, abs=1e-9)
    assert torch.equal(opposite.factors(1)[1], torch.zeros(LAYERS)) and opposite.error_ratio()[1] == pytest.approx(1)
    assert perfect.factors(4) is None  # fewer pairs than asked for: not used yet
    with pytest.raises(ValueError, match="differ in shape"):
        perfect.observe(e, e.span(0, T - 1))


def _pool_with_noise_anchors(gen, shrinkage=True) -> AnchorPool:
    pool = AnchorPool(PoolConfig(gamma=1.0, shrinkage=shrinkage, max_candidates=0))
    for i in range(3):
        base = _kv(gen)
        pool.record(SLOT, f"a{i}", base, np.ones(4, dtype=np.float32), Deviation(_kv(gen), None))
    return pool


@pytest.mark.parametrize("shrinkage", [True, False])
def test_a_slot_whose_anchors_do_not_predict_its_deviations_is_served_almost_realigned(shrinkage):
    """Anchors with deviations unrelated to the truth: after two observed misses
    (``SHRINKAGE_MIN_PAIRS``; one is not enough) the served estimate shrinks towards zero
    (realignment); with shrinkage off it stays as it was."""
    assert SHRINKAGE_MIN_PAIRS == 2
    gen = torch.Generator().manual_seed(1)
    pool = _pool_with_noise_anchors(gen, shrinkage)
    new = _kv(gen)
    match = pool.decide(SLOT, "new", new, np.ones(4, dtype=np.float32), commit=False, admission=False)
    raw, _ = pool.estimate(match, new)
    for i in range(2):
        if i == 1:  # one pair observed: not used yet
            assert torch.equal(pool.estimate(match, new)[0].keys, raw.keys)
        probe = _kv(gen)
        m = pool.decide(SLOT, "probe", probe, np.ones(4, dtype=np.float32), commit=False, admission=False)
        pool.observe(m, probe, KV(-pool.estimate(m, probe)[0].keys, -pool.estimate(m, probe)[0].values))
    served, _ = pool.estimate(match, new)
    ratio = float(served.keys.norm() / raw.keys.norm())
    if shrinkage:
        assert ratio < 1e-6  # the observed estimates pointed the wrong way: factor 0
        assert pool.fits[(SLOT, "shared")].pairs == 2
    else:
        assert ratio == pytest.approx(1.0)


def test_identical_matches_are_neither_observed_nor_shrunk():
    gen = torch.Generator().manual_seed(2)
    pool = _pool_with_noise_anchors(gen)
    pool.fits[(SLOT, "shared")] = ShrinkageFit(torch.zeros(2, LAYERS), torch.ones(2, LAYERS, dtype=torch.float64),
                                               torch.ones(2, LAYERS, dtype=torch.float64), pairs=5)  # factor 0
    anchor = pool.get("a0")
    match = pool.decide(SLOT, "a0", anchor.base, anchor.embedding)
    assert match.identical
    served, _ = pool.estimate(match, anchor.base)
    assert torch.equal(served.keys, anchor.deviations[SLOT].shared.keys.float())
    pool.observe(match, anchor.base, anchor.deviations[SLOT].shared)
    assert pool.fits[(SLOT, "shared")].pairs == 5


def test_the_engine_observes_each_dense_segment_before_it_becomes_an_anchor():
    """Through ReuseEngine.learn: with two anchors in the slot, the third and fourth new
    contents (dense calls) are observed against the pool's would-be estimate, by its shrinkage
    fit and its evidence alike."""
    rotary = Rotary(1.0 / (1e4 ** (torch.arange(0, DIM, 2).float() / DIM)), head_dim=DIM)
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=0.0)))
    gen = torch.Generator().manual_seed(3)
    for i in range(4):
        shared = tuple(range(100 + 10 * i, 100 + 10 * i + T))
        prompt = Prompt("agent", (Segment((1, 2, 3)), Segment(shared, slot="doc", shared_id=f"doc-{i}"), Segment((99,))))
        plan = engine.calibration_plan(prompt, lambda s: KV(torch.randn(LAYERS, HEADS, len(s), DIM, generator=gen),
                                                             torch.randn(LAYERS, HEADS, len(s), DIM, generator=gen)))
        assert plan.estimated_tokens == 0 and plan.learn == [1]
        n = len(prompt) - plan.reuse_end  # the template's lead is served exact after the first prompt
        engine.learn(plan, KV(torch.randn(LAYERS, HEADS, n, DIM, generator=gen), torch.randn(LAYERS, HEADS, n, DIM, generator=gen)))
    fit = engine.pool("doc").fits[(("agent", "doc"), "shared")]
    assert fit.pairs == 2 and engine.pool("doc").evidence[(("agent", "doc"), "shared")].pairs == 2

