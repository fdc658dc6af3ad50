"""The anchor pool: admission, top-p access counting, eviction, byte budget, estimation, narrowing.

Everything runs on small hand-built KV tensors ([layers=2, kv_heads=1, T, head_dim=4]); no model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcomm.anchors.anchor import Anchor, Deviation
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.distance import ADMISSION_TEMPERATURE
from kvcomm.anchors.pool import AnchorPool, Match
from kvcomm.core.kv import KV

L, H, D = 2, 1, 4
SLOT = ("tmpl", "slot")
OTHER_SLOT = ("tmpl", "other")
EMB_DIM = 4


# -- helpers ---------------------------------------------------------------------------------


def const_kv(t: int, key: float = 0.0, value: float = 0.0) -> KV:
    return KV(torch.full((L, H, t, D), float(key)), torch.full((L, H, t, D), float(value)))


def value_offset(t: int, distance: float) -> KV:
    """Zero keys; values zero except one element, so that the value L2 distance to zeros is ``distance``."""
    kv = const_kv(t)
    kv.values[0, 0, 0, 0] = distance
    return kv


def rand_kv(t: int, seed: int) -> KV:
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(L, H, t, D, generator=g), torch.randn(L, H, t, D, generator=g))


def emb(*xs: float) -> np.ndarray:
    v = np.zeros(EMB_DIM, dtype=np.float32)
    v[: len(xs)] = xs
    return v


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5) -> None:
    """Same shape and elementwise within ``atol`` (torch.testing costs a second to warm up)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = float((actual.float() - expected.float()).abs().max()) if actual.numel() else 0.0
    assert err <= atol, f"max abs error {err} > {atol}"


DEFAULT_EMB = emb(1.0)


def dev(t: int, fill: float = 1.0, following: int | None = None, ffill: float = 2.0) -> Deviation:
    shared = const_kv(t, fill, -fill)
    return Deviation(shared, const_kv(following, ffill, -ffill) if following else None)


def add(pool: AnchorPool, sid: str, base: KV, embedding: np.ndarray = DEFAULT_EMB, slot=SLOT, deviation=None):
    return pool.record(slot, sid, base, embedding, deviation if deviation is not None else dev(base.length))


def accesses(pool: AnchorPool) -> dict[str, int]:
    return {a.segment_id: a.accesses for a in pool.anchors}


def index_size(pool: AnchorPool) -> int:
    return 0 if pool._index is None else len(pool._index)


# -- 6. config validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": -0.1}, "gamma must be >= 0 (got -0.1)"),
        ({"gamma": float("nan")}, "gamma must be >= 0"),
        ({"max_anchors": 0}, "max_anchors must be an integer >= 1 (got 0)"),
        ({"eviction_window": 0}, "eviction_window must be an integer >= 1 (got 0)"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (got 0.0)"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (got 1.5)"),
        ({"temperature": 0.0}, "temperature must be > 0 (got 0.0)"),
        ({"temperature": -1.0}, "temperature must be > 0 (got -1.0)"),
        ({"max_candidates": 1}, "max_candidates must be 0 (all) or >= 2 (got 1)"),
        ({"max_candidates": -3}, "max_candidates must be an integer >= 0 (got -3)"),
        ({"max_bytes": 0}, "max_bytes must be a positive integer or None (got 0)"),
        ({"min_compatible": 0}, "min_compatible must be an integer >= 1 (got 0)"),
        ({"min_compatible": 1.5}, "min_compatible must be an integer >= 1 (got 1.5)"),
        ({"shrinkage": 1}, "shrinkage must be true or false (got 1)"),
    ],
)
def test_config_rejects_bad_values_with_clear_message(kwargs, message):
    with pytest.raises(ValueError) as info:
        PoolConfig(**kwargs)
    assert str(info.value).startswith("invalid anchor pool config: ")
    assert message in str(info.value)


def test_config_reports_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        PoolConfig(gamma=-1, max_anchors=0, eviction_window=0, top_p=2, temperature=0, max_candidates=1)
    text = str(info.value)
    for word in ("gamma", "max_anchors", "eviction_window", "top_p", "temperature", "max_candidates"):
        assert word in text


def test_config_accepts_boundaries():
    PoolConfig(gamma=0.0, max_anchors=1, eviction_window=1, top_p=1.0, temperature=1e-6, max_candidates=0)
    PoolConfig(max_candidates=2, max_bytes=1)


# -- 2. admission ----------------------------------------------------------------------------


def test_empty_pool_goes_dense():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is None


def test_single_anchor_goes_dense_even_if_identical_content():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    add(pool, "a", const_kv(4))
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is None
    assert accesses(pool) == {"a": 0}


def test_min_compatible_one_estimates_from_the_first_compatible_anchor():
    pool = AnchorPool(PoolConfig(gamma=0.0, min_compatible=1))
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is None  # nothing to estimate from
    add(pool, "a", value_offset(4, 3.0), deviation=dev(4, fill=0.5))
    assert pool.decide(OTHER_SLOT, "new", const_kv(4), DEFAULT_EMB) is None  # "a" has no deviation there
    match = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB)  # one anchor: p is one-hot, entropy 0
    assert match is not None and not match.identical
    assert [a.segment_id for a in match.anchors] == ["a"] and match.covered == 4
    assert accesses(pool) == {"a": 1}
    shared, following = pool.estimate(match, const_kv(4))
    close(shared.keys, dev(4, fill=0.5).shared.keys)  # weight 1 on the only anchor
    close(shared.values, dev(4, fill=0.5).shared.values)
    assert following is None


