"""`kvcomm eval`: metric functions, argument checks, and a tiny end-to-end evaluation."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
from dataclasses import dataclass

import pytest
import torch

from kvcomm.eval.cli_eval import add_eval_parser, run_eval_command
from kvcomm.eval.evaluate import ALL_MODES, POOLED, EvalSettings, evaluate
from kvcomm.core.divergence import TopK, kl_topk_other, top1_matches, topk_reference
from kvcomm.eval.metrics import percentile, wilson_interval
from kvcomm.eval.outputs import check_out_dir, format_table, write_outputs
from kvcomm.eval.summary import aggregate
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.scopes import SCOPES

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is several times faster than two on a busy machine
    (no spin-waiting); restored afterwards for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PNGS = ("accuracy_vs_reuse.png", "kl_vs_reuse.png", "ttft_by_agent.png")
RATES = ("token_reuse_rate", "exact_token_rate", "estimated_token_rate", "agent_reuse_rate", "fallback_rate",
         "reply_agreement", "top1_agreement", "noise_top1_agreement", "accuracy", "accuracy_ci_low", "accuracy_ci_high",
         "timing_consistent_rate")


# -- metric functions ------------------------------------------------------------------------


def _lp(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64)).float()


def test_kl_topk_other_on_hand_made_distributions():
    p = [0.5, 0.3, 0.1, 0.1]
    q = [0.25, 0.25, 0.25, 0.25]
    ref = topk_reference(_lp(p), k=2)
    assert ref.ids[0].tolist() == [0, 1]
    assert math.isclose(float(ref.log_other[0].exp()), 0.2, rel_tol=1e-6)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    got = float(kl_topk_other(ref, _lp(q))[0])
    assert math.isclose(got, expected, rel_tol=1e-5)
    full = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert got <= full + 1e-6  # a lower bound (inputs are float32)
    # k covering the vocabulary gives the full KL
    assert math.isclose(float(kl_topk_other(topk_reference(_lp(p), k=4), _lp(q))[0]), full, rel_tol=1e-5)
    # identical distributions: exactly 0; several positions at once
    both = _lp(p, q)
    kl = kl_topk_other(topk_reference(both, k=2), both)
    assert kl.shape == (2,) and torch.all(kl == 0)


def test_kl_is_asymmetric_and_other_bucket_counts():
    p = [0.7, 0.15, 0.1, 0.05]
    q = [0.7, 0.28, 0.01, 0.01]  # same top-1 mass, the rest moved from outside the top-2 into it
    kl = float(kl_topk_other(topk_reference(_lp(p), k=2), _lp(q))[0])
    expected = 0.15 * math.log(0.15 / 0.28) + 0.15 * math.log(0.15 / 0.02)
    assert math.isclose(kl, expected, rel_tol=1e-5)
    reverse = float(kl_topk_other(topk_reference(_lp(q), k=2), _lp(p))[0])
    assert not math.isclose(kl, reverse, rel_tol=1e-3)


def test_top1_matches_and_topk_tail():
    ref = topk_reference(_lp([0.6, 0.2, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]), k=2)
    other = _lp([0.5, 0.4, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8])
    assert top1_matches(ref, other).tolist() == [True, False, True]
    tail = ref.tail(2)
    assert isinstance(tail, TopK) and len(tail) == 2 and tail.top1.tolist() == [1, 2]
    with pytest.raises(ValueError):
        kl_topk_other(tail, other)


def test_wilson_interval_known_values():
    low, high = wilson_interval(5, 10)
    assert math.isclose(low, 0.2366, abs_tol=1e-4) and math.isclose(high, 0.7634, abs_tol=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0 and math.isclose(high, 0.2775, abs_tol=1e-4)
    low, high = wilson_interval(10, 10)
    assert math.isclose(low, 0.7225, abs_tol=1e-4) and high == 1
    low, high = wilson_interval(81, 263)  # Wilson (1927) style example: 0.3080 [0.2553, 0.3662]
    assert math.isclose(low, 0.2553, abs_tol=1e-3) and math.isclose(high, 0.3662, abs_tol=1e-3)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isclose(percentile(list(map(float, range(101))), 95), 95.0)


# -- arguments --------------------------------------------------------------------------------


def _parser():
    parser = argparse.ArgumentParser(prog="kvcomm")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("argv, message", [
    (["--modes", "dense,fast"], "unknown mode 'fast'"),
    (["--modes", ""], "no empty items"),
    (["--modes", "kvcomm,,exact"], "no empty items"),
    (["--gammas", "0.3,abc"], "not a number"),
    (["--gammas", "-1"], ">= 0"),
    (["--max-anchors", "0"], ">= 1"),
    (["--seeds", "1.5"], "not an integer"),
    (["--recompute-ratio", "1.5"], "(0, 1]"),
    (["--limit", "0"], ">= 1"),
    (["--agents", "x"], "not an integer"),
    (["--backend", "tgi"], "invalid choice"),
    (["--base-source", "prefill"], "invalid choice"),
    (["--reuse-scope", "all,none"], "unknown reuse scope 'none'"),
    (["--reuse-scope", "all,all"], "a reuse scope is listed twice"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["eval", "--workload", "retrieval", "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_lists_parse(tmp_path):
    args = _parser().parse_args(["eval", "--workload", "gsm", "--out", str(tmp_path), "--gammas", "0.3,0.6",
                                 "--max-anchors", "5,20", "--seeds", "0,1", "--modes", "kvcomm,dense"])
    assert args.modes == ("kvcomm", "dense") and args.gammas == (0.3, 0.6) and args.max_anchors == (5, 20)
    assert args.seeds == (0, 1) and args.backend == "transformers" and args.agents == 3
    defaults = _parser().parse_args(["eval", "--workload", "gsm", "--out", str(tmp_path)])
    assert defaults.modes == ALL_MODES and defaults.recompute_ratio == 0.15


def test_unwritable_out_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        check_out_dir(blocker)
    with pytest.raises(ValueError, match="not writable"):
        check_out_dir(blocker / "sub")
    args = _parser().parse_args(["eval", "--workload", "retrieval", "--out", str(blocker / "sub")])
    assert run_eval_command(args) == 2
    assert "not writable" in capsys.readouterr().err


def test_settings_validation():
    with pytest.raises(ValueError, match="modes is empty"):
        EvalSettings(modes=())
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        EvalSettings(modes=("fast",))
    settings = EvalSettings(gammas=(0.3, 0.6), max_anchors=(4, 20))
    runs = settings.runs()
    assert [r.mode for r in runs] == ["exact", "realign", "cacheblend"] + ["kvcomm"] * 4 + ["kvblend"] * 4
    grid = {"gamma=0.3,V=4", "gamma=0.3,V=20", "gamma=0.6,V=4", "gamma=0.6,V=20"}
    assert {r.setting for r in runs if r.mode == "kvcomm"} == {r.setting for r in runs if r.mode == "kvblend"} == grid
    blend = settings.config(runs[-1])
    assert blend.mode == "kvblend" and blend.recompute_ratio == settings.recompute_ratio and blend.pool.gamma == 0.6
    assert {settings.config(r).base_source for r in runs} == {"first_use"}
    assert EvalSettings(base_source="standalone").config(runs[0]).base_source == "standalone"
    with pytest.raises(ValueError, match="unknown base_source 'prefill'"):
        EvalSettings(base_source="prefill")


# -- end to end on a tiny random model ------------------------------------------------------------


DOCS = [
    ("The river Seine flows through Paris and into the English Channel.", "Seine"),
    ("Mount Fuji is the highest mountain in Japan, near Tokyo.", "Fuji"),
    ("The Nile is a long river in Africa that flows north into the sea.", "Nile"),
    ("Bananas are yellow fruits that grow in warm countries.", "Bananas"),
]


@dataclass
class InlineWorkload:
    """A workload-shaped object: name, pipeline, references, score(row, reply)."""

    name: str
    pipeline: object
    references: tuple[str, ...]

    def score(self, row: int, reply: str) -> float:
        return float(self.references[row].lower() in reply.lower())


def _inline_workload(rows: int = 4, max_new_tokens: int = 6) -> InlineWorkload:
    spec = parse_pipeline({
        "agents": [
            {"name": "reader", "system": "You read carefully.", "template": "Task: {task}\nSummarize the text."},
            {"name": "checker", "system": "You check facts.", "template": "Task: {task}\nSummary: {reader}\nCheck it."},
            {"name": "decider", "system": "You answer.", "template": "Task: {task}\nCheck: {checker}\nName the subject."},
        ],
        "inputs": [{"task": doc} for doc, _ in DOCS[:rows]],
        "max_new_tokens": max_new_tokens,
    })
    return InlineWorkload("inline", spec, tuple(ref for _, ref in DOCS[:rows]))


def _check_result_files(out, data_expect_modes):
    for name in ("results.json", "results.csv", *PNGS):
        assert (out / name).exists() and (out / name).stat().st_size > 0, name
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(data["aggregates"])
    assert {r["mode"] for r in data["aggregates"]} == set(data_expect_modes)
    return data, rows


def _check_sane(data, kl=True):
    for call in data["calls"]:
        assert call["exact_tokens"] + call["estimated_tokens"] + call["computed_tokens"] == call["prompt_tokens"]
        assert call["ttft_s"] > 0
        assert (call["score"] is not None) == (call["agent"] == data["settings"]["decider"])
        if kl:
            reuse_end = call["prompt_tokens"] - call["computed_tokens"] + call["recomputed_tokens"]
            assert call["kl_positions"] == call["prompt_tokens"] - reuse_end >= 1
            assert 0 <= call["top1_matches"] <= call["kl_positions"] and call["kl_sum"] >= 0
            assert call["noise_top1_matches"] <= call["kl_positions"] and call["noise_kl_sum"] >= 0
            assert call["timing_consistent"] is True
    for agg in data["aggregates"]:
        for key in RATES:
            assert agg[key] is None or 0 <= agg[key] <= 1, (agg["mode"], key, agg[key])
        assert agg["exact_tokens"] + agg["estimated_tokens"] + agg["computed_tokens"] == agg["prompt_tokens"]
        assert agg["accuracy_ci_low"] <= agg["accuracy"] <= agg["accuracy_ci_high"]
        assert agg["pool_bytes"] >= 0
        assert len(agg["ttft_by_position"]) == len(data["settings"]["agents"])
        if kl:
            assert agg["kl_mean"] >= 0 and agg["noise_kl_mean"] >= 0 and agg["timing_consistent_rate"] == 1
        else:
            assert agg["kl_mean"] is None and agg["timing_consistent_rate"] is None
        if agg["mode"] == "dense":
            assert agg["reply_agreement"] == 1 and agg["token_reuse_rate"] == 0 and agg["pool_bytes"] == 0
            if kl:  # dense vs a teacher-forced dense prefill of the same prompt
                assert agg["kl_mean"] < 1e-9 and agg["top1_agreement"] == 1
        if agg["mode"] in ("exact", "dense"):
            assert agg["estimated_tokens"] == 0


def test_end_to_end_inline_all_modes(tiny_executor, tmp_path):
    workload = _inline_workload(rows=3, max_new_tokens=4)
    settings = EvalSettings(gammas=(0.3, 5.0), max_anchors=(20,), seeds=(0,))
    result = evaluate(workload, tiny_executor, settings, progress=False)
    files = write_outputs(result, tmp_path)
    assert set(files) == {"json", "csv", "accuracy_vs_reuse", "kl_vs_reuse", "ttft_by_agent"}
    data, rows = _check_result_files(tmp_path, ALL_MODES)
    _check_sane(data)
    # dense + exact + realign + cacheblend + 2 kvcomm + 2 kvblend settings, 3 rows x 3 agents each
    assert len(data["calls"]) == 8 * 3 * 3
    assert len(data["aggregates"]) == 8 * 2  # the seed and pooled
    pooled = {(a["mode"], a["setting"]): a for a in data["aggregates"] if a["seed"] == POOLED}
    assert pooled[("realign", "")]["estimated_tokens"] > 0  # realignment reuses shared content
    assert pooled[("cacheblend", "")]["recomputed_tokens"] > 0
    assert pooled[("kvcomm", "gamma=5,V=20")]["pool_bytes"] > 0
    blend = pooled[("kvblend", "gamma=5,V=20")]
    assert blend["pool_bytes"] > 0 and blend["recomputed_tokens"] > 0  # anchors estimate, then recompute
    assert pooled[("exact", "")]["kl_mean"] <= 1e-6  # exact reuse is dense up to rounding
    assert pooled[("dense", "")]["calls"] == 9
    assert data["settings"]["ttft_source"].startswith("separate timing pass")
    table = format_table(result)
    assert "kvcomm" in table and "gamma=0.3,V=20" in table and "noise" in table


def test_seeds_shuffle_the_order_and_pool(tiny_executor, tmp_path):
    workload = _inline_workload(rows=3, max_new_tokens=4)
    settings = EvalSettings(modes=("kvcomm",), gammas=(5.0,), seeds=(0, 1))
    result = evaluate(workload, tiny_executor, settings, progress=False, kl=False)
    write_outputs(result, tmp_path)
    data, rows = _check_result_files(tmp_path, ("dense", "kvcomm"))  # dense always runs, as the reference
    _check_sane(data, kl=False)
    orders = {seed: [c["input_index"] for c in data["calls"] if c["seed"] == seed and c["mode"] == "dense" and c["agent"] == "reader"]
              for seed in (0, 1)}
    assert sorted(orders[0]) == sorted(orders[1]) == [0, 1, 2] and orders[0] != orders[1]
    assert [r["seed"] for r in rows] == ["0", "1", "pooled", "0", "1", "pooled"]
    by_seed = {(a["mode"], a["seed"]): a for a in data["aggregates"]}
    assert by_seed[("kvcomm", POOLED)]["calls"] == by_seed[("kvcomm", 0)]["calls"] + by_seed[("kvcomm", 1)]["calls"] == 18
    assert by_seed[("kvcomm", POOLED)]["pool_bytes"] == (by_seed[("kvcomm", 0)]["pool_bytes"] + by_seed[("kvcomm", 1)]["pool_bytes"]) / 2


def test_eval_command_on_the_retrieval_workload(tiny_executor, tmp_path, capsys):
    parser = _parser()
    args = parser.parse_args(["eval", "--workload", "retrieval", "--limit", "2", "--agents", "1", "--out", str(tmp_path / "out"),
                              "--gammas", "0.3,0.6", "--max-new-tokens", "4", "--no-kl", "--no-progress",
                              "--quality-budget", "off"])
    assert run_eval_command(args, executor=tiny_executor) == 0
    printed = capsys.readouterr().out
    assert "acc [95% CI]" in printed and "wrote results.json" in printed
    data, _ = _check_result_files(tmp_path / "out", ALL_MODES)
    _check_sane(data, kl=False)
    assert data["workload"] == "retrieval" and data["settings"]["rows"] == 2
    assert data["settings"]["agents"] == ["agent1", "decider"]
    assert len(data["calls"]) == (1 + 3 + 2 + 2) * 2 * 2  # dense, exact/realign/cacheblend, 2 kvcomm, 2 kvblend


def _tensor_bytes(engine) -> int:
    """Bytes of every tensor storage the engine's anchor pools hold (bases and deviations),
    counted by walking the anchors' fields, each storage once (a view counts as its storage)."""
    storages: dict[int, int] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    for pool in engine.pools.values():
        for anchor in pool.anchors:
            walk(anchor)
    return sum(storages.values())


