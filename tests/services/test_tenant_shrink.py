"""The order in which a tenant over its byte cap gives memory back (``TenantEngine.shrink``):
cheapest to rebuild first (exact prefixes, then shared-content bases, then fixed-segment
bases), anchors last and from the largest pool; and the total cap shrinks the largest
tenant first."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.core.heads import HeadShards
from kvcomm.core.kv import KV
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Segment
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.runner import run_agent
from kvcomm.services.tenants import TenantEngine, TenantRegistry
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from support.two_agent_case import PIPELINE, agent_prompt

WORDS = "river mountain city forest ocean desert island valley bridge castle garden market".split()


def _fill(engine, executor, rows: int, seed: int = 0) -> None:
    """Two-agent rows on random documents, as calibration calls (every shared segment with a
    base becomes an anchor; plans would serve cold slots realigned and learn nothing)."""
    spec = parse_pipeline(PIPELINE)
    rng = random.Random(seed)
    for _ in range(rows):
        doc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "."
        reader = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))) + "."
        for agent in spec.agents:
            run_agent(executor, engine, agent_prompt(executor, agent, {"doc": doc, "reader": reader}), 2, calibrate=True)


def _registry(executor, **caps) -> TenantRegistry:
    return TenantRegistry(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=0.0)), **caps)


def test_shrink_gives_back_prefixes_then_bases_then_fixed_bases_then_anchors(tiny_executor):
    engine = _registry(tiny_executor).engine("shrinking")
    _fill(engine, tiny_executor, 5)
    full = engine.memory()
    assert full.prefix_store and full.bases and full.fixed_bases and sum(full.pools.values()), full

    def step(target: int):
        before = dict(engine.evicted)
        engine.shrink(target)
        after = engine.memory()
        assert after.total <= target
        return after, {k: engine.evicted[k] - before[k] for k in before}

    # just under the total: the exact prefix store pays alone
    after, evicted = step(full.total - 1)
    assert evicted["prefix_store"] >= 1 and evicted["bases"] == evicted["fixed_bases"] == evicted["anchors"] == 0
    assert (after.bases, after.fixed_bases, after.pools) == (full.bases, full.fixed_bases, full.pools)
    # below what prefixes can give: all of them go, then shared-content bases
    after, evicted = step(full.total - full.prefix_store - 1)
    assert after.prefix_store == 0 and evicted["bases"] >= 1 and evicted["fixed_bases"] == evicted["anchors"] == 0
    assert (after.fixed_bases, after.pools) == (full.fixed_bases, full.pools)
    # below prefixes + bases: fixed-segment bases next, anchors untouched
    after, evicted = step(full.fixed_bases + sum(full.pools.values()) - 1)
    assert after.bases == 0 and evicted["fixed_bases"] >= 1 and evicted["anchors"] == 0 and after.pools == full.pools
    # only anchors left: the largest pool gives up one anchor first
    pools = {slot: n for slot, n in after.pools.items() if n}
    largest = max(pools, key=pools.get)
    after, evicted = step(sum(pools.values()) - 1)
    assert after.fixed_bases == 0 and evicted["anchors"] == 1
    assert after.pools[largest] < pools[largest] and all(after.pools[s] == n for s, n in pools.items() if s != largest)
    assert not any(pool.problems() for pool in engine.pools.values())


def test_the_total_cap_shrinks_the_largest_tenant_first(tiny_executor):
    registry = _registry(tiny_executor)
    small, large = registry.engine("small"), registry.engine("large")
    _fill(small, tiny_executor, 1, seed=1)
    _fill(large, tiny_executor, 4, seed=2)
    sizes = {"small": small.nbytes, "large": large.nbytes}
    assert sizes["large"] > 2 * sizes["small"]
    registry.max_total_bytes = sum(sizes.values()) - sizes["small"] // 2  # less than the large one can give
    registry.enforce()
    assert small.nbytes == sizes["small"] and sum(small.evicted.values()) == 0  # the small tenant is not touched
    assert large.nbytes <= sizes["large"] - sizes["small"] // 2 and registry.nbytes <= registry.max_total_bytes
    assert registry.problems() == []


class _Rank(HeadShards):
    """Rank ``rank`` of two, for byte accounting only (nothing here gathers)."""

    def __init__(self, rank: int):
        self.size, self.rank = 2, rank


def test_two_ranks_count_half_of_what_one_process_counts_and_shrink_alike():
    """Law behind per-rank byte caps: each rank of a head split holds half of every KV and
    counts half of every embedding (which it holds whole), so the ranks' bytes add up to the
    single process's and a rank over half the cap is one process over the cap."""
    rotary = Rotary(1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8)), head_dim=8)
    embedder = lambda token_ids, base: np.full(64, 0.125, dtype=np.float32)  # noqa: E731 (whole on every rank)
    whole = TenantEngine(rotary, embedder=embedder)
    ranks = [TenantEngine(rotary, embedder=embedder, head_shards=_Rank(r)) for r in (0, 1)]
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        segment = Segment(tuple(range(100 * i, 100 * i + 3 + i)), slot="doc", shared_id=f"d{i}")
        kv = KV(*(torch.randn(2, 2, len(segment), 8, generator=gen) for _ in range(2)))
        whole.register_base(segment, kv)
        for r, engine in enumerate(ranks):
            engine.register_base(segment, KV(kv.keys[:, r : r + 1].clone(), kv.values[:, r : r + 1].clone()))
    assert [engine.nbytes * 2 for engine in ranks] == [whole.nbytes] * 2
    target = whole.nbytes // 2 // 2 * 2
    whole.shrink(target)
    for engine in ranks:
        engine.shrink(target // 2)
        assert engine.evicted == whole.evicted and sorted(engine._bases) == sorted(whole._bases)
    assert whole.evicted["bases"] > 0
