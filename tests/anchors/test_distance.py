"""Anchor distances: the blocked computation equals the plain formula, and distances computed at
admission (and cached per segment content) give the same estimate as computing them afresh.

Small random KV, no model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcomm.core.blocks as blocks
from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.distance import estimate_distances, estimate_distances_many, value_l2, value_l2_many
from kvcomm.anchors.distance_cache import DistanceCache
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import AnchorPool
from kvcomm.core.heads import HeadShards
from kvcomm.core.kv import KV

SLOT = ("tmpl", "slot")
EMB = torch.tensor([1.0, 0.0, 0.0, 0.0]).numpy()


def rand_kv(layers: int, heads: int, t: int, dim: int, seed: int, scale: float = 1.0) -> KV:
    g = torch.Generator().manual_seed(seed)
    return KV(scale * torch.randn(layers, heads, t, dim, generator=g), scale * torch.randn(layers, heads, t, dim, generator=g))


def plain(anchor: KV, new: KV, n: int):
    """The value distances before blocking (session 7): full-size differences, fp32; (per token,
    per channel)."""
    dv = anchor.values[:, :, :n].float() - new.values[:, :, :n].float()
    count = dv.shape[0] * dv.shape[1] * dv.shape[3]
    return dv.abs().sum(3).sum((0, 1)) / count, dv.square().sum(2).sqrt()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 7), heads=st.integers(1, 3), dim=st.sampled_from([2, 8, 64]),
    anchor_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), new_len=st.integers(1, 40),
    block_bytes=st.sampled_from([1, 700, 5000, 1 << 21]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_blocked_distances_equal_the_plain_formula(layers, heads, dim, anchor_lens, new_len, block_bytes, dtype, seed):
    anchors = [rand_kv(layers, heads, t, dim, seed + 10 * i, 3.0).to(dtype) for i, t in enumerate(anchor_lens)]
    new = rand_kv(layers, heads, new_len, dim, seed + 1)
    ns = [min(t, new_len) for t in anchor_lens]
    old, threads = blocks.BLOCK_BYTES, torch.get_num_threads()
    blocks.BLOCK_BYTES = block_bytes  # 1: one layer per block; 700/5000: uneven last block
    torch.set_num_threads(1)
    try:
        many = estimate_distances_many(anchors, new, ns)
        single = [estimate_distances(a, new, n) for a, n in zip(anchors, ns)]
        l2 = [value_l2(a, new, n) for a, n in zip(anchors, ns)]
        l2_many = value_l2_many(anchors, new, ns)
    finally:
        blocks.BLOCK_BYTES = old
        torch.set_num_threads(threads)
    for anchor, n, got, alone, own_l2 in zip(anchors, ns, many, single, l2):
        for actual, expected in zip((got.token_values, got.channel_values), plain(anchor, new, n)):
            assert rel_err(actual, expected) <= 1e-6
        # value distances stand in for the keys' ones (key deviations are weighted by them)
        assert torch.equal(got.token_keys, got.token_values) and torch.equal(got.channel_keys, got.channel_values)
        for x, y in zip(dataclasses.astuple(got), dataclasses.astuple(alone)):
            assert torch.equal(x, y)  # one anchor at a time or all together: the same numbers
        exact = torch.linalg.vector_norm(anchor.values[:, :, :n].double() - new.values[:, :, :n].double())
        assert rel_err(own_l2, exact) <= 1e-6
        assert float(got.value_l2) == float(own_l2)  # both admission paths agree bit for bit
    assert [float(x) for x in l2_many] == [float(x) for x in l2]


def test_value_l2_is_accurate_to_fp64_rounding():
    anchor, new = rand_kv(8, 3, 1000, 64, 0), rand_kv(8, 3, 1000, 64, 1)
    exact = torch.linalg.vector_norm(anchor.values.double() - new.values.double())
    # fp32 sums over 1000 tokens per channel, added in fp64 (one fp32 norm over the whole
    # SmolLM2-sized difference was off by 1.6e-4).
    assert rel_err(value_l2(anchor, new, 1000), exact) <= 1e-7
    assert rel_err(estimate_distances(anchor, new, 1000).value_l2, exact) <= 1e-7


# -- admission hands its distances to estimation --------------------------------------------


def _pool(n_anchors: int = 3, length: int = 12, following: int | None = 3, **config) -> AnchorPool:
    pool = AnchorPool(PoolConfig(gamma=1.0, **config))
    for i in range(n_anchors):
        base = rand_kv(3, 2, length + i, 8, 10 + i)
        deviation = Deviation(rand_kv(3, 2, length + i, 8, 50 + i), rand_kv(3, 2, following, 8, 90 + i) if following else None)
        pool.record(SLOT, f"a{i}", base, EMB, deviation)
    return pool


def _estimate_equal(pool: AnchorPool, match, base: KV) -> None:
    fresh = dataclasses.replace(match, distances=None)
    got, want = pool.estimate(match, base), pool.estimate(fresh, base)
    for a, b in ((got[0].keys, want[0].keys), (got[0].values, want[0].values)):
        assert torch.equal(a, b)
    assert (got[1] is None) == (want[1] is None)
    if got[1] is not None:
        assert torch.equal(got[1].keys, want[1].keys) and torch.equal(got[1].values, want[1].values)


@pytest.mark.parametrize("new_length", [10, 12, 20])  # shorter than, equal to, longer than anchors
def test_estimate_from_admission_distances_equals_fresh_estimate(new_length):
    pool = _pool()
    base = rand_kv(3, 2, new_length, 8, 7)
    match = pool.decide(SLOT, "new", base, EMB)
    assert match is not None and match.distances is not None and len(match.distances) == len(match.anchors)
    _estimate_equal(pool, match, base)


def test_a_probe_for_learning_computes_the_distances_a_reuse_decision_then_finds():
    # A plan decides every segment before it knows which it reuses and which it only probes.
    pool = _pool()
    base = rand_kv(3, 2, 12, 8, 7)
    probe = pool.decide(SLOT, "new", base, EMB, commit=False)
    assert probe is not None and probe.distances is not None and len(pool.distance_cache) == 3
    _estimate_equal(pool, probe, base)
    assert pool.decide(SLOT, "new", base, EMB) == probe and pool.distance_cache.hits == 3


def test_estimate_of_a_cut_segment_uses_the_head_of_the_distances():
    # A segment that ends the prompt is cut one token short of what admission covered.
    pool = _pool(following=None)
    base = rand_kv(3, 2, 12, 8, 7)
    match = pool.decide(SLOT, "new", base, EMB)
    shared, _ = pool.estimate(match, base.span(0, 11))
    fresh, _ = pool.estimate(dataclasses.replace(match, covered=11, distances=None), base.span(0, 11))
    assert torch.equal(shared.keys, fresh.keys) and torch.equal(shared.values, fresh.values)


def test_second_decision_on_the_same_content_hits_the_cache_and_decides_the_same():
    pool = _pool(top_p=1.0)
    base = rand_kv(3, 2, 12, 8, 7)
    first = pool.decide(SLOT, "new", base, EMB)
    assert pool.distance_cache.hits == 0 and len(pool.distance_cache) == 3
    probe = pool.decide(SLOT, "new", base, EMB, commit=False)  # another agent's learning probe
    assert pool.distance_cache.hits == 3 and probe == first
    third = pool.decide(SLOT, "new", base, EMB)
    assert pool.distance_cache.hits == 6
    assert third == first and all(x is y for x, y in zip(third.distances, first.distances))
    # The same id with other KV (registered again) does not get the old distances.
    other = rand_kv(3, 2, 12, 8, 8)
    fourth = pool.decide(SLOT, "new", other, EMB)
    assert pool.distance_cache.hits == 6
    _estimate_equal(pool, fourth, other)


def test_eviction_forgets_the_anchor_in_the_cache():
    pool = _pool(max_anchors=3, eviction_window=1)
    base = rand_kv(3, 2, 12, 8, 7)
    pool.decide(SLOT, "new", base, EMB)
    assert len(pool.distance_cache) == 3
    evicted = pool.record(SLOT, "a9", rand_kv(3, 2, 12, 8, 99), EMB, Deviation(rand_kv(3, 2, 12, 8, 98), None))
    assert [a.segment_id for a in evicted] == ["a0"]
    assert len(pool.distance_cache) == 2
    assert all(serial != evicted[0].serial for per in pool.distance_cache._entries.values() for serial, _ in per[1])


def test_cache_is_lru_over_segments_and_holds_bases_weakly():
    cache = DistanceCache(segments=2)
    dist = estimate_distances(rand_kv(1, 1, 2, 2, 0), rand_kv(1, 1, 2, 2, 1), 2)
    bases = {name: rand_kv(1, 1, 2, 2, i) for i, name in enumerate("xyz")}
    for name in "xyz":
        cache.put(name, bases[name], 0, 2, dist)
    assert cache.get("x", bases["x"], 0, 2) is None  # least recently used, dropped
    assert cache.get("z", bases["z"], 0, 2) is dist and cache.get("z", bases["z"], 0, 1) is None
    del bases["z"]  # the base is gone: so is the entry's validity
    assert cache.get("z", rand_kv(1, 1, 2, 2, 2), 0, 2) is None
    with pytest.raises(ValueError, match="room for >= 1 segment"):
        DistanceCache(0)


class CountingHeads(HeadShards):
    """All heads in this process, counting the exchanges a split would make."""

    def __init__(self):
        self.calls = 0

    def gather(self, parts, dims):
        self.calls += 1
        return super().gather(parts, dims)


@pytest.mark.parametrize("commit", [False, True])
def test_a_decision_exchanges_partials_once_per_kind_not_once_per_anchor(commit):
    """Under split heads every gather is a round trip between ranks: admission's value
    distances of all compatible anchors travel together (and, when the match will estimate,
    the estimate's distances in one more)."""
    heads = CountingHeads()
    pool = AnchorPool(PoolConfig(gamma=1.0, max_candidates=0), heads)
    for i in range(5):
        base = rand_kv(2, 2, 6, 4, i)
        pool.record(SLOT, f"a{i}", base, EMB, Deviation(rand_kv(2, 2, 6, 4, 100 + i), None))
    heads.calls = 0
    match = pool.decide(SLOT, "new", rand_kv(2, 2, 6, 4, 50), EMB, commit=commit)
    assert match is not None and len(match.anchors) == 5
    assert heads.calls == 1