@pytest.mark.slow
def test_end_to_end_on_smollm2_has_checks_that_can_fail(smol_executor):
    """The embedded model answers some rows right, so accuracy, KL and pool size carry
    information (the tiny random model scores 0 everywhere): dense is right on some rows,
    kvcomm reuses and is still right on some of them, its KL is far above the dense-vs-dense
    noise floor, and the reported pool bytes are the bytes of the tensors the pools hold."""
    from kvcomm.reuse.engine import ReuseEngine

    engines: list[ReuseEngine] = []

    def factory(rotary, config):
        engines.append(ReuseEngine(rotary, config))
        return engines[-1]

    workload = _inline_workload(rows=3, max_new_tokens=8)
    settings = EvalSettings(modes=("dense", "kvcomm"), gammas=(1.0,), seeds=(0,), timing_pass=False, warm_up=False)
    result = evaluate(workload, smol_executor, settings, progress=False, engine_factory=factory)
    calls = [c for run in result.runs for c in run.calls]
    scores = {(c.mode, c.input_index): c.score for c in calls if c.score is not None}
    right = {row for (mode, row), score in scores.items() if mode == "dense" and score == 1.0}
    print(f"\nSmolLM2 eval: decider scores {scores}; " + format_table(result).splitlines()[2])
    assert right, "dense SmolLM2 named no subject right"
    assert any(scores[("kvcomm", row)] == 1.0 for row in right), "kvcomm was right on no row dense got right"
    pooled = {a["mode"]: a for a in aggregate(result) if a["seed"] == POOLED}
    assert pooled["kvcomm"]["estimated_tokens"] > 0 and 0 < pooled["dense"]["accuracy"]
    # the reported numbers: the approximation's KL is visible far above the noise floor
    kl, noise = pooled["kvcomm"]["kl_mean"], pooled["kvcomm"]["noise_kl_mean"]
    assert 0 <= noise < kl / 100, (noise, kl)
    (run,) = [r for r in result.runs if r.run.mode == "kvcomm"]
    (engine,) = engines
    assert run.pool_bytes == pooled["kvcomm"]["pool_bytes"] == _tensor_bytes(engine) > 0
    assert run.anchors == {slot: len(pool) for slot, pool in engine.pools.items()}