def test_low_entropy_matches_and_counts_the_dominant_anchor():
    pool = AnchorPool(PoolConfig(gamma=0.3, top_p=0.9))
    add(pool, "near", const_kv(4))
    add(pool, "far", value_offset(4, 50.0))
    match = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB)
    assert isinstance(match, Match)
    assert match.slot == SLOT and match.covered == 4 and not match.identical
    assert {a.segment_id for a in match.anchors} == {"near", "far"}
    # p = [1 - e^-50, e^-50]: the first anchor alone carries the top-p mass.
    assert accesses(pool) == {"near": 1, "far": 0}


def test_equidistant_anchors_have_entropy_log2():
    base = const_kv(4)
    for gamma, expect_match in [(0.3, False), (0.99, False), (1.0, True), (1.5, True)]:
        pool = AnchorPool(PoolConfig(gamma=gamma))
        add(pool, "a", value_offset(4, 3.0))
        b = const_kv(4)
        b.values[1, 0, 2, 3] = -3.0  # a different tensor at the same distance 3
        add(pool, "b", b)
        match = pool.decide(SLOT, "new", base, DEFAULT_EMB)
        assert (match is not None) is expect_match, gamma
        if match is not None:
            # p = [0.5, 0.5], top_p 0.9: both needed to reach the mass.
            assert accesses(pool) == {"a": 1, "b": 1}
        else:
            assert accesses(pool) == {"a": 0, "b": 0}


def test_a_refusal_says_which_rule_refused():
    refusals: list[str] = []
    pool = AnchorPool(PoolConfig(gamma=0.3))
    add(pool, "a", value_offset(4, 3.0))
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB, refusals=refusals) is None
    b = const_kv(4)
    b.values[1, 0, 2, 3] = -3.0  # equidistant: entropy log 2, above 0.3 log 2
    add(pool, "b", b)
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB, refusals=refusals) is None
    assert pool.decide(SLOT, "new", const_kv(9), DEFAULT_EMB, refusals=refusals) is None  # 4 of 9 covered
    assert refusals == ["1 compatible anchors, 2 needed", "admission entropy 0.69 over 2 anchors above gamma 0.3",
                        "anchors cover 4 of 9 tokens, under min_coverage 0.5"]
    assert pool.decide(SLOT, "a", value_offset(4, 3.0), DEFAULT_EMB, refusals=refusals).identical
    assert len(refusals) == 3  # a match adds nothing


def _two_point_entropy_ratio(logit_gap: float) -> float:
    """H(p) / log 2 for p = softmax([0, -logit_gap])."""
    s = 1.0 / (1.0 + math.exp(-logit_gap))
    return -(s * math.log(s) + (1 - s) * math.log(1 - s)) / math.log(2)


@pytest.mark.parametrize("gap", [0.002, 0.01])
def test_entropy_threshold_is_exactly_gamma_log_n_relative(gap):
    # Anchors at per-element RMS distances 1 and 1 + gap (2 * 1 * 4 * 4 = 32 elements each):
    # logits -(1 / 1) / tau and -((1 + gap) / 1) / tau, a gap of gap / tau.
    near, far = const_kv(4, value=1.0), const_kv(4, value=1.0 + gap)
    ratio = _two_point_entropy_ratio(gap / ADMISSION_TEMPERATURE)
    assert 0.05 < ratio < 0.999
    for gamma, expect_match in [(ratio - 1e-4, False), (ratio + 1e-4, True)]:
        pool = AnchorPool(PoolConfig(gamma=gamma))
        add(pool, "far", far)
        add(pool, "near", near)
        match = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB)
        assert (match is not None) is expect_match


def test_relative_admission_is_length_normalized_and_scale_free():
    new = rand_kv(8, 0)
    noise = 3.0 * rand_kv(8, 1).values
    noise[:, :, 4:] = 1.006 * noise[:, :, :4]  # "long" is about 0.3% farther per element than "short"
    long = KV(new.keys.clone(), new.values + noise)
    short = KV(new.keys[:, :, :4].clone(), new.values[:, :, :4] + noise[:, :, :4])
    relative = AnchorPool(PoolConfig())
    add(relative, "long", long)
    add(relative, "short", short)
    # The raw L2 over min(T, length) tokens makes "short" look far nearer (fewer tokens compared):
    # softmax(-l2), the reference's p, would be one-hot on it.
    l2 = torch.stack([torch.linalg.vector_norm(noise.double()), torch.linalg.vector_norm(noise[:, :, :4].double())])
    assert float(torch.softmax(-l2, 0)[1]) > 0.99
    # Per-element RMS relative to the nearest, over tau, computed independently here.
    rms = torch.stack([noise.double().square().mean().sqrt(), noise[:, :, :4].double().square().mean().sqrt()])
    expected = torch.softmax(-(rms / rms.min()) / ADMISSION_TEMPERATURE, 0)
    p_rel = relative._admission(list(relative.anchors), new)
    close(p_rel, expected, atol=1e-6)
    assert 0.05 < float(p_rel[0]) < 0.5  # "long" keeps real weight: not one-hot
    # Scale-free: scaling every value by 10 changes nothing.
    scaled = AnchorPool(PoolConfig())
    add(scaled, "long", KV(long.keys, long.values * 10))
    add(scaled, "short", KV(short.keys, short.values * 10))
    close(scaled._admission(list(scaled.anchors), KV(new.keys, new.values * 10)), p_rel, atol=1e-5)


