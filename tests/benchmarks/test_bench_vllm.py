"""``benchmarks/bench_vllm.py``: its report functions keep their invariants on hand-made
records (totals are sums over every call of every pass, the ratio is stock-sum / kvcomm-sum,
overhead ratios are of medians), its document extension reaches the asked length, and a tiny
configuration runs end to end through vLLM with a report that keeps the same invariants."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.eval.demo_report import DemoCall

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("bench_vllm")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _call(agent: str, row: int, dense: float, reuse: float, estimated: int = 0) -> DemoCall:
    return DemoCall(agent, row, 100, 10, estimated, 90 - estimated, 0, estimated > 0, False, dense, reuse, True, "", "",
                    "a", "a", 100, 5, 0)


def check_pipeline_invariants(pipeline: dict, n_agents: int) -> None:
    """What every pipeline report must hold, whatever the timings."""
    s = pipeline["summary"]
    per_pass = pipeline["passes"]
    assert s["passes"] == len(per_pass)
    assert s["calls"] == sum(p["calls"] for p in per_pass) == sum(a["calls"] for a in pipeline["agents"])
    assert len(pipeline["agents"]) == n_agents
    for key in ("total_ttft_dense_s", "total_ttft_reuse_s"):
        assert math.isclose(s[key], sum(p[key] for p in per_pass), rel_tol=1e-9)
        assert math.isclose(s[key], sum(a[key] for a in pipeline["agents"]), rel_tol=1e-9)
    assert math.isclose(s["total_ttft_speedup"], s["total_ttft_dense_s"] / s["total_ttft_reuse_s"], rel_tol=1e-9)
    for p in per_pass:
        assert math.isclose(p["total_ttft_speedup"], p["total_ttft_dense_s"] / p["total_ttft_reuse_s"], rel_tol=1e-9)
    for a in pipeline["agents"]:
        for system in ("dense", "reuse"):
            assert a[f"ttft_{system}_p50_s"] <= a[f"ttft_{system}_p95_s"] <= a[f"total_ttft_{system}_s"]
    assert s["exact_tokens"] + s["estimated_tokens"] + s["computed_tokens"] == s["prompt_tokens"]


def check_overhead_invariants(overhead: dict) -> None:
    for o in overhead.values():
        for name in ("plugin_no_opt_in", "plugin_opt_in_no_reuse"):
            assert math.isclose(o[f"{name}_ratio"], o[f"{name}_p50_s"] / o["stock_p50_s"], rel_tol=1e-9)
        assert o["samples"] > 0


def test_pipeline_report_sums_every_call_of_every_pass(bench):
    first = [_call("a", 0, 2.0, 2.5), _call("b", 0, 3.0, 3.0), _call("a", 1, 2.0, 0.5, 50), _call("b", 1, 4.0, 1.0, 60)]
    second = [_call("a", 0, 1.0, 1.5), _call("b", 0, 1.0, 1.0), _call("a", 1, 3.0, 1.0, 50), _call("b", 1, 2.0, 0.5, 60)]
    report = bench.pipeline_report([first, second])
    check_pipeline_invariants(report, n_agents=2)
    assert report["summary"]["total_ttft_dense_s"] == pytest.approx(18.0)
    assert report["summary"]["total_ttft_reuse_s"] == pytest.approx(11.0)
    assert report["summary"]["total_ttft_speedup"] == pytest.approx(18.0 / 11.0)
    assert [p["total_ttft_speedup"] for p in report["passes"]] == pytest.approx([11.0 / 7.0, 7.0 / 4.0])
    assert report["agents"][0]["ttft_dense_p50_s"] == pytest.approx(2.0)  # agent a's four calls: 1, 2, 2, 3


def test_overhead_report_ratios_are_of_medians(bench):
    samples = {"short": {"stock": [1.0, 3.0, 2.0], "plugin_no_opt_in": [2.2, 1.1, 9.0],
                         "plugin_opt_in_no_reuse": [2.0, 2.4, 2.1]}}
    report = bench.overhead_report(samples, {"short": [100, 101]})
    check_overhead_invariants(report)
    assert report["short"]["plugin_no_opt_in_ratio"] == pytest.approx(2.2 / 2.0)
    assert report["short"]["plugin_opt_in_no_reuse_ratio"] == pytest.approx(2.1 / 2.0)
    assert report["short"]["samples"] == 3


def test_long_documents_reach_the_asked_length(bench):
    spec = parse_pipeline({"agents": [{"name": "r", "system": "s", "template": "Doc: {document}"}],
                           "inputs": [{"document": "one two\n\nthree"}, {"document": "four five six seven eight nine"},
                                      {"document": "ten\n\neleven twelve"}], "max_new_tokens": 4})
    encode = str.split
    longer = bench.long_documents(spec, encode, "document", 6)
    assert [len(encode(row["document"])) >= 6 for row in longer.inputs] == [True] * 3
    assert longer.inputs[1]["document"] == spec.inputs[1]["document"]  # already long enough
    assert longer.inputs[0]["document"].startswith("one two\n\nthree\n\nfour five")
    with pytest.raises(ValueError, match="shorter than 100"):
        bench.long_documents(spec, encode, "document", 100)


@pytest.mark.slow
def test_tiny_run_end_to_end():
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_vllm.py"), "--rows", "2", "--passes", "2", "--min-document-tokens", "300",
         "--max-new-tokens", "2", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=1500,
        env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["rows"] == 2 and report["passes"] == 2
    assert min(report["document_tokens"]) >= 300
    check_pipeline_invariants(report["pipeline"], n_agents=4)
    assert report["pipeline"]["summary"]["calls"] == 2 * 2 * 4
    check_overhead_invariants(report["overhead"])
    assert set(report["overhead"]) == {"short", "document"}
    assert [o["samples"] for o in report["overhead"].values()] == [2, 2]  # two prompts of each kind, one repeat


def test_decode_report_gives_per_turn_ratios_and_cpu_per_token(bench):
    samples = {"plugin_free": [(2.0, 1.0, None, 100), (4.0, 1.2, None, 100), (1.0, 0.8, None, 100)],  # 50, 25, 100 tokens/s
               "plugin_opt_in": [(2.5, 1.1, 0.01, 100), (4.0, 1.2, 0.03, 100), (1.0, 0.9, 0.018, 90)]}  # 40, 25, 90 tokens/s
    report = bench.decode_report(samples)
    assert report["samples"] == 3 and report["generated"]["plugin_opt_in"] == [100, 100, 90]
    free, mine = report["engines"]["plugin_free"], report["engines"]["plugin_opt_in"]
    assert free["tokens_per_s_p50"] == 50 and mine["tokens_per_s_p50"] == 40
    assert free["cpu_ms_per_token_p50"] == pytest.approx(10.0) and mine["cpu_ms_per_token_p50"] == pytest.approx(11.0)
    assert mine["ratio"]["p50"] == pytest.approx(0.9) and (mine["ratio"]["min"], mine["ratio"]["max"]) == (0.8, 1.0)
    assert mine["ratio_of_medians"] == pytest.approx(0.8)  # not the per-turn median: the turns differ
    assert mine["cpu_ratio"]["p50"] == pytest.approx(1.1) and "ratio" not in free
    assert mine["kvcomm_cpu_ms_per_token"]["p50"] == pytest.approx(0.2) and "kvcomm_cpu_ms_per_token" not in free
    with pytest.raises(ValueError, match="one sample per turn"):
        bench.decode_report({"plugin_free": [(1.0, 1.0, None, 10)], "plugin_opt_in": []})


def test_a_baseline_tree_must_be_a_kvcomm_checkout_chosen_before_kvcomm_is_imported(bench, tmp_path):
    with pytest.raises(RuntimeError, match="imported before its checkout could be chosen"):
        bench.use_kvcomm_from(tmp_path)  # this process imported kvcomm already
    script = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import bench_vllm; "
              f"bench_vllm.use_kvcomm_from({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "is not a kvcomm checkout" in done.stderr, done.stderr[-2000:]
    copy = tmp_path / "copy"  # another checkout: this one's files, run from this checkout's folder
    shutil.copytree(BENCHMARKS.parent, copy, ignore=shutil.ignore_patterns(".venv", ".git", "docs", "tests", "__pycache__"))
    script = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import bench_vllm; "
              f"bench_vllm.use_kvcomm_from({str(copy)!r}); import kvcomm.integrations.vllm.connector.worker as w; print(w.__file__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent)
    assert done.returncode == 0 and done.stdout.strip() == str(copy / "integrations" / "vllm" / "connector" / "worker.py"), done.stderr[-2000:]


@pytest.mark.slow
def test_tiny_decode_run_with_a_baseline_tree():
    """``--decode`` with ``--baseline-tree`` (this checkout again): four engines take turns, each
    sample counted, every ratio within each turn."""
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_vllm.py"), "--decode", "--repeats", "2", "--decode-tokens", "8",
         "--baseline-tree", str(BENCHMARKS.parent)],
        capture_output=True, text=True, timeout=1500,
        env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout holds the result alone (the child engines log to stderr)
    assert set(report["engines"]) == {"plugin_free", "plugin_no_opt_in", "plugin_opt_in", "plugin_opt_in_baseline"}
    assert report["samples"] == 2 and all(n == [8, 8] for n in report["generated"].values()), report["generated"]
    for name, engine in report["engines"].items():
        assert engine["tokens_per_s_p50"] > 0 and engine["cpu_ms_per_token_p50"] > 0, name
        assert ("kvcomm_cpu_ms_per_token" in engine) == (name != "plugin_free"), name
        if name != "plugin_free":
            assert engine["ratio"]["min"] <= engine["ratio"]["p50"] <= engine["ratio"]["max"], name
