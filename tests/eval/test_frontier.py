"""The KL-vs-reuse frontier report (kvcomm.eval.frontier) over result folders."""

import dataclasses
import json

import matplotlib.pyplot as plt
import pytest

from kvcomm.eval.frontier import figure, load_results, main, markdown, on_frontier, plot


def _row(mode, setting, reuse, kl, seed="pooled", kl_last=None):
    return {"mode": mode, "setting": setting, "seed": seed, "token_reuse_rate": reuse, "exact_token_rate": 0.0,
            "estimated_token_rate": reuse, "kl_mean": kl, "kl_last_mean": 10 * kl if kl_last is None else kl_last,
            "top1_agreement": 1.0 - kl, "reply_agreement": 0.5,
            "accuracy": 0.5, "accuracy_ci_low": 0.3, "accuracy_ci_high": 0.7, "noise_kl_mean": 1e-12, "calls": 12}


def _write(folder, workload, rows, **settings):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"workload": workload, "settings": settings, "aggregates": rows}))
    return folder


def test_frontier_marks_only_undominated_points_and_labels_differing_runs(tmp_path):
    a = _write(tmp_path / "a", "mmlu", [
        _row("dense", "", 0.0, 0.0), _row("realign", "", 0.9, 1e-3), _row("kvcomm", "gamma=0.3", 0.5, 2e-3),
        _row("kvcomm", "gamma=0.3", 0.1, 9.0, seed=0),  # per-seed rows are not points
    ], base_source="standalone", dtype_noise_floor={"dtype": "bfloat16", "reference_dtype": "float32",
                                                    "kl_mean": 1e-3, "kl_median": 6e-4, "same_top1": 0.979})
    b = _write(tmp_path / "b", "mmlu", [_row("dense", "", 0.0, 0.0), _row("kvcomm", "gamma=0.3", 0.95, 5e-4)],
               base_source="first_use")
    points, floors = load_results([a, b / "results.json"])
    labels = [p.label for p in points]
    assert labels == ["dense", "realign (base source standalone)", "kvcomm gamma=0.3 (base source standalone)", "kvcomm gamma=0.3 (base source first_use)"]
    frontier = {p.label for p in points if on_frontier(p, points)}
    # first_use kvcomm reuses more at a lower KL than realign and the standalone run: only it and dense remain
    assert frontier == {"dense", "kvcomm gamma=0.3 (base source first_use)"}
    assert floors[0].top1 == pytest.approx(0.979)
    text = markdown(points, floors)
    assert "bfloat16 vs float32 floor: KL mean 1.0e-03" in text
    assert text.count("| yes / yes |") == 2 and text.count("| - / - |") == 2


def test_runs_differing_by_embedder_are_labelled_and_an_older_result_counts_as_kv(tmp_path):
    old = _write(tmp_path / "old", "mmlu", [_row("dense", "", 0.0, 0.0), _row("realign", "", 0.9, 1e-3)])  # no embedder
    kv = _write(tmp_path / "kv", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.5, 2e-3)], embedder="kv")
    text = _write(tmp_path / "text", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.5, 1e-3)], embedder="minilm")
    assert [p.label for p in load_results([old, kv])[0]] == ["dense", "realign", "kvcomm gamma=1,V=20"]
    # the embedder changes anchor pools only: realign's label leaves it out
    assert [p.label for p in load_results([old, kv, text])[0]] == [
        "dense", "realign", "kvcomm gamma=1,V=20 (embedder kv)", "kvcomm gamma=1,V=20 (embedder minilm)"]


def test_frontier_command_writes_table_and_chart(tmp_path, capsys):
    a = _write(tmp_path / "a", "gsm", [_row("dense", "", 0.0, 0.0), _row("realign", "", 0.8, 1e-2)])
    assert main([str(a), "--out", str(tmp_path / "fr")]) == 0
    assert (tmp_path / "fr" / "frontier.png").stat().st_size > 1000
    assert "### gsm" in (tmp_path / "fr" / "frontier.md").read_text()