def test_relative_admission_with_an_anchor_at_distance_zero_is_one_hot():
    pool = AnchorPool(PoolConfig(gamma=0.0, top_p=1.0))
    add(pool, "twin", rand_kv(4, 3))
    add(pool, "other", rand_kv(4, 4))
    match = pool.decide(SLOT, "new", rand_kv(4, 3), DEFAULT_EMB)  # same values as "twin", another id
    assert match is not None and not match.identical
    assert accesses(pool) == {"twin": 1, "other": 0}


_GAMMAS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)


@settings(max_examples=120, deadline=None)
@given(
    offsets=st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0, 5.0, 40.0]), min_size=2, max_size=6),
    lengths=st.lists(st.integers(2, 6), min_size=6, max_size=6),
    new_length=st.integers(2, 6),
)
def test_admission_laws_in_gamma(offsets, lengths, new_length):
    """gamma = 1 always reuses (>= 2 compatible anchors); gamma = 0 reuses only when p is
    one-hot; reuse is monotone in gamma."""
    center = rand_kv(6, 100).values
    new = KV(torch.zeros(L, H, new_length, D), center[:, :, :new_length])
    decisions = []
    for gamma in _GAMMAS:
        pool = AnchorPool(PoolConfig(gamma=gamma, min_coverage=0.0))
        for i, (offset, t) in enumerate(zip(offsets, lengths)):
            add(pool, f"a{i}", KV(torch.zeros(L, H, t, D), center[:, :, :t] + offset * rand_kv(t, i).values))
        decisions.append(pool.decide(SLOT, "new", new, DEFAULT_EMB, commit=False) is not None)
        if gamma == 0.0:
            p = pool._admission(list(pool.anchors), new)
    assert decisions[-1], "gamma = 1 must reuse with >= 2 compatible anchors"
    assert decisions == sorted(decisions), f"not monotone in gamma: {dict(zip(_GAMMAS, decisions))}"
    if decisions[0]:
        assert float(p.max()) >= 1 - 1e-9, p


def test_anchors_without_a_deviation_for_the_slot_do_not_count():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    add(pool, "a", const_kv(4))
    add(pool, "b", value_offset(4, 50.0), slot=OTHER_SLOT)
    add(pool, "c", value_offset(4, 80.0), slot=OTHER_SLOT)
    # Three anchors, but only "a" is compatible with SLOT.
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is None
    # For OTHER_SLOT "b" and "c" are compatible and "a" is not part of the match.
    match = pool.decide(OTHER_SLOT, "new", const_kv(4), DEFAULT_EMB)
    assert match is not None and {x.segment_id for x in match.anchors} == {"b", "c"}
    assert accesses(pool) == {"a": 0, "b": 1, "c": 0}
    # Giving "b" a deviation for SLOT makes two compatible anchors.
    add(pool, "b", value_offset(4, 50.0), slot=SLOT)
    match = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB)
    assert match is not None and {x.segment_id for x in match.anchors} == {"a", "b"}


def test_partial_coverage_covers_what_the_longest_anchor_covers():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    add(pool, "three", const_kv(3))
    add(pool, "four", value_offset(4, 40.0))
    match = pool.decide(SLOT, "new", const_kv(7), DEFAULT_EMB)
    assert match is not None
    assert match.covered == 4  # the longest anchor, shorter than T = 7
    # Only anchors covering those 4 tokens estimate them.
    assert [a.segment_id for a in match.anchors] == ["four"]
    # Distances use the first min(T, len) tokens: "three" (distance 0 on 3 tokens) dominates.
    assert accesses(pool) == {"three": 1, "four": 0}


def test_partial_coverage_with_an_anchor_long_enough_covers_everything():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    add(pool, "three", const_kv(3))
    add(pool, "eight", value_offset(8, 40.0))
    add(pool, "five", const_kv(5))
    match = pool.decide(SLOT, "new", const_kv(5), DEFAULT_EMB)
    assert match is not None and match.covered == 5
    assert {a.segment_id for a in match.anchors} == {"eight", "five"}


def test_the_estimated_part_is_what_the_longest_compatible_anchor_covers():
    pool = AnchorPool(PoolConfig(gamma=1.0, min_coverage=0.0))
    for sid, length in (("three", 3), ("eight", 8), ("five", 5)):
        add(pool, sid, value_offset(length, 1.0))
    match = pool.decide(SLOT, "new", const_kv(10), DEFAULT_EMB)
    assert match is not None and match.covered == 8
    assert {a.segment_id for a in match.anchors} == {"eight"}


def test_identical_segment_is_reused_directly():
    pool = AnchorPool(PoolConfig(gamma=0.0))
    base = rand_kv(5, 1)
    add(pool, "seg", base)
    # Even alone in the pool (which otherwise means dense).
    match = pool.decide(SLOT, "seg", base, DEFAULT_EMB)
    assert match == Match(SLOT, (pool.get("seg"),), 5, identical=True)
    assert accesses(pool) == {"seg": 1}
    pool.decide(SLOT, "seg", base, DEFAULT_EMB, commit=False)
    assert accesses(pool) == {"seg": 1}


def test_identical_segment_without_deviation_for_the_slot_is_not_reused():
    pool = AnchorPool(PoolConfig(gamma=1.0))
    add(pool, "seg", rand_kv(5, 1), slot=OTHER_SLOT)
    assert pool.decide(SLOT, "seg", rand_kv(5, 1), DEFAULT_EMB) is None


def test_commit_false_leaves_access_counts_unchanged():
    # RMS distances within a few tau of each other: no anchor's p underflows to 0, so top_p = 1
    # counts all three.
    pool = AnchorPool(PoolConfig(gamma=1.0, top_p=1.0))
    add(pool, "a", const_kv(4, value=1.0))
    add(pool, "b", const_kv(4, value=1.005))
    add(pool, "c", const_kv(4, value=1.01))
    probe = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB, commit=False)
    assert probe is not None
    assert accesses(pool) == {"a": 0, "b": 0, "c": 0}
    real = pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB)
    assert real == probe
    assert accesses(pool) == {"a": 1, "b": 1, "c": 1}