def test_json_has_no_nan_or_infinity_and_rows_without_reference_score_none():
    from kvcomm.eval.evaluate import _score
    from kvcomm.eval.outputs import _finite

    assert _finite({"a": [math.inf, -math.inf, math.nan, 1.5], "b": (2,)}) == {"a": ["inf", "-inf", None, 1.5], "b": [2]}
    workload = InlineWorkload("inline", None, ("Seine", None))
    assert _score(workload, 0, "the seine") == 1.0 and _score(workload, 1, "anything") is None


def test_pool_settings_reach_the_kvcomm_runs_and_bad_ones_are_refused():
    """``--pool NAME=VALUE`` (JSON values) sets further PoolConfig fields of every kvcomm run."""
    parser = _parser()
    args = parser.parse_args(["eval", "--workload", "mmlu", "--out", "x", "--pool", "shrinkage=false",
                              "--pool", "min_coverage=0.25", "--pool", "max_candidates=4"])
    from kvcomm.eval.cli_eval import settings_from_args

    settings = settings_from_args(args)
    pool = settings.config(settings.runs()[-1]).pool
    assert (pool.shrinkage, pool.min_coverage, pool.max_candidates) == (False, 0.25, 4)
    with pytest.raises(ValueError, match="unknown pool setting 'shrink'"):
        EvalSettings(pool=(("shrink", False),))
    with pytest.raises(ValueError, match="unknown pool setting 'admission_distance'"):  # a removed variant
        EvalSettings(pool=(("admission_distance", "l2"),))
    with pytest.raises(ValueError, match="min_coverage must be in"):
        EvalSettings(pool=(("min_coverage", 2.0),))
    with pytest.raises(ValueError, match="unknown pool setting 'gamma'"):  # gamma has its own grid (--gammas)
        EvalSettings(pool=(("gamma", 0.5),))
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--workload", "mmlu", "--out", "x", "--pool", "shrinkage"])


