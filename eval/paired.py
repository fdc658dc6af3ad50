"""Paired comparison of two reuse runs of one workload, call by call.

At a few dozen items the aggregate KL of two close modes is decided by the few calls whose
prompts differ between the runs (an earlier reply diverged and the rest of the pipeline
changed with it). A paired comparison keeps only the calls that had the same prompt in both
runs (same seed and input, the same replies from every agent before them) and were served the
same way (the same exact, estimated, computed and recomputed token counts), so the two differ
only in the KV they were served; per agent it counts the calls where run A's KL of the first
reply token is the lower and gives the two-sided sign-test p of that count. The calls with the
same prompt but other decisions are where one run reused more than the other: they are summed
by why each run stopped reusing (its provenance note), so the table says what the reuse one
run gives up is spent on (an anchor learned, a segment its anchors cover too little of, ...).

    kvcomm paired OUT_A[:MODE[:SETTING]] OUT_B[:MODE[:SETTING]]   # or: python -m kvcomm.eval.paired

MODE may be left out when the folder holds one reuse mode, SETTING when the mode ran one.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

DECISIONS = ("exact_tokens", "estimated_tokens", "computed_tokens", "recomputed_tokens")
"""Per-call fields that say how a call was served; equal in both runs means the same pieces."""


@dataclass(frozen=True)
class Run:
    """The calls of one mode/setting of one result folder."""

    label: str
    workload: str
    calls: dict[tuple, dict]
    """By (seed, input_index, agent); each a ``calls`` record of results.json."""


@dataclass(frozen=True)
class Comparison:
    """Paired calls of one agent (or all agents) that reused something in both runs."""

    agent: str
    calls: int
    a_lower: int
    """Calls whose first-reply-token KL (``kl_last``) is lower in run A; ties are in neither."""
    b_lower: int
    kl_last_median: tuple[float, float]
    kl_sum: tuple[float, float]
    """Summed KL over the calls' computed positions, nats (A, B)."""
    positions: int
    top1: tuple[int, int]
    """Computed positions whose top-1 token equals dense's (A, B)."""

    @property
    def sign_p(self) -> float:
        """Two-sided sign-test p of ``a_lower`` among the untied calls (1.0 when all tie)."""
        n, k = self.a_lower + self.b_lower, min(self.a_lower, self.b_lower)
        if n == 0:
            return 1.0
        return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def load_run(spec: str) -> Run:
    """``FOLDER[:MODE[:SETTING]]`` -> its calls; refuses, naming the choices, when ambiguous."""
    folder, _, rest = spec.partition(":")
    mode, _, setting = rest.partition(":")
    path = Path(folder)
    path = path / "results.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no results.json; pass a folder written by `kvcomm eval --out`")
    data = json.loads(path.read_text())
    present = list(dict.fromkeys((c["mode"], c["setting"]) for c in data.get("calls", []) if c["mode"] != "dense"))
    chosen = [(m, s) for m, s in present if (not mode or m == mode) and (not setting or s == setting)]
    if len(chosen) != 1:
        choices = ", ".join(f"{folder}:{m}" + (f":{s}" if s else "") for m, s in present) or "none"
        what = "matches nothing" if not chosen else "is ambiguous"
        raise ValueError(f"{spec!r} {what}; the reuse runs in {folder} are: {choices}")
    mode, setting = chosen[0]
    calls = {(c["seed"], c["input_index"], c["agent"]): c for c in data["calls"]
             if c["mode"] == mode and c["setting"] == setting}
    if any(c.get("kl_last") is None for c in calls.values()):
        raise ValueError(f"{folder}: {mode} has no per-call KL; run `kvcomm eval` without --no-kl")
    return Run(f"{mode} {setting}".strip() + f" ({folder})", data["workload"], calls)


@dataclass(frozen=True)
class DecisionGap:
    """Calls with the same prompt in both runs, served differently, that stopped reusing for
    the same reasons: the two runs' notes with their numbers blanked to ``#``."""

    note_a: str
    note_b: str
    calls: int
    reused: tuple[int, int]
    """Prompt tokens served from stored KV, exact or estimated, minus recomputed ones (A, B)."""


def paired_calls(a: Run, b: Run) -> tuple[list[tuple[dict, dict]], int, int]:
    """The calls with the same prompt and the same decisions in both runs that reused
    something beyond the exact prefix; also how many shared keys differ in prompt, and how
    many in decisions."""
    pairs, other_prompt, gaps = _matched(a, b)
    return pairs, other_prompt, len(gaps)


def decision_gaps(a: Run, b: Run) -> list[DecisionGap]:
    """The same-prompt calls the runs served differently, grouped by both runs' notes; the
    groups where A reuses the least against B first."""
    return _grouped_gaps(_matched(a, b)[2])


def _grouped_gaps(served_differently: list[tuple[dict, dict]]) -> list[DecisionGap]:
    groups: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for x, y in served_differently:
        groups.setdefault((_reason(x.get("note", "")), _reason(y.get("note", ""))), []).append((x, y))
    gaps = [DecisionGap(na, nb, len(g), (sum(_reused(x) for x, _ in g), sum(_reused(y) for _, y in g)))
            for (na, nb), g in groups.items()]
    return sorted(gaps, key=lambda g: (g.reused[0] - g.reused[1], g.note_a, g.note_b))