# -- 3. top-p access counting ----------------------------------------------------------------


@pytest.mark.parametrize(
    "top_p, counted",
    [(0.5, {"a"}), (0.69, {"a"}), (0.71, {"a", "b"}), (0.9, {"a", "b"}), (0.951, {"a", "b", "c"}), (1.0, {"a", "b", "c"})],
)
def test_top_p_counts_the_anchors_carrying_the_mass(top_p, counted):
    probs = [0.7, 0.25, 0.05]
    # p = softmax(-(r / r_min) / tau) = probs for per-element RMS distances r_i = 1 + tau * log(p_0 / p_i)
    # (every element of the values at r_i, the new base's at 0).
    distances = [1.0 + ADMISSION_TEMPERATURE * math.log(probs[0] / p) for p in probs]
    entropy = -sum(p * math.log(p) for p in probs)
    assert entropy / math.log(3) < 0.7
    pool = AnchorPool(PoolConfig(gamma=0.7, top_p=top_p))
    # Insert in an order unrelated to probability.
    for sid, d in [("c", distances[2]), ("a", distances[0]), ("b", distances[1])]:
        add(pool, sid, const_kv(4, value=d))
    close(pool._admission(list(pool.anchors), const_kv(4)), torch.tensor([probs[2], probs[0], probs[1]], dtype=torch.float64), atol=1e-4)
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is not None
    assert accesses(pool) == {sid: int(sid in counted) for sid in "abc"}


def test_top_p_stops_as_soon_as_the_mass_is_reached():
    # Equidistant pair: p = [0.5, 0.5] exactly; top_p = 0.5 is reached by one anchor alone.
    pool = AnchorPool(PoolConfig(gamma=1.0, top_p=0.5))
    add(pool, "a", value_offset(4, 2.0))
    add(pool, "b", value_offset(4, -2.0))
    assert pool.decide(SLOT, "new", const_kv(4), DEFAULT_EMB) is not None
    assert sorted(accesses(pool).values()) == [0, 1]


# -- 4. eviction and byte budget -------------------------------------------------------------


def test_eviction_takes_least_accessed_among_window_not_global():
    pool = AnchorPool(PoolConfig(max_anchors=5, eviction_window=3))
    for i in range(5):
        add(pool, f"a{i}", rand_kv(4, i))
    for sid, n in zip(["a0", "a1", "a2", "a3", "a4"], [5, 2, 3, 0, 0]):
        pool.get(sid).accesses = n
    evicted = add(pool, "new", rand_kv(4, 99))
    # a3/a4 have fewer accesses but lie outside the window of the 3 earliest.
    assert [a.segment_id for a in evicted] == ["a1"]
    assert [a.segment_id for a in pool.anchors] == ["a0", "a2", "a3", "a4", "new"]
    assert pool.evictions == 1 and len(pool) == 5 and index_size(pool) == 5


def test_eviction_ties_go_to_the_earliest():
    pool = AnchorPool(PoolConfig(max_anchors=3, eviction_window=3))
    for i in range(3):
        add(pool, f"a{i}", rand_kv(4, i))
    pool.get("a0").accesses = 4
    pool.get("a1").accesses = 1
    pool.get("a2").accesses = 1
    assert [a.segment_id for a in add(pool, "x", rand_kv(4, 10))] == ["a1"]
    # Window now a0 (4), a2 (1), x (0): x is the least accessed.
    assert [a.segment_id for a in add(pool, "y", rand_kv(4, 11))] == ["x"]
    assert [a.segment_id for a in pool.anchors] == ["a0", "a2", "y"]


def test_eviction_window_one_is_fifo():
    pool = AnchorPool(PoolConfig(max_anchors=3, eviction_window=1))
    for i in range(3):
        add(pool, f"a{i}", rand_kv(4, i))
    pool.get("a0").accesses = 100
    assert [a.segment_id for a in add(pool, "x", rand_kv(4, 10))] == ["a0"]
    assert [a.segment_id for a in add(pool, "y", rand_kv(4, 11))] == ["a1"]
    assert pool.evictions == 2


def test_eviction_counts_accesses_earned_through_decide():
    pool = AnchorPool(PoolConfig(gamma=1.0, max_anchors=3, eviction_window=3, top_p=0.5))
    add(pool, "a", const_kv(4))
    add(pool, "b", value_offset(4, 30.0))
    add(pool, "c", value_offset(4, 60.0))
    for _ in range(2):
        assert pool.decide(SLOT, "n", const_kv(4), DEFAULT_EMB) is not None
    assert pool.decide(SLOT, "n", value_offset(4, 60.0), DEFAULT_EMB) is not None
    assert accesses(pool) == {"a": 2, "b": 0, "c": 1}
    assert [x.segment_id for x in add(pool, "d", rand_kv(4, 5))] == ["b"]


def test_capacity_one():
    pool = AnchorPool(PoolConfig(max_anchors=1, eviction_window=4))
    assert add(pool, "a", rand_kv(4, 0)) == []
    pool.get("a").accesses = 9
    evicted = add(pool, "b", rand_kv(4, 1))
    assert [x.segment_id for x in evicted] == ["a"]
    assert [x.segment_id for x in pool.anchors] == ["b"] and index_size(pool) == 1
    # Re-recording the held segment for another slot evicts nothing.
    assert add(pool, "b", rand_kv(4, 1), slot=OTHER_SLOT) == []
    assert set(pool.get("b").deviations) == {SLOT, OTHER_SLOT}
    assert pool.decide(SLOT, "c", rand_kv(4, 2), DEFAULT_EMB) is None
    assert pool.evictions == 1


