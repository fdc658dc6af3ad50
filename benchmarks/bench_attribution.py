"""Where reuse's remaining error comes from: the first reply token's KL, piece by piece.

A workload pipeline (default: MMLU, 24 items after 24 calibration items, 2 agents + decider,
the order ``kvcomm eval`` uses) runs with a fresh engine in ``--mode`` (kvcomm or realign). At
every call that reuses, besides the call itself, the benchmark prefills the prompt densely
(the reference and its real KV) and prefills the computed tail again behind altered copies of
the served prefix: each copy gives one kind of reused token its dense KV and keeps the rest
as served. Reported per agent and overall:

- served: mean first-reply-token KL(dense || reuse), on dense's top-k tokens plus the rest
  (``kvcomm.core.divergence``, as ``kvcomm eval``'s first-token KL);
- per kind (the task, the earlier agents' replies, the fixed template text served behind
  them, and the first ``--head`` tokens of every shared segment, a cut across the first two):
  its share of the reused tokens, the mean KL with that kind dense, and the share of the
  served KL it removes (1 - sum KL with it dense / sum KL served);
- "all but the task": every reused token but the task's given its dense KV (what is left when
  only the workload's input is served);
- "all dense": every reused token's KV replaced, a check that the replacement reproduces
  dense (its KL is float noise).

Kinds overlap in what they fix (attention mixes them), so the shares need not add up to 1.
The calls run as in ``kvcomm eval``: the extra prefills change nothing the engine learns.

    python benchmarks/bench_attribution.py [--workload mmlu] [--limit 24] [--warm-items 24] [--agents 2]
                                           [--mode kvcomm|realign] [--head 4] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import defaultdict

import torch

from bench_reuse import bar, table  # this folder is on sys.path when the script runs
from kvcomm.core.divergence import kl_topk_other, topk_reference
from kvcomm.core.kv import KV
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.runner import run_row
from kvcomm.eval.cli_eval import load_executor
from kvcomm.eval.workloads import load_workload

KINDS = ("task", "replies", "fixed text between", "fixed text after", "segment heads")


def kind_ranges(plan: ReusePlan, input_slots: set[str], head: int) -> dict[str, list[tuple[int, int]]]:
    """Prompt ranges ``[start, end)`` of the served prefix, by kind (exact prefix excluded).
    Fixed template text is "between" shared segments, or "after" the last one the prefix holds
    (the instruction the reply follows, up to the computed tail)."""
    ranges: dict[str, list[tuple[int, int]]] = {kind: [] for kind in KINDS}
    fixed = []
    for piece in plan.pieces:
        segment = plan.prompt.segments[piece.segment_index]
        span = (piece.start, piece.start + piece.base.length)
        if segment.slot is None:
            fixed.append(span)
        else:
            ranges["task" if segment.slot in input_slots else "replies"].append(span)
            if piece.start == plan.prompt.starts[piece.segment_index]:  # the segment's own first tokens
                ranges["segment heads"].append((span[0], min(span[1], span[0] + head)))
        if piece.following_base is not None:
            fixed.append((piece.following_start, piece.end))
    last_shared = max((end for kind in ("task", "replies") for _, end in ranges[kind]), default=0)
    for start, end in fixed:
        ranges["fixed text after" if start >= last_shared else "fixed text between"].append((start, end))
    return ranges


class AttributingExecutor:
    """Runs every call as the wrapped executor does; for calls that reuse (while ``active``),
    also measures the first-token KL with each kind of reused token given its dense KV."""

    def __init__(self, inner, engine: ReuseEngine, input_slots: set[str], head: int):
        self.inner, self.input_slots, self.head = inner, input_slots, head
        self.active, self.plan, self.records = False, None, []
        plan = engine.plan

        def remembering_plan(*args, **kwargs):
            self.plan = plan(*args, **kwargs)
            return self.plan

        engine.plan = remembering_plan

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, token_ids, prefix, max_new_tokens, started, **options):
        plan, self.plan = self.plan, None
        attribute = self.active and prefix is not None and plan is not None and bool(plan.pieces)
        if attribute:
            options["keep_logprobs"] = True  # the call's own first-token distribution is the served one
        generation = self.inner.generate(token_ids, prefix, max_new_tokens, started, **options)
        if attribute:  # still inside the engine's ``materialized``: ``prefix`` is valid, and only read
            self.records.append(self._attribute(token_ids, prefix, plan, generation.prompt_logprobs[-1:]))
        return generation

    def _first_token(self, token_ids, prefix: KV | None):
        generation = self.inner.generate(token_ids, prefix, 1, time.perf_counter(), keep_logprobs=True)
        return generation.prompt_logprobs[-1:], generation.computed

    def _attribute(self, token_ids, served: KV, plan: ReusePlan, served_logprobs: torch.Tensor) -> dict:
        dense_logprobs, dense = self._first_token(token_ids, None)
        reference = topk_reference(dense_logprobs)
        ranges = kind_ranges(plan, self.input_slots, self.head)
        ranges["all but the task"] = [r for kind in KINDS[1:4] for r in ranges[kind]]
        ranges["all dense"] = [(plan.exact_length, plan.reuse_end)]
        kl = {"served": float(kl_topk_other(reference, served_logprobs)[0])}
        for kind, spans in ranges.items():
            altered = served.clone()
            for start, end in spans:
                altered.span(start, end).keys.copy_(dense.span(start, end).keys)
                altered.span(start, end).values.copy_(dense.span(start, end).values)
            kl[kind] = float(kl_topk_other(reference, self._first_token(token_ids, altered)[0])[0])
        tokens = {kind: sum(end - start for start, end in spans) for kind, spans in ranges.items()}
        return {"agent": plan.prompt.template_id, "reused": plan.reuse_end - plan.exact_length, "tokens": tokens, "kl": kl}


def summary_rows(records: list[dict]) -> list[list[str]]:
    groups = defaultdict(list)
    for record in records:
        groups[record["agent"]].append(record)
    groups["all"] = records
    rows = []
    for agent, group in groups.items():
        served = sum(r["kl"]["served"] for r in group)
        reused = sum(r["reused"] for r in group)
        rows.append([agent, len(group), "served", "100%", f"{served / len(group):.2e}", "-"])
        for kind in (*KINDS, "all but the task", "all dense"):
            with_dense = sum(r["kl"][kind] for r in group)
            share = sum(r["tokens"][kind] for r in group) / reused
            removed = 1 - with_dense / served if served > 0 else float("nan")
            rows.append(["", "", kind, f"{share:.0%}", f"{with_dense / len(group):.2e}", f"{removed:.0%}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mmlu")
    parser.add_argument("--limit", type=int, default=24, help="evaluated items")
    parser.add_argument("--warm-items", type=int, default=24, help="calibration items before them")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--mode", choices=("kvcomm", "realign"), default="kvcomm")
    parser.add_argument("--head", type=int, default=4, help="tokens counted as a segment's head")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write every call's record here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = load_workload(args.workload, limit=args.limit + args.warm_items, n_agents=args.agents, seed=0)
    spec = workload.pipeline
    if len(spec.inputs) < args.limit + args.warm_items:
        raise SystemExit(f"the workload has {len(spec.inputs)} items, fewer than --limit plus --warm-items")
    executor, model = load_executor(None)
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode=args.mode))
    probe = AttributingExecutor(executor, engine, set(spec.input_slots), args.head)
    evaluated = args.limit
    for row in bar(range(evaluated, evaluated + args.warm_items), desc="calibration"):
        run_row(spec, row, probe, engine, calibrate=True)
    order = list(range(evaluated))
    random.Random(0).shuffle(order)  # kvcomm eval's order for seed 0
    probe.active = True
    for row in bar(order, desc=f"{args.mode} rows"):
        run_row(spec, row, probe, engine)

    print(f"{args.workload}: {evaluated} items after {args.warm_items} calibration items, {args.agents} agents + decider, "
          f"mode {args.mode}, model {model}, {len(probe.records)} reusing calls")
    print(table(["agent", "calls", "KV given dense", "share of reused", "first-token KL", "KL removed"],
                summary_rows(probe.records)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "records": probe.records}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
