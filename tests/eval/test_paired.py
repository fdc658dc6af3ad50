"""The paired call-by-call comparison of two `kvcomm eval` runs (kvcomm.eval.paired)."""

import json
import math

import pytest

from kvcomm.eval.paired import Comparison, compare, decision_gaps, load_run, main, paired_calls

AGENTS = ("agent1", "agent2", "decider")


def _call(mode, index, position, kl_last, reply="r", estimated=10, computed=1, prompt=50, setting="gamma=1", note=""):
    return {"seed": 0, "mode": mode, "setting": setting, "order": index, "input_index": index, "note": note,
            "agent": AGENTS[position], "agent_position": position, "prompt_tokens": prompt, "exact_tokens": 5,
            "estimated_tokens": estimated, "computed_tokens": computed, "recomputed_tokens": 0, "reply": reply,
            "kl_last": kl_last, "kl_sum": None if kl_last is None else 2 * kl_last, "kl_positions": computed, "top1_matches": computed}


def _write(folder, calls, workload="mmlu"):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"workload": workload, "calls": calls}))
    return str(folder)


def test_pairs_only_calls_with_the_same_prompt_and_decisions_that_reused(tmp_path):
    a = [_call("dense", 0, 1, 0.0),
         _call("kvcomm", 0, 0, 0.0, estimated=0, computed=40),  # reused nothing: left out
         _call("kvcomm", 0, 1, 0.1), _call("kvcomm", 0, 2, 0.2),  # paired
         _call("kvcomm", 1, 0, 0.0, reply="x", estimated=0, computed=40),
         _call("kvcomm", 1, 1, 0.3),  # agent1's reply differs between the runs: another prompt
         _call("kvcomm", 2, 1, 0.1, estimated=8, computed=3)]  # other decisions
    b = [_call("realign", 0, 0, 0.0, estimated=0, computed=40), _call("realign", 0, 1, 0.4), _call("realign", 0, 2, 0.1),
         _call("realign", 1, 0, 0.0, reply="y", estimated=0, computed=40), _call("realign", 1, 1, 0.5),
         _call("realign", 2, 1, 0.2)]
    run_a, run_b = load_run(_write(tmp_path / "a", a)), load_run(_write(tmp_path / "b", b))
    assert run_a.label.startswith("kvcomm gamma=1") and run_b.label.startswith("realign gamma=1")
    pairs, other_prompt, other_decisions = paired_calls(run_a, run_b)
    assert [(x["input_index"], x["agent"]) for x, _ in pairs] == [(0, "agent2"), (0, "decider")]
    assert (other_prompt, other_decisions) == (1, 1)
    agent2, decider, everything = compare(pairs)
    assert (agent2.agent, agent2.a_lower, agent2.b_lower) == ("agent2", 1, 0)
    assert (decider.a_lower, decider.b_lower) == (0, 1)
    assert everything.agent == "all" and everything.calls == 2
    assert everything.kl_sum == pytest.approx((0.6, 1.0)) and everything.kl_last_median == pytest.approx((0.15, 0.25))


def test_other_decisions_are_summed_by_both_runs_notes_numbers_blanked(tmp_path):
    learn = "slot 'task' not shareable (1 compatible anchors, 2 needed): new anchor"
    a = [_call("kvcomm", 0, 1, 0.1, estimated=0, computed=45, note=learn),
         _call("kvcomm", 1, 1, 0.1, estimated=0, computed=45, note=learn.replace("1 compatible", "0 compatible")),
         _call("kvcomm", 2, 1, 0.1, estimated=30, computed=15, note="slot 'task': 30 of 40 tokens covered by anchors"),
         _call("kvcomm", 3, 1, 0.1, estimated=9, computed=36, note="x"),
         _call("kvcomm", 4, 1, 0.1, prompt=60, estimated=0, computed=55, note=learn)]  # another prompt: not a gap
    b = [_call("realign", i, 1, 0.2, estimated=44 if i < 3 else 1, computed=1 if i < 3 else 44) for i in range(4)] + \
        [_call("realign", 4, 1, 0.2, estimated=44, computed=1)]
    gaps = decision_gaps(load_run(_write(tmp_path / "a", a)), load_run(_write(tmp_path / "b", b)))
    assert [(g.note_a, g.note_b, g.calls, g.reused) for g in gaps] == [
        ("slot 'task' not shareable (# compatible anchors, # needed): new anchor", "(none)", 2, (10, 98)),
        ("slot 'task': # of # tokens covered by anchors", "(none)", 1, (35, 49)),
        ("x", "(none)", 1, (14, 6)),
    ]
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("a_lower, b_lower, expected", [(18, 3, 2 * sum(math.comb(21, i) for i in range(4)) / 2 ** 21),
                                                        (5, 5, 1.0), (0, 0, 1.0), (0, 6, 2 / 2 ** 6)])
def test_sign_test_is_two_sided_over_the_untied_calls(a_lower, b_lower, expected):
    c = Comparison("agent2", a_lower + b_lower + 2, a_lower, b_lower, (0.0, 0.0), (0.0, 0.0), 0, (0, 0))
    assert c.sign_p == pytest.approx(expected)


def test_ambiguous_or_unknown_mode_is_refused_with_the_choices(tmp_path):
    folder = _write(tmp_path / "a", [_call("kvcomm", 0, 1, 0.1), _call("kvblend", 0, 1, 0.1)])
    with pytest.raises(ValueError, match=r"is ambiguous; the reuse runs in .* are: .*:kvcomm:gamma=1, .*:kvblend:gamma=1"):
        load_run(folder)
    with pytest.raises(ValueError, match="matches nothing"):
        load_run(folder + ":realign")
    assert load_run(folder + ":kvblend:gamma=1").label.startswith("kvblend")


def test_runs_without_kl_or_of_other_workloads_are_refused(tmp_path):
    no_kl = _call("kvcomm", 0, 1, None)
    with pytest.raises(ValueError, match="without --no-kl"):
        load_run(_write(tmp_path / "a", [no_kl]))
    gsm, mmlu = (load_run(_write(tmp_path / w, [_call("kvcomm", 0, 1, 0.1)], workload=w)) for w in ("gsm", "mmlu"))
    with pytest.raises(ValueError, match="different workloads"):
        paired_calls(gsm, mmlu)
    with pytest.raises(FileNotFoundError, match="kvcomm eval --out"):
        load_run(str(tmp_path / "missing"))


def test_paired_command_prints_and_writes_the_table(tmp_path, capsys):
    a = _write(tmp_path / "a", [_call("kvcomm", 0, 1, 0.1)])
    b = _write(tmp_path / "b", [_call("realign", 0, 1, 0.3)])
    assert main([a, b, "--out", str(tmp_path / "p.md")]) == 0
    printed = capsys.readouterr().out
    assert "| agent2 | 1 | 1.00e-01 | 3.00e-01 | 1 | 0 | 1.000 |" in printed
    assert (tmp_path / "p.md").read_text() in printed