def test_byte_budget_evicts_until_under_budget():
    # Each anchor: base 2*(2*1*4*4)*4 = 256 bytes + deviation 256 = 512 bytes.
    one = 512
    assert rand_kv(4, 0).nbytes + dev(4).nbytes == one
    pool = AnchorPool(PoolConfig(max_anchors=10, eviction_window=10, max_bytes=3 * one + 100))
    for i in range(3):
        assert add(pool, f"a{i}", rand_kv(4, i)) == []
    pool.get("a0").accesses = 3
    pool.get("a1").accesses = 1
    pool.get("a2").accesses = 2
    assert pool.nbytes == 3 * one
    # A double-size anchor (8 tokens: 1024 bytes) forces two evictions: a1 then a2.
    evicted = add(pool, "big", rand_kv(8, 3))
    assert [x.segment_id for x in evicted] == ["a1", "a2"]
    assert [x.segment_id for x in pool.anchors] == ["a0", "big"]
    assert pool.nbytes == 3 * one <= pool.config.max_bytes
    assert pool.evictions == 2 and index_size(pool) == 2


def test_byte_budget_refuses_an_anchor_larger_than_the_whole_budget():
    pool = AnchorPool(PoolConfig(max_bytes=600))
    assert add(pool, "small", rand_kv(4, 0)) == []  # 512 bytes
    assert add(pool, "huge", rand_kv(8, 1)) == []  # 1024 bytes: refused, nothing evicted
    assert [x.segment_id for x in pool.anchors] == ["small"]
    assert pool.get("huge") is None and pool.evictions == 0 and index_size(pool) == 1


def test_byte_budget_holds_when_a_held_anchor_grows_past_it():
    # 512 bytes with one deviation; a second deviation with a following segment would make it 896.
    pool = AnchorPool(PoolConfig(max_bytes=800))
    add(pool, "a", rand_kv(4, 0))
    add(pool, "b", rand_kv(2, 1))
    big = dev(4, following=6)
    assert pool.get("a").nbytes + big.nbytes > 800
    evicted = add(pool, "a", rand_kv(4, 0), slot=OTHER_SLOT, deviation=big)
    assert evicted == []
    assert pool.nbytes <= 800
    assert set(pool.get("a").deviations) == {SLOT}
    assert len(pool) == 2


def test_byte_budget_evicts_others_when_a_held_anchor_grows():
    pool = AnchorPool(PoolConfig(max_bytes=1100, eviction_window=5))
    add(pool, "a", rand_kv(4, 0))  # 512
    add(pool, "b", rand_kv(4, 1))  # 512
    evicted = add(pool, "b", rand_kv(4, 1), slot=OTHER_SLOT, deviation=dev(4))  # b -> 768
    assert [x.segment_id for x in evicted] == ["a"]  # b itself is protected even though it is in the window
    assert pool.nbytes == 768 and [x.segment_id for x in pool.anchors] == ["b"]


# -- 7. narrowing by embedding ---------------------------------------------------------------


def _narrowing_pool(max_candidates: int, other_slot: tuple[int, ...] = ()) -> AnchorPool:
    # RMS distances within a few tau of each other: no anchor's p underflows to 0, so top_p = 1
    # counts every candidate.
    pool = AnchorPool(PoolConfig(gamma=1.0, top_p=1.0, max_candidates=max_candidates, max_anchors=20))
    for i in range(10):
        angle = i * 0.3
        # Anchors 3 and 4 are the nearest to the query direction (angle 1.0) by embedding; their
        # base values are the *farthest* from the new base, so narrowing is not a by-product of d.
        d = 1.0 + 0.001 * (10 + i if i in (3, 4) else i)
        slot = OTHER_SLOT if i in other_slot else SLOT
        add(pool, f"a{i}", const_kv(4, value=d), embedding=emb(math.cos(angle), math.sin(angle)), slot=slot)
    return pool


def test_narrowing_keeps_the_nearest_by_embedding():
    pool = _narrowing_pool(2)
    query = emb(math.cos(1.0), math.sin(1.0))  # angles 0.9 (a3) and 1.2 (a4) are nearest
    match = pool.decide(SLOT, "new", const_kv(4), query)
    assert match is not None
    assert [a.segment_id for a in match.anchors] == ["a3", "a4"]
    assert accesses(pool) == {f"a{i}": int(i in (3, 4)) for i in range(10)}


def test_narrowing_only_among_compatible_anchors():
    pool = _narrowing_pool(2, other_slot=(3,))  # a3, nearest by embedding, lacks a deviation for SLOT
    query = emb(math.cos(1.0), math.sin(1.0))
    match = pool.decide(SLOT, "new", const_kv(4), query)
    # Next nearest compatible by embedding after a4 (angle 1.2) is a2 (angle 0.6).
    assert match is not None and [a.segment_id for a in match.anchors] == ["a4", "a2"]
    # top_p = 1: every considered anchor is counted, and only those.
    assert accesses(pool) == {f"a{i}": int(i in (2, 4)) for i in range(10)}


def test_max_candidates_zero_keeps_all():
    pool = _narrowing_pool(0)
    match = pool.decide(SLOT, "new", const_kv(4), emb(math.cos(1.0), math.sin(1.0)))
    assert match is not None and len(match.anchors) == 10
    # a0 is the nearest -> the largest probability -> counted.
    assert pool.get("a0").accesses == 1