def test_reuse_scopes_run_every_reuse_mode_once_each_and_name_their_runs():
    args = _parser().parse_args(["eval", "--workload", "mmlu", "--out", "x", "--modes", "realign,kvcomm",
                                 "--reuse-scope", "all,content"])
    from kvcomm.eval.cli_eval import settings_from_args

    settings = settings_from_args(args)
    runs = settings.runs()
    assert [r.setting for r in runs] == ["scope=all", "scope=content", "gamma=1,V=20,scope=all", "gamma=1,V=20,scope=content"]
    configs = [settings.config(r) for r in runs]
    assert [(c.mode, c.scope) for c in configs] == [("realign", "all"), ("realign", "content"), ("kvcomm", "all"), ("kvcomm", "content")]
    scopes = [SCOPES[c.scope] for c in configs]
    assert [(s.compute_trailing_text, s.decode_reply_bases) for s in scopes] == [(False, True), (True, True)] * 2
    # the default scope alone names nothing: results of earlier versions keep their settings
    assert [r.setting for r in EvalSettings(modes=("realign", "kvcomm")).runs()] == ["", "gamma=1,V=20"]
    assert [r.setting for r in EvalSettings(modes=("realign",), scopes=("content",)).runs()] == ["scope=content"]
    assert [r.setting for r in EvalSettings(modes=("realign",), scopes=("all",)).runs()] == ["scope=all"]  # no longer the default
    with pytest.raises(ValueError, match="scopes must be distinct reuse scopes"):
        EvalSettings(scopes=("everything",))


