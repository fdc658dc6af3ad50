"""A reuse engine whose KV heads are split over two processes (tensor-parallel ranks) plans
exactly as one engine holding all heads: same decisions on every request, and each rank's
materialized KV is the single-process KV's head slice, bit for bit.

The single-process run is the demo pipeline on a 2-layer random Llama (2 KV heads) with
first_use bases, gamma 0, shrinkage and kvblend's recompute request (8 rows: the demo's and
variants of them); its plans, learned KV, replies and bases are recorded and replayed in two
gloo-joined processes, each on its own head (``support.split_heads``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import SHRINKAGE_MIN_PAIRS
from kvcomm.core.heads import ALL_HEADS
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.pipeline import load_demo_pipeline
from kvcomm.reuse.runner import run_row
from support.one_thread import one_thread  # noqa: F401 (autouse: the recording runs single-threaded, as each rank does)
from support.split_heads import PARTIAL_DIMS, RecordingEngine, gather_both_ways, partials, replay


@pytest.fixture(scope="module")
def replayed(tiny_executor, tmp_path_factory):
    demo = load_demo_pipeline()
    variants = tuple({name: f"{text} (second case)" for name, text in row.items()} for row in demo.inputs)
    spec = dataclasses.replace(demo, inputs=demo.inputs + variants, max_new_tokens=8)
    # dense sightings (calibration rows), observed, then every row again: its own anchors are
    # identical matches, estimated (gamma 0: otherwise reuse only at a one-hot p); kvblend asks
    # for a recompute of its estimated tokens
    # (no prefix store: a row seen before would be exact up to its last token)
    config = ReuseConfig(pool=PoolConfig(gamma=0.0), mode="kvblend", recompute_ratio=0.3, prefix_store_bytes=0)
    engine = RecordingEngine(tiny_executor.rotary, config)
    for calibrate in (True, False):
        for row in range(len(spec.inputs)):
            run_row(spec, row, tiny_executor, engine, calibrate=calibrate)
    folder = tmp_path_factory.mktemp("split-heads")
    log = folder / "log.pt"
    torch.save({"rotary": tiny_executor.rotary, "config": config, "events": engine.events}, log)
    mp.spawn(replay, args=(2, str(log), str(folder / "init"), str(folder)), nprocs=2, join=True)
    single = {str(k): (f.cross, f.estimate_sq, f.real_sq) for pool in engine.pools.values() for k, f in pool.fits.items()}
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return engine, single, ranks


def test_the_recorded_run_reuses_estimates_and_fits_shrinkage(replayed):
    engine, single, _ = replayed
    plans = [e for e in engine.events if e[0] == "plan"]
    assert sum(e[2]["estimated"] for e in plans) > 0 and sum(e[2]["exact"] for e in plans) > 0
    assert any(e[2]["recompute"] for e in plans)  # recompute requests: compared across ranks
    assert single  # shrinkage observed: its sums are compared across ranks below
    # and used: some slot's estimates were served shrunk
    assert any(f.pairs >= SHRINKAGE_MIN_PAIRS for pool in engine.pools.values() for f in pool.fits.values())


def test_every_rank_makes_the_single_process_decisions(replayed):
    engine, _, ranks = replayed
    count = sum(e[0] in ("plan", "calibrate") for e in engine.events)
    for rank in ranks:
        assert len(rank["results"]) == count
        assert [r["decisions"] for r in rank["results"]] == [True] * count
        assert rank["anchors"] == {slot: len(pool) for slot, pool in engine.pools.items()}


def test_every_rank_materializes_its_heads_of_the_single_process_kv_bit_for_bit(replayed):
    _, _, ranks = replayed
    for rank in ranks:
        assert [r["kv"] for r in rank["results"]] == [True] * len(rank["results"])


def test_shrinkage_sums_over_split_heads_equal_the_single_process_sums(replayed):
    _, single, ranks = replayed
    for rank in ranks:
        assert rank["fits"].keys() == single.keys()
        for key, sums in single.items():
            for mine, reference in zip(rank["fits"][key], sums):
                assert torch.equal(mine, reference), key


def test_one_process_gather_is_the_identity():
    part = torch.arange(6.0).view(1, 2, 3)
    (same,) = ALL_HEADS.gather([part], [1])
    assert same is part
    with pytest.raises(ValueError, match="2 partials but 1 head axes"):
        ALL_HEADS.gather([part, part], [1])


def test_a_device_group_gathers_in_place_and_equals_the_host_path(tmp_path):
    """Two ranks: with a device group that serves the partials' device (on a GPU, NCCL and
    CUDA tensors; here gloo and CPU ones) the gather runs on it, without staging through the
    host group, and gives bit for bit what the host path gives: every rank's partials side by
    side in rank order, dtypes kept."""
    mp.spawn(gather_both_ways, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    expected = [torch.cat([partials(r)[i] for r in range(2)], dim) for i, dim in enumerate(PARTIAL_DIMS)]
    for rank in range(2):
        got = torch.load(tmp_path / f"gather{rank}.pt", weights_only=False)
        assert got["groups"] == ["device", "host"]
        for way in ("device", "host"):
            assert [t.dtype for t in got["gathered"][way]] == [t.dtype for t in expected]
            assert all(torch.equal(a, b) for a, b in zip(got["gathered"][way], expected, strict=True)), way