# -- 5. estimation ---------------------------------------------------------------------------


def _kv_from_tokens(key_rows: list[float], value_rows: list[float]) -> KV:
    """Constant per token: key token t = key_rows[t] everywhere, value token t = value_rows[t]."""
    k = torch.tensor(key_rows, dtype=torch.float32)[None, None, :, None].expand(L, H, -1, D).clone()
    v = torch.tensor(value_rows, dtype=torch.float32)[None, None, :, None].expand(L, H, -1, D).clone()
    return KV(k, v)


def _anchor(sid: str, base: KV, deviation: Deviation, serial: int = 0) -> Anchor:
    a = Anchor(sid, base, DEFAULT_EMB, serial)
    a.deviations[SLOT] = deviation
    return a


def test_estimate_picks_the_nearest_anchor_per_token():
    new = _kv_from_tokens([0.0, 0.0], [0.0, 0.0])
    # A equals the new base on token 0 and is far on token 1; B the opposite.
    a = _anchor("A", _kv_from_tokens([0.0, 50.0], [0.0, 50.0]), Deviation(rand_kv(2, 1), None))
    b = _anchor("B", _kv_from_tokens([50.0, 0.0], [50.0, 0.0]), Deviation(rand_kv(2, 2), None), 1)
    pool = AnchorPool(PoolConfig(temperature=1.0))
    shared, following = pool.estimate(Match(SLOT, (a, b), 2), new)
    assert following is None
    da, db = a.deviations[SLOT].shared, b.deviations[SLOT].shared
    close(shared.keys[:, :, 0], da.keys[:, :, 0])
    close(shared.keys[:, :, 1], db.keys[:, :, 1])
    close(shared.values[:, :, 0], da.values[:, :, 0])
    close(shared.values[:, :, 1], db.values[:, :, 1])