def _reason(note: str) -> str:
    return re.sub(r"\d+", "#", note) or "(none)"


def _reused(call: dict) -> int:
    return call["exact_tokens"] + call["estimated_tokens"]


def _matched(a: Run, b: Run) -> tuple[list[tuple[dict, dict]], int, list[tuple[dict, dict]]]:
    """(pairs with equal decisions that estimated, count of keys with another prompt, pairs
    with the same prompt and other decisions)."""
    if a.workload != b.workload:
        raise ValueError(f"the runs are of different workloads ({a.workload} vs {b.workload})")
    replies_a, replies_b = _replies(a), _replies(b)
    pairs, other_prompt, other_decisions = [], 0, []
    for key in sorted(a.calls.keys() & b.calls.keys(), key=lambda k: (k[0], a.calls[k]["order"], a.calls[k]["agent_position"])):
        x, y = a.calls[key], b.calls[key]
        if x["prompt_tokens"] != y["prompt_tokens"] or \
                _earlier(replies_a, key, x["agent_position"]) != _earlier(replies_b, key, x["agent_position"]):
            other_prompt += 1
        elif any(x[f] != y[f] for f in DECISIONS):
            other_decisions.append((x, y))
        elif x["estimated_tokens"] > 0:
            pairs.append((x, y))
    return pairs, other_prompt, other_decisions


def _replies(run: Run) -> dict[tuple, list[tuple[int, str]]]:
    out: dict[tuple, list[tuple[int, str]]] = {}
    for (seed, index, _), c in run.calls.items():
        out.setdefault((seed, index), []).append((c["agent_position"], c["reply"]))
    return {k: sorted(v) for k, v in out.items()}


def _earlier(replies: dict[tuple, list[tuple[int, str]]], key: tuple, position: int) -> list[str]:
    """The replies of the agents before ``position`` for the call's (seed, input)."""
    return [r for pos, r in replies[key[:2]] if pos < position]


def compare(pairs: list[tuple[dict, dict]]) -> list[Comparison]:
    """One Comparison per agent (in pipeline order), then one over all of them."""
    agents = sorted({x["agent"]: x["agent_position"] for x, _ in pairs}.items(), key=lambda kv: kv[1])
    groups = [(name, [p for p in pairs if p[0]["agent"] == name]) for name, _ in agents]
    if len(groups) > 1:
        groups.append(("all", pairs))
    return [_summary(name, group) for name, group in groups]


def _summary(agent: str, pairs: list[tuple[dict, dict]]) -> Comparison:
    def both(field: str) -> tuple[tuple, tuple]:
        return tuple(x[field] for x, _ in pairs), tuple(y[field] for _, y in pairs)

    last_a, last_b = both("kl_last")
    return Comparison(
        agent, len(pairs), sum(a < b for a, b in zip(last_a, last_b)), sum(b < a for a, b in zip(last_a, last_b)),
        (statistics.median(last_a), statistics.median(last_b)), tuple(sum(v) for v in both("kl_sum")),
        sum(x["kl_positions"] for x, _ in pairs), tuple(sum(v) for v in both("top1_matches")),
    )


def markdown(a: Run, b: Run) -> str:
    pairs, other_prompt, served_differently = _matched(a, b)
    lines = [f"A = {a.label}; B = {b.label}; workload {a.workload}.", "",
             f"{len(pairs)} paired calls reused in both with the same prompt and decisions; left out: "
             f"{other_prompt} with another prompt, {len(served_differently)} with other decisions, and the calls that "
             f"reused nothing beyond the exact prefix.", ""]
    gaps = _grouped_gaps(served_differently)
    if gaps:
        lines += ["Same prompt, other decisions, by why each run stopped reusing (tokens reused: exact + estimated):", "",
                  "| A's note | B's note | calls | reused A | reused B |", "|---|---|---|---|---|"]
        lines += [f"| {g.note_a} | {g.note_b} | {g.calls} | {g.reused[0]} | {g.reused[1]} |" for g in gaps] + [""]
    if not pairs:
        return "\n".join(lines)
    lines += ["| agent | calls | kl_last median A | kl_last median B | A lower | B lower | sign p | KL sum A | KL sum B "
              "| top-1 A | top-1 B |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in compare(pairs):
        lines.append(
            f"| {c.agent} | {c.calls} | {c.kl_last_median[0]:.2e} | {c.kl_last_median[1]:.2e} | {c.a_lower} | {c.b_lower} "
            f"| {_p(c.sign_p)} | {c.kl_sum[0]:.3f} | {c.kl_sum[1]:.3f} | {c.top1[0]}/{c.positions} | {c.top1[1]}/{c.positions} |")
    return "\n".join(lines) + "\n"


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="FOLDER[:MODE[:SETTING]] of a `kvcomm eval --out` result")
    parser.add_argument("b", metavar="B", help="the run to compare it with, the same way")
    parser.add_argument("--out", help="also write the table to this markdown file")


def run_paired_command(args: argparse.Namespace) -> int:
    text = markdown(load_run(args.a), load_run(args.b))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcomm.eval.paired", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_paired_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