def test_frontier_refuses_a_folder_without_results(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvcomm eval --out"):
        load_results([tmp_path])


def test_equal_reuse_at_higher_kl_is_dominated_and_workloads_never_mix(tmp_path):
    a = _write(tmp_path / "a", "mmlu", [_row("realign", "", 0.9, 1e-3), _row("cacheblend", "r=0.15", 0.9, 2e-3)])
    b = _write(tmp_path / "b", "gsm", [_row("realign", "", 0.95, 1e-4)])
    points, _ = load_results([a, b])
    assert [on_frontier(p, points) for p in points] == [True, False, True]


def test_kvcomm_frontier_command(tmp_path, capsys):
    from kvcomm.cli import main as cli

    a = _write(tmp_path / "a", "humaneval", [_row("dense", "", 0.0, 0.0), _row("kvcomm", "gamma=1,V=20", 0.6, 1e-3)])
    assert cli(["frontier", str(a), "--out", str(tmp_path / "fr")]) == 0
    assert "### humaneval" in capsys.readouterr().out and (tmp_path / "fr" / "frontier.png").exists()


def _call(mode, setting, input_index, kl_sum, positions, seed=0, kl_last=None):
    return {"seed": seed, "mode": mode, "setting": setting, "input_index": input_index, "kl_sum": kl_sum,
            "kl_positions": positions, "kl_last": kl_sum / positions if kl_last is None else kl_last}


def test_kl_interval_resamples_inputs_over_every_call_and_seed_of_each(tmp_path):
    # input 0: KL 0 over 4 positions (two calls, two seeds); input 1: KL 4 over 4 (its seed-1 call
    # holds it all): mean 0.5, and a resampled pair of inputs gives 0, 0.5 or 1 (resampling calls
    # instead would reach 2, the seed-1 call's own ratio)
    calls = [_call("realign", "", 0, 0.0, 2), _call("realign", "", 0, 0.0, 2, seed=1), _call("realign", "", 1, 0.0, 2),
             _call("realign", "", 1, 4.0, 2, seed=1), _call("kvcomm", "gamma=1,V=20", 0, 9.0, 1)]
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"workload": "mmlu", "settings": {}, "calls": calls, "aggregates": [
        _row("realign", "", 0.9, 0.5, kl_last=0.5), _row("kvcomm", "gamma=1,V=20", 0.5, 9.0, kl_last=9.0), _row("cacheblend", "r=0.15", 0.6, 1e-3)]}))
    points, _ = load_results([folder])
    realign, kvcomm, cacheblend = points
    assert realign.kl_ci == (0.0, 1.0)
    assert realign.kl_last_ci == (0.0, 1.0)  # first-token KL 0, 0 | 0, 2 per input: means 0 and 1 over calls
    assert kvcomm.kl_ci == pytest.approx((9.0, 9.0))  # one input: no spread
    assert cacheblend.kl_ci is None and cacheblend.kl_last_ci is None  # no calls of its own
    text = markdown(points, [])
    assert "| 5.00e-01 [0.0e+00, 1.0e+00] | 5.00e-01 [0.0e+00, 1.0e+00] |" in text and "| 1.00e-03 | 1.00e-02 |" in text
    plot(points, [], tmp_path / "f.png")


def test_first_token_kl_has_its_own_frontier(tmp_path):
    # realign reuses more at a lower KL mean, but its first reply token is further from dense's
    a = _write(tmp_path / "a", "mmlu", [_row("realign", "", 0.9, 1e-3, kl_last=5e-2), _row("kvcomm", "gamma=1", 0.8, 2e-3, kl_last=1e-2)])
    points, _ = load_results([a])
    realign, kvcomm = points
    assert [on_frontier(p, points) for p in points] == [True, False]
    assert [on_frontier(p, points, "kl_last_mean") for p in points] == [True, True]
    assert "| yes / yes |" in markdown(points, []) and "| - / yes |" in markdown(points, [])


def test_runs_of_a_reuse_scope_are_named_by_it_and_their_kl_means_flagged_as_not_comparable(tmp_path):
    # ``reuse`` overrides: results written before scopes were presets (`kvcomm eval --reuse`
    # set their fields one by one, and other fields since removed); the chart still reads them
    inputs = [["compute_trailing_text", True], ["decode_reply_bases", False], ["anchor_dtype", None]]
    a = _write(tmp_path / "a", "mmlu", [_row("dense", "", 0.0, 0.0), _row("kvcomm", "gamma=1,V=20", 0.75, 4e-3)])
    b = _write(tmp_path / "b", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.65, 1e-2)], reuse=[["compute_trailing_text", True]])
    c = _write(tmp_path / "c", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.5, 7e-4)], reuse=inputs)
    points, _ = load_results([a, b, c])
    assert [p.label for p in points] == [
        "dense", "kvcomm gamma=1,V=20 (reuse default)", "kvcomm gamma=1,V=20 (reuse scope content)",
        "kvcomm gamma=1,V=20 (reuse scope inputs anchor_dtype=None)"]
    assert "compare them by first-token KL" in markdown(points, [])
    replies = [["compute_trailing_text", True], ["decode_reply_bases", False], ["bases_after_estimates", True]]
    e = _write(tmp_path / "e", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.6, 9e-4)], reuse=replies)
    assert load_results([a, e])[0][-1].label == "kvcomm gamma=1,V=20 (reuse scope reader-replies)"  # not inputs'
    served = _write(tmp_path / "f", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.7, 3e-3)], reuse=replies[1:])
    assert load_results([a, served])[0][-1].label == "kvcomm gamma=1,V=20 (reuse scope all-reader-replies)"
    # a run of `kvcomm eval --reuse-scope` names its scope in its setting, not as a --reuse default
    row = {**_row("kvcomm", "gamma=1,V=20,scope=inputs", 0.5, 7e-4), "scope": "inputs"}
    named = _write(tmp_path / "g", "mmlu", [row], scopes=["all", "inputs"])
    assert load_results([b, named])[0][-1].label == "kvcomm gamma=1,V=20,scope=inputs"
    # runs that compute the same positions (another --reuse field) get no such note
    d = _write(tmp_path / "d", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.5, 7e-4)], reuse=[["behind_estimate", "stop"]])
    assert "compare them by first-token KL" not in markdown(load_results([a, d])[0], [])