def test_estimate_weights_are_softmax_of_mean_abs_difference_over_tau():
    tau = 2.0
    new = _kv_from_tokens([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    # Base keys favour A on token 0, base values favour B: key deviations follow the value
    # distances, as value deviations do (the base keys are not compared).
    a_base = _kv_from_tokens([0.0, 1.0, 3.0], [2.0, -1.0, 0.0])
    b_base = _kv_from_tokens([2.0, 1.0, 0.0], [0.0, 1.0, 3.0])
    a = _anchor("A", a_base, Deviation(const_kv(3, 1.0, 10.0), None))
    b = _anchor("B", b_base, Deviation(const_kv(3, 5.0, 20.0), None), 1)
    pool = AnchorPool(PoolConfig(temperature=tau))
    shared, _ = pool.estimate(Match(SLOT, (a, b), 3), new)

    def mix(da: float, db: float, xa: float, xb: float) -> float:
        wa = math.exp(-da / tau) / (math.exp(-da / tau) + math.exp(-db / tau))
        return wa * xa + (1 - wa) * xb

    for t, (dva, dvb) in enumerate([(2, 0), (1, 1), (0, 3)]):
        assert shared.keys[:, :, t].flatten().tolist() == pytest.approx([mix(dva, dvb, 1.0, 5.0)] * L * H * D, abs=1e-5)
        assert shared.values[:, :, t].flatten().tolist() == pytest.approx([mix(dva, dvb, 10.0, 20.0)] * L * H * D, abs=1e-5)


def test_estimate_from_matched_anchor_equal_to_new_base_and_its_equal_twin():
    # Two anchors with the same base as the new segment: uniform weights -> the mean deviation.
    base = rand_kv(3, 7)
    a = _anchor("A", base.clone(), Deviation(const_kv(3, 1.0, 3.0), None))
    b = _anchor("B", base.clone(), Deviation(const_kv(3, 3.0, 7.0), None), 1)
    shared, _ = AnchorPool().estimate(Match(SLOT, (a, b), 3), base)
    close(shared.keys, torch.full((L, H, 3, D), 2.0))
    close(shared.values, torch.full((L, H, 3, D), 5.0))


def test_estimate_covers_only_the_first_covered_tokens():
    new = rand_kv(6, 3)
    a = _anchor("A", rand_kv(4, 4), Deviation(rand_kv(4, 5), None))
    b = _anchor("B", rand_kv(5, 6), Deviation(rand_kv(5, 7), None), 1)
    shared, _ = AnchorPool().estimate(Match(SLOT, (a, b), 4), new)
    assert shared.keys.shape == (L, H, 4, D) and shared.values.shape == (L, H, 4, D)


def test_following_estimate_weights_per_layer_head_channel():
    tau = 1.0
    n = 3
    new = const_kv(n)
    # A matches the new base exactly on (layer 0, channel 0) and (layer 1, channel 2);
    # B on every other (layer, channel). The far side differs by 40 on every token.
    a_base, b_base = const_kv(n), const_kv(n)
    near_a = torch.zeros(L, H, D, dtype=torch.bool)
    near_a[0, 0, 0] = near_a[1, 0, 2] = True
    for base, mask in [(a_base, ~near_a), (b_base, near_a)]:
        base.keys[mask.unsqueeze(2).expand(L, H, n, D)] = 40.0
        base.values[mask.unsqueeze(2).expand(L, H, n, D)] = -40.0
    fa, fb = rand_kv(2, 11), rand_kv(2, 12)
    a = _anchor("A", a_base, Deviation(rand_kv(n, 13), fa))
    b = _anchor("B", b_base, Deviation(rand_kv(n, 14), fb), 1)
    _, following = AnchorPool(PoolConfig(temperature=tau)).estimate(Match(SLOT, (a, b), n), new)
    assert following is not None and following.keys.shape == (L, H, 2, D)
    pick = near_a[:, :, None, :].expand(L, H, 2, D)
    close(following.keys, torch.where(pick, fa.keys, fb.keys))
    close(following.values, torch.where(pick, fa.values, fb.values))


def test_following_estimate_exact_weights_and_head_alignment():
    tau = 1.5
    # The new segment has 2 tokens; anchor A has 4: only A's first 2 count, the tokens the
    # shared estimate combines.
    new = const_kv(2)
    a_base = const_kv(4)
    a_base.values[:, :, 2:] = 1000.0  # tokens beyond the covered ones, ignored
    a_base.values[0, 0, :2, 1] = torch.tensor([3.0, 4.0])  # L2 over covered tokens = 5 on (0, 0, 1)
    a_base.keys[1, 0, :2, 2] = 50.0  # base keys are not compared
    b_base = const_kv(2)
    b_base.values[0, 0, :, 1] = torch.tensor([1.0, 0.0])  # L2 = 1 on (0, 0, 1)
    fa, fb = const_kv(1, 1.0, 1.0), const_kv(1, 3.0, 3.0)
    a = _anchor("A", a_base, Deviation(const_kv(4), fa))
    b = _anchor("B", b_base, Deviation(const_kv(2), fb), 1)
    # The base-value distances weight the key and the value deviations alike, per channel.
    _, following = AnchorPool(PoolConfig(temperature=tau)).estimate(Match(SLOT, (a, b), 2), new)
    ra, rb = 5 / math.sqrt(2), 1 / math.sqrt(2)  # per-token RMS: L2 over the 2 compared tokens / sqrt(2)
    wa = math.exp(-ra / tau) / (math.exp(-ra / tau) + math.exp(-rb / tau))
    expected = torch.full((L, H, 1, D), 2.0)  # equal distances elsewhere -> mean of 1 and 3
    expected[0, 0, 0, 1] = wa * 1.0 + (1 - wa) * 3.0
    close(following.keys, expected)
    close(following.values, expected)


def test_following_is_none_when_any_anchor_lacks_it_or_lengths_differ():
    new = const_kv(3)
    with_f = _anchor("A", const_kv(3), Deviation(const_kv(3), const_kv(2, 1.0)))
    without = _anchor("B", const_kv(3), Deviation(const_kv(3), None), 1)
    other_len = _anchor("C", const_kv(3), Deviation(const_kv(3), const_kv(3, 1.0)), 2)
    pool = AnchorPool()
    assert pool.estimate(Match(SLOT, (with_f, without), 3), new)[1] is None
    assert pool.estimate(Match(SLOT, (with_f, other_len), 3), new)[1] is None


def test_identical_match_returns_the_stored_deviation_exactly():
    pool = AnchorPool()
    base = rand_kv(5, 1)
    stored = Deviation(rand_kv(5, 2), rand_kv(3, 3))
    pool.record(SLOT, "seg", base, DEFAULT_EMB, stored)
    add(pool, "other", rand_kv(5, 4))
    match = pool.decide(SLOT, "seg", base, DEFAULT_EMB)
    assert match.identical
    shared, following = pool.estimate(match, base)
    assert torch.equal(shared.keys, stored.shared.keys) and torch.equal(shared.values, stored.shared.values)
    assert torch.equal(following.keys, stored.following.keys) and torch.equal(following.values, stored.following.values)


def test_decide_then_estimate_end_to_end():
    pool = AnchorPool(PoolConfig(gamma=0.5))
    near, far = rand_kv(4, 1), rand_kv(4, 2)
    far = KV(far.keys + 30.0, far.values + 30.0)
    pool.record(SLOT, "near", near, DEFAULT_EMB, Deviation(const_kv(4, 1.0, 2.0), const_kv(2, 3.0, 4.0)))
    pool.record(SLOT, "far", far, DEFAULT_EMB, Deviation(const_kv(4, -1.0, -2.0), const_kv(2, -3.0, -4.0)))
    match = pool.decide(SLOT, "new", near.clone(), DEFAULT_EMB)
    assert match is not None and match.covered == 4
    shared, following = pool.estimate(match, near.clone())
    close(shared.keys, torch.full((L, H, 4, D), 1.0))
    close(shared.values, torch.full((L, H, 4, D), 2.0))
    close(following.keys, torch.full((L, H, 2, D), 3.0))
    close(following.values, torch.full((L, H, 2, D), 4.0))


# -- 1. stateful property: cap, byte budget, index, eviction accounting ----------------------

SEGMENTS = [f"s{i}" for i in range(8)]  # recorded and probed
PROBES = [f"p{i}" for i in range(3)]  # only probed: never an anchor, never identical
SLOTS = [("t", "x"), ("t", "y")]
FOLLOWING = {("t", "x"): 2, ("t", "y"): None}


def _predict_record(model: list[list], sid: str, size_new: int, dev_size: int, slot_had: int | None, cfg: PoolConfig):
    """Reference model of record(): ``model`` is [[segment_id, accesses, nbytes]] in insertion order."""
    evicted: list[str] = []

    def evict(protect: str | None) -> None:
        window = [m for m in model if m[0] != protect][: cfg.eviction_window]
        victim = min(window, key=lambda m: m[1])  # min keeps the first (earliest) on ties
        model.remove(victim)
        evicted.append(victim[0])

    held = next((m for m in model if m[0] == sid), None)
    if held is None:
        if cfg.max_bytes is not None and size_new > cfg.max_bytes:
            return evicted
        while len(model) >= cfg.max_anchors:
            evict(None)
        model.append([sid, 0, size_new])
    else:
        grown = held[2] - (slot_had or 0) + dev_size
        if cfg.max_bytes is not None and grown > cfg.max_bytes:
            return evicted
        held[2] = grown
    if cfg.max_bytes is not None:
        while sum(m[2] for m in model) > cfg.max_bytes and len(model) > 1:
            evict(sid)
    return evicted


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        v=st.integers(1, 6),
        w=st.integers(1, 4),
        max_bytes=st.one_of(st.none(), st.integers(400, 4000)),
        gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.0]),
        top_p=st.sampled_from([0.5, 0.9, 1.0]),
        max_candidates=st.sampled_from([0, 2, 3]),
        lengths=st.lists(st.integers(3, 8), min_size=len(SEGMENTS + PROBES), max_size=len(SEGMENTS + PROBES)),
        spread=st.sampled_from([0.05, 0.5, 3.0]),
    )
    def setup(self, v, w, max_bytes, gamma, top_p, max_candidates, lengths, spread):
        self.cfg = PoolConfig(
            gamma=gamma, max_anchors=v, eviction_window=w, top_p=top_p,
            max_candidates=max_candidates, max_bytes=max_bytes,
        )
        self.pool = AnchorPool(self.cfg)
        center = rand_kv(8, 12345)
        self.bases = {}
        self.embeddings = {}
        for i, (sid, t) in enumerate(zip(SEGMENTS + PROBES, lengths)):
            noise = rand_kv(t, i)
            self.bases[sid] = KV(center.keys[:, :, :t] + spread * noise.keys, center.values[:, :, :t] + spread * noise.values)
            self.embeddings[sid] = np.random.default_rng(i).standard_normal(EMB_DIM).astype(np.float32)
        self.model: list[list] = []
        self.removed = 0

    def _sync_accesses(self) -> None:
        held = {a.segment_id: a for a in self.pool.anchors}
        assert [m[0] for m in self.model] == list(held)
        for m in self.model:
            m[1] = held[m[0]].accesses
            assert m[2] == held[m[0]].nbytes

    @rule(sid=st.sampled_from(SEGMENTS), slot=st.sampled_from(SLOTS), fill=st.floats(-1, 1))
    def record(self, sid, slot, fill):
        base = self.bases[sid]
        deviation = dev(base.length, fill, FOLLOWING[slot])
        self._sync_accesses()
        held = self.pool.get(sid)
        slot_had = held.deviations[slot].nbytes if held is not None and slot in held.deviations else None
        before = {a.segment_id for a in self.pool.anchors}
        expected = _predict_record(self.model, sid, base.nbytes + deviation.nbytes, deviation.nbytes, slot_had, self.cfg)
        evicted = self.pool.record(slot, sid, base, self.embeddings[sid], deviation)
        after = {a.segment_id for a in self.pool.anchors}
        assert [a.segment_id for a in evicted] == expected
        assert before - after == set(expected) and sid not in expected
        self.removed += len(evicted)

    @rule(sid=st.sampled_from(SEGMENTS + PROBES), slot=st.sampled_from(SLOTS), commit=st.booleans())
    def decide(self, sid, slot, commit):
        base = self.bases[sid]
        before = {a.segment_id: a.accesses for a in self.pool.anchors}
        match = self.pool.decide(slot, sid, base, self.embeddings[sid], commit=commit)
        after = {a.segment_id: a.accesses for a in self.pool.anchors}
        assert list(before) == list(after)  # decide never changes membership
        if not commit or match is None:
            assert before == after
        else:
            gained = {k for k in after if after[k] != before[k]}
            assert gained and all(after[k] == before[k] + 1 for k in gained)
        if match is not None:
            assert match.slot == slot and 1 <= match.covered <= base.length
            assert match.anchors and all(slot in a.deviations and a.length >= match.covered for a in match.anchors)
            if match.identical:
                assert match.anchors[0].segment_id == sid and match.covered == base.length
            else:
                assert len(before) >= 2
                # partial coverage: the part the longest compatible anchor covers
                assert match.covered == min(base.length, max(a.length for a in match.anchors))
            shared, following = self.pool.estimate(match, base)
            assert shared.length == match.covered
            assert torch.isfinite(shared.keys).all() and torch.isfinite(shared.values).all()

    @invariant()
    def bounded(self):
        if not hasattr(self, "pool"):
            return
        assert len(self.pool) <= self.cfg.max_anchors
        if self.cfg.max_bytes is not None:
            assert self.pool.nbytes <= self.cfg.max_bytes
        assert index_size(self.pool) == len(self.pool)
        assert self.pool.evictions == self.removed
        serials = [a.serial for a in self.pool.anchors]
        assert serials == sorted(serials)
        assert self.pool.problems() == []


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_problems_reports_each_broken_invariant():
    pool = AnchorPool(PoolConfig(max_anchors=3, gamma=1.0))
    for i in range(4):
        add(pool, f"s{i}", value_offset(3, float(i + 1)))
    pool.decide(SLOT, "new", value_offset(3, 2.5), DEFAULT_EMB)
    assert pool.problems() == [] and pool.accesses_granted > 0 and pool.evictions == 1
    pool.anchors[0].accesses += 1  # a lost or doubled update, as a race would leave it
    assert any("access counts do not add up" in p for p in pool.problems())
    pool.anchors[0].accesses -= 1
    pool._anchors["extra"] = Anchor("extra", const_kv(3), DEFAULT_EMB, 99)  # bypassing the index
    problems = pool.problems()
    assert any("exceed V = 3" in p for p in problems) and any("index holds" in p for p in problems)
