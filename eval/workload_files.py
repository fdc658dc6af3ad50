"""User-supplied workloads: a pipeline ``.json`` (the ``kvcomm run`` format plus optional
``"references"`` and ``"scorer"``) or a ``.jsonl`` dataset wrapped into the default topology."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from types import MappingProxyType

from kvcomm.core.textfile import parse_json, read_utf8
from kvcomm.reuse.pipeline import PipelineError, parse_pipeline

from .scorers import SCORERS, reference_number
from .workload import DEFAULT_MAX_NEW_TOKENS, Workload, WorkloadError, build_workload, seeded_order

def _json(text: str, where: str) -> object:
    return parse_json(text, where, WorkloadError)


def _check_reference(ref: object, scorer: str, where: str) -> None:
    ok = {
        "choice": isinstance(ref, str) and ref.strip().upper() in ("A", "B", "C", "D"),
        "number": not isinstance(ref, bool) and reference_number(ref) is not None,
        "exact": (isinstance(ref, (str, int, float)) and not isinstance(ref, bool) and str(ref).strip() != "")
        or (isinstance(ref, list) and bool(ref) and all(isinstance(r, str) and r.strip() for r in ref)),
    }
    ok["contains"] = ok["exact"]
    if not ok[scorer]:
        need = {"choice": "a letter A-D", "number": "a number or a numeric string",
                "exact": "a non-empty string or number, or a list of strings"}
        raise WorkloadError(f"{where}: reference {json.dumps(ref)[:60]} does not suit scorer {scorer!r}; "
                            f"it must be {need.get(scorer, need['exact'])}")


def _scorer_name(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in SCORERS:
        raise WorkloadError(f"{where}: unknown scorer {json.dumps(value)[:40]}; choose one of {', '.join(SCORERS)}")
    return value


def _default_scorer(refs: Sequence[object]) -> str:
    numeric = [r for r in refs if r is not None]
    return "number" if numeric and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in numeric) \
        else "exact"


def _load_pipeline_file(path: str, obj: object, limit: int | None, seed: int,
                        max_new_tokens: int | None) -> Workload:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{path}: a pipeline file must hold a JSON object, got {type(obj).__name__}")
    obj = dict(obj)
    has_refs, references = "references" in obj, obj.pop("references", None)
    scorer_value = obj.pop("scorer", None)
    try:
        full = parse_pipeline(obj, path)
    except PipelineError as e:
        raise WorkloadError(str(e)) from None
    n = len(full.inputs)
    if has_refs:
        if not isinstance(references, list) or len(references) != n:
            got = f"a list of {len(references)}" if isinstance(references, list) else type(references).__name__
            raise WorkloadError(f"{path}: 'references' must be a list with one entry per input row ({n}), got {got}")
        refs = list(references)
    else:
        refs = [None] * n
    name = _scorer_name(scorer_value, f"{path}: 'scorer'") if scorer_value is not None else _default_scorer(refs)
    for r, ref in enumerate(refs):
        if ref is not None:
            _check_reference(ref, name, f"{path}: references[{r}]")
    order = seeded_order(n, limit, seed)
    obj["inputs"] = [obj["inputs"][i] for i in order]
    if max_new_tokens is not None:
        obj["max_new_tokens"] = max_new_tokens
    spec = parse_pipeline(obj, path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return Workload(stem, spec, tuple(refs[i] for i in order), SCORERS[name],
                    tuple(MappingProxyType({"source_index": i}) for i in order))


def _load_jsonl_file(path: str, text: str, limit: int | None, n_agents: int, seed: int,
                     max_new_tokens: int | None) -> Workload:
    items: list[tuple[str, object, str | None, dict]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {lineno}"
        row = _json(line, where)
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object like "
                                f"{{\"task\": ..., \"answer\": ...}}, got {type(row).__name__}")
        task = row.get("task")
        if not isinstance(task, str) or not task.strip():
            raise WorkloadError(f"{where}: 'task' must be a non-empty string")
        if row.get("answer") is None:
            raise WorkloadError(f"{where}: missing 'answer' (the gold reference of the row)")
        scorer = _scorer_name(row["scorer"], f"{where}: 'scorer'") if "scorer" in row else None
        extra = {k: v for k, v in row.items() if k not in ("task", "answer", "scorer")}
        items.append((task, row["answer"], scorer, extra | {"source_index": len(items), "line": lineno}))
    if not items:
        raise WorkloadError(f"{path}: no rows; a JSONL dataset has one JSON object per line")
    unscored = [answer for _, answer, scorer, _ in items if scorer is None]
    default = _default_scorer(unscored) if unscored else "exact"
    names = [s or default for _, _, s, _ in items]
    for (_, answer, _, d), name in zip(items, names):
        _check_reference(answer, name, f"{path}: line {d['line']}: 'answer'")
    mnt = max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS["file"]
    order = seeded_order(len(items), limit, seed)
    stem = os.path.splitext(os.path.basename(path))[0]
    chosen = [names[i] for i in order]
    main = max(set(chosen), key=chosen.count) if len(set(chosen)) > 1 else chosen[0]
    row_scorers = [SCORERS[c] for c in chosen] if len(set(chosen)) > 1 else []
    rows = [(items[i][0], items[i][1], items[i][3]) for i in order]
    return build_workload(stem, rows, n_agents, mnt, SCORERS[main],
                   "Think about the task and give your answer. Be brief.",
                   "Give the final answer. End your reply with \"Answer: <answer>\".",
                   f"{path}, {n_agents} agents + decider, seed {seed}", row_scorers=row_scorers)


def load_file(path: str, limit: int | None, n_agents: int, seed: int, max_new_tokens: int | None) -> Workload:
    text = read_utf8(path, "workload file", WorkloadError)
    if not text.strip():
        raise WorkloadError(f"{path}: the file is empty")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".jsonl":
        return _load_jsonl_file(path, text, limit, n_agents, seed, max_new_tokens)
    if suffix != ".json":  # sniff: one JSON object with "agents" is a pipeline, anything else JSONL
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and "agents" in obj):
            return _load_jsonl_file(path, text, limit, n_agents, seed, max_new_tokens)
    return _load_pipeline_file(path, _json(text, path), limit, seed, max_new_tokens)