def test_a_kl_mean_is_weighed_only_against_runs_computing_the_same_positions(tmp_path):
    # scope inputs reuses less at a far lower KL mean over other positions: it hides nothing of
    # the default scope's KL-mean frontier, while their first-token KLs still compete
    a = _write(tmp_path / "a", "mmlu", [_row("dense", "", 0.0, 0.0), _row("realign", "", 0.75, 5e-3, kl_last=5e-2),
                                        _row("kvcomm", "gamma=1", 0.75, 4e-3, kl_last=3e-2)])
    b = _write(tmp_path / "b", "mmlu", [_row("realign", "", 0.5, 7e-4, kl_last=8e-4), _row("kvcomm", "gamma=1", 0.5, 6e-4, kl_last=7e-4)],
               reuse=[["compute_trailing_text", True], ["decode_reply_bases", False]])
    c = _write(tmp_path / "c", "mmlu", [_row("kvcomm", "gamma=0.3", 0.4, 9e-4, kl_last=1e-3)],
               reuse=[["compute_trailing_text", True], ["decode_reply_bases", False]])
    points, _ = load_results([a, b, c])
    by_label = {p.label: p for p in points}
    mean = {label for label, p in by_label.items() if on_frontier(p, points)}
    assert mean == {"dense", "kvcomm gamma=1 (reuse default)", "kvcomm gamma=1 (reuse scope inputs)"}
    first = {label for label, p in by_label.items() if on_frontier(p, points, "kl_last_mean")}
    assert first == {"dense", "kvcomm gamma=1 (reuse default)", "kvcomm gamma=1 (reuse scope inputs)"}
    assert not on_frontier(by_label["realign (reuse default)"], points)  # same positions as kvcomm's, dominated
    # the lower-reuse inputs run at a higher KL mean is dominated within its own scope only
    assert not on_frontier(by_label["kvcomm gamma=0.3 (reuse scope inputs)"], points)
    assert "marked among runs that compute the same positions" in markdown(points, [])


def test_default_scope_runs_from_before_and_after_the_default_changed_are_told_apart(tmp_path):
    # a run of the default scope alone names no scope in its setting; its results record the
    # scopes it ran (``all`` until 2026-12-06, ``all-reader-replies`` since; none before scopes existed)
    old = _write(tmp_path / "a", "mmlu", [_row("dense", "", 0.0, 0.0), _row("kvcomm", "gamma=1,V=20", 0.75, 4e-3)])
    was = _write(tmp_path / "b", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.74, 4e-3)], scopes=["all"])
    now = _write(tmp_path / "c", "mmlu", [_row("kvcomm", "gamma=1,V=20", 0.69, 3e-3)], scopes=["all-reader-replies"])
    points, _ = load_results([old, was, now])
    assert [p.label for p in points] == ["dense", "kvcomm gamma=1,V=20 (scope all)", "kvcomm gamma=1,V=20 (scope all)",
                                         "kvcomm gamma=1,V=20 (scope all-reader-replies)"]
    assert points[1].computed_positions == points[2].computed_positions != points[3].computed_positions
    assert [p.label for p in load_results([was, old])[0]] == ["kvcomm gamma=1,V=20", "dense", "kvcomm gamma=1,V=20"]


def test_a_label_has_one_colour_in_every_panel(tmp_path):
    # gsm lacks the cacheblend point and kvcomm's first-token KL: a per-panel colour cycle would
    # give the shared labels other colours there
    mmlu = _write(tmp_path / "a", "mmlu", [_row("dense", "", 0.0, 0.0), _row("cacheblend", "r=0.15", 0.6, 1e-3),
                                           _row("realign", "", 0.9, 1e-3), _row("kvcomm", "gamma=1", 0.8, 2e-3)])
    gsm = _write(tmp_path / "b", "gsm", [_row("realign", "", 0.7, 1e-2), _row("kvcomm", "gamma=1", 0.6, 9e-3)])
    points, _ = load_results([mmlu, gsm])
    points = [dataclasses.replace(p, kl_last_mean=None) if (p.workload, p.mode) == ("gsm", "kvcomm") else p for p in points]
    fig = figure(points, [])
    seen: dict[str, set[str]] = {}
    for ax in fig.axes:
        for container in ax.containers:
            seen.setdefault(container.get_label(), set()).add(container.lines[0].get_color())
    assert sorted(seen) == ["cacheblend r=0.15", "kvcomm gamma=1", "realign"]
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == 3  # and the labels' colours differ
    assert [len(ax.containers) for ax in fig.axes] == [3, 3, 2, 1]  # mmlu: both panels; gsm: KL mean, first-token KL
    plt.close(fig)
