"""The quality budget in `kvcomm eval`: the model's first-token KL floor (eval/kl_floor.py),
cached; the guard on the anchor modes' runs and its cost in twins; whether kvcomm at its
defaults dominates realign and CacheBlend (eval/summary.py)."""

from __future__ import annotations

import json

import pytest

import kvcomm.eval.kl_floor as kl_floor_module
from kvcomm.eval.cli_eval import add_eval_parser, run_eval_command, settings_from_args
from kvcomm.eval.evaluate import POOLED, EvalSettings, evaluate
from kvcomm.eval.summary import aggregate, dominance
from kvcomm.services.quality_guard import QUALITY_BUDGET

from .test_evaluate import _inline_workload


def test_the_floor_is_read_from_its_cache_and_an_unreadable_cache_file_is_measured_again(tmp_path, monkeypatch):
    import kvcomm.integrations.runtimes as runtimes

    cached = tmp_path / "floor.json"
    monkeypatch.setattr(kl_floor_module, "cache_path", lambda *args: cached)

    def no_model(*args, **kwargs):
        raise RuntimeError("measuring: a model is loaded")

    monkeypatch.setattr(runtimes, "load_executor", no_model)
    cached.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "reference_dtype": "float32", "top_k": 20,
                                  "kl_mean": 2e-4, "kl_values": [1e-4, 3e-4], "measured_at": "2026-12-07T10:00:00Z"}))
    floor = kl_floor_module.kl_floor()
    assert floor.kl_mean == 2e-4 and floor.kl_values == (1e-4, 3e-4)
    assert floor.words() == "first-token KL floor 0.0002 nats (dense bfloat16 vs dense float32, 2 prompts)"
    cached.write_text('{"kl_mean": ')
    with pytest.raises(RuntimeError, match="measuring"):
        kl_floor_module.kl_floor()
    with pytest.raises(ValueError, match="no precision floor"):
        kl_floor_module.kl_floor(dtype="int8")


def test_an_executor_against_itself_has_a_zero_floor(tiny_executor):
    prompts = [tuple(tiny_executor.encode("The river Seine flows through Paris.")), (5, 6, 7, 8)]
    assert kl_floor_module.first_token_kls(tiny_executor, tiny_executor, prompts) == pytest.approx([0.0, 0.0], abs=1e-9)


def test_the_anchor_modes_run_under_the_budget_and_report_its_cost_in_twins(tiny_executor):
    settings = EvalSettings(modes=("realign", "cacheblend", "kvcomm"), kl_floor=1e-3, guard_fraction=1.0, timing_pass=False,
                            warm_up=False)
    result = evaluate(_inline_workload(3), tiny_executor, settings, progress=False)
    runs = {r.run.mode: r for r in result.runs}
    assert runs["realign"].guard is None and runs["cacheblend"].guard is None
    guard = runs["kvcomm"].guard
    reusing = sum(c.exact_tokens + c.estimated_tokens > c.exact_tokens for c in runs["kvcomm"].calls)
    assert guard["budget"] == pytest.approx(QUALITY_BUDGET * 1e-3) and guard["twins"] == reusing > 0  # fraction 1: every one
    rows = aggregate(result)
    ours = next(r for r in rows if r["mode"] == "kvcomm" and r["seed"] == POOLED)
    assert ours["guard_twins_per_100"] == pytest.approx(100 * guard["twins"] / ours["calls"])
    verdicts = {d["baseline"]: d for d in dominance(rows) if d["seed"] == POOLED}
    assert set(verdicts) == {"realign", "cacheblend"}
    for baseline, d in verdicts.items():
        theirs = next(r for r in rows if r["mode"] == baseline and r["seed"] == POOLED)
        loses = ((ours["token_reuse_rate"] < theirs["token_reuse_rate"]) or ours["kl_mean"] > theirs["kl_mean"]
                 or ours["kl_last_mean"] > theirs["kl_last_mean"])
        assert d["dominates"] is not loses and d["twins"] == guard["twins"]


def test_dominance_names_what_kvcomm_loses_on():
    base = {"gamma": None, "max_anchors": None, "scope": None, "seed": POOLED, "guard_twins": 3, "guard_twins_per_100": 25.0}
    ours = {**base, "mode": "kvcomm", "gamma": 1.0, "max_anchors": 20, "token_reuse_rate": 0.5, "kl_mean": 1e-3,
            "kl_last_mean": 2e-3}
    realign = {**base, "mode": "realign", "token_reuse_rate": 0.6, "kl_mean": 2e-3, "kl_last_mean": 1e-3}
    cacheblend = {**base, "mode": "cacheblend", "token_reuse_rate": 0.4, "kl_mean": 2e-3, "kl_last_mean": 3e-3}
    other_gamma = {**ours, "gamma": 0.5, "token_reuse_rate": 0.0}
    found = {d["baseline"]: d for d in dominance([ours, realign, cacheblend, other_gamma])}
    assert found["realign"]["loses"] == ["reuse", "first-token KL"] and not found["realign"]["dominates"]
    assert found["cacheblend"]["dominates"] and found["cacheblend"]["loses"] == []
    assert len(dominance([ours, realign, cacheblend, other_gamma])) == 2  # only kvcomm at its defaults is judged


def test_the_eval_command_measures_under_the_budget_by_default(tiny_executor, tmp_path, capsys, monkeypatch):
    import argparse

    cached = tmp_path / "floor.json"
    monkeypatch.setattr(kl_floor_module, "cache_path", lambda *args: cached)
    cached.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "reference_dtype": "float32", "top_k": 20,
                                  "kl_mean": 1e-4, "kl_values": [1e-4], "measured_at": "2026-12-07T10:00:00Z"}))
    parser = argparse.ArgumentParser(prog="kvcomm")
    add_eval_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--workload", "retrieval", "--limit", "2", "--agents", "1", "--out", str(tmp_path / "out"),
                              "--modes", "realign,kvcomm", "--max-new-tokens", "4", "--no-kl", "--no-progress", "--single-pass"])
    assert not hasattr(args, "quality_budget") and settings_from_args(args).quality_budget == QUALITY_BUDGET  # the default
    assert run_eval_command(args, executor=tiny_executor) == 0
    printed = capsys.readouterr().out
    assert "quality budget: 5 x first-token KL floor 0.0001 nats" in printed
    assert "kvcomm at its defaults" in printed and " realign: reuse " in printed and "dense twins in" in printed
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["settings"]["kl_floor"]["kl_mean"] == 1e-4 and data["dominance"][0]["baseline"] == "realign"
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["eval", "--workload", "retrieval", "--out", str(tmp_path / "x"), "--quality-budget", bad])