def test_scopes_share_one_dense_reference_and_the_narrower_scope_computes_more(tiny_executor, tmp_path):
    workload = _inline_workload(rows=3, max_new_tokens=4)
    settings = EvalSettings(modes=("realign",), scopes=("all", "content"))
    result = evaluate(workload, tiny_executor, settings, progress=False)
    write_outputs(result, tmp_path)
    data, rows = _check_result_files(tmp_path, ("dense", "realign"))
    _check_sane(data)
    assert len(data["calls"]) == 3 * 3 * 3  # dense once, realign once per scope
    pooled = {a["setting"]: a for a in data["aggregates"] if a["seed"] == POOLED}
    assert set(pooled) == {"", "scope=all", "scope=content"} and pooled["scope=content"]["scope"] == "content"
    # content computes the template text after the shared content, which all serves from stored KV
    assert pooled["scope=content"]["token_reuse_rate"] < pooled["scope=all"]["token_reuse_rate"]
    assert {r["scope"] for r in rows} == {"", "all", "content"}
    from kvcomm.eval.frontier import load_results

    points, _ = load_results([tmp_path])
    positions = {p.label: p.computed_positions for p in points}
    assert positions["realign scope=all"] != positions["realign scope=content"]


def test_the_embedder_setting_reaches_every_reuse_engine(tiny_executor, monkeypatch):
    """``--embedder minilm``: every engine of the run narrows by MiniLM vectors of the segment's
    text (384 dims, the one sentence model loaded once); ``kv`` keeps pooled base values."""
    import numpy as np

    import kvcomm.eval.evaluate as evaluate_module
    from kvcomm.reuse.engine import ReuseEngine
    from kvcomm.integrations.transformers.sentence_embedder import SentenceEmbedder

    made = []

    class Recording(ReuseEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(evaluate_module, "ReuseEngine", Recording)
    workload = _inline_workload(rows=3, max_new_tokens=4)
    for embedder in ("minilm", "kv"):
        made.clear()
        evaluate(workload, tiny_executor, EvalSettings(modes=("kvcomm", "realign"), gammas=(5.0,), embedder=embedder),
                 progress=False, kl=False)
        assert len(made) == 2  # one engine per reuse run
        anchors = [a for engine in made for pool in engine.pools.values() for a in pool.anchors]
        assert anchors, "gamma 5 admits every dense segment"
        for anchor in anchors:
            assert np.isclose(np.linalg.norm(anchor.embedding), 1.0, atol=1e-5)
            keys = anchor.base.keys
            assert anchor.embedding.shape == ((384,) if embedder == "minilm" else (keys.shape[0] * keys.shape[1] * keys.shape[3],))
        if embedder == "minilm":
            assert {type(engine.embedder) for engine in made} == {SentenceEmbedder}
            assert len({id(engine.embedder) for engine in made}) == 1  # the sentence model is loaded once
    with pytest.raises(ValueError, match="unknown embedder 'bert'; valid: kv, minilm"):
        EvalSettings(embedder="bert")
    assert _parser().parse_args(["eval", "--workload", "mmlu", "--out", "x", "--embedder", "minilm"]).embedder == "minilm"


def test_warm_rows_calibrate_every_reuse_engine_and_are_not_evaluated(tiny_executor):
    """``warm_rows``: the workload's last rows are run densely into every fresh reuse engine
    (learned from, anchors recorded in every slot) and left out of the results; the evaluated
    rows and their order are those of the cold run, and they meet fuller pools."""
    workload = _inline_workload(rows=4, max_new_tokens=4)
    settings = dict(modes=("kvcomm", "realign"), gammas=(1.0,))
    cold = evaluate(_inline_workload(rows=2, max_new_tokens=4), tiny_executor, EvalSettings(**settings), progress=False, kl=False)
    warm = evaluate(workload, tiny_executor, EvalSettings(**settings, warm_rows=2), progress=False, kl=False)
    assert warm.rows == cold.rows == 2
    for result in (cold, warm):
        assert {c.input_index for run in result.runs for c in run.calls} == {0, 1}
    order = lambda result: [c.input_index for c in result.runs[0].calls if c.agent == "reader"]  # noqa: E731
    assert order(warm) == order(cold)
    dense = lambda result: [c.reply for c in result.runs[0].calls]  # noqa: E731
    assert dense(warm) == dense(cold)  # the dense reference is untouched by calibration
    kvcomm = {run.run.mode: run for run in warm.runs}["kvcomm"], {run.run.mode: run for run in cold.runs}["kvcomm"]
    first = order(cold)[0]
    estimated = lambda run: [c.estimated_tokens for c in run.calls if c.input_index == first]  # noqa: E731
    assert estimated(kvcomm[1]) == [0, 0, 0]  # cold: the first row teaches the empty pools
    assert estimated(kvcomm[0])[0] == 0 and min(estimated(kvcomm[0])[1:]) > 0  # warm: estimated at once
    assert sum(c.estimated_tokens for c in kvcomm[0].calls) > sum(c.estimated_tokens for c in kvcomm[1].calls)
    with pytest.raises(ValueError, match="warm_rows 4 leaves none of the workload's 4 rows"):
        evaluate(workload, tiny_executor, EvalSettings(**settings, warm_rows=4), progress=False, kl=False)
    with pytest.raises(ValueError, match="warm_rows must be an integer >= 0"):
        EvalSettings(warm_rows=-1)


def test_warm_items_load_the_items_after_the_limit(tiny_executor, tmp_path, capsys):
    parser = _parser()
    argv = ["eval", "--workload", "retrieval", "--limit", "2", "--agents", "1", "--modes", "kvcomm", "--max-new-tokens", "2",
            "--no-kl", "--no-progress", "--single-pass"]
    assert run_eval_command(parser.parse_args([*argv, "--out", str(tmp_path / "warm"), "--warm-items", "3"]), executor=tiny_executor) == 0
    data = json.loads((tmp_path / "warm" / "results.json").read_text())
    assert data["settings"]["rows"] == 2 and data["settings"]["warm_rows"] == 3 and data["settings"]["warm_items"] == 3
    assert {c["input_index"] for c in data["calls"]} == {0, 1}
    capsys.readouterr()
    too_many = parser.parse_args(["eval", "--workload", "humaneval", "--limit", "164", "--warm-items", "1", "--out", str(tmp_path / "x")])
    assert run_eval_command(too_many, executor=tiny_executor) == 2  # HumanEval has 164 problems
    assert "the workload has 164 items: --limit 164 plus --warm-items 1 needs 165" in capsys.readouterr().err
