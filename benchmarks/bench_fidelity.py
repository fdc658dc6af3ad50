"""Estimate fidelity vs speed of anchor-pool settings on SmolLM2-135M, on the same anchors, in one run.

A pool of ``--anchors`` anchors is filled with synthetic ``--tokens``-token segments read by one
agent; then each of ``--probes`` new segments is prefilled densely (the real KV) and estimated
under every variant of the pool settings. Reported per variant:

- error: ||estimated KV - real KV|| / ||realigned base KV - real KV|| over the shared segment
  (and separately the fixed segment after it), keys and values, mean over probes; 1 = the
  estimate is no better than realignment alone, 0 = exact;
- first-token KL: KL(dense || reuse) of the next-token distribution after the prompt (on dense's
  top-k tokens plus the rest, ``kvcomm.core.divergence``), mean over probes: what the KV error
  costs where it matters ("realigned" serves the same decisions with no estimate);
- work: plan + materialize (into the engine's reused memory, as ``run_agent`` does) for the
  first agent to see the content (distance cache cleared), median over probes and repeats, the
  variants interleaved in alternating order.

Each text's base is its standalone prefill (``--base-source standalone``, the default) or its KV
in the prompt of another agent that read it first (``first_use``: another system prompt and
template, as a pipeline's later agents see a text an earlier one computed).

    python benchmarks/bench_fidelity.py [--tokens 1000] [--anchors 8] [--probes 4] [--repeats 3] [--threads 2]
                                        [--base-source standalone|first_use] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from bench_reuse import add_anchor, alternate, bar, ms, reader_prompt, shared_index, synthetic_ids, table  # this folder is on sys.path when the script runs
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import AnchorPool
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.divergence import kl_topk_other, topk_reference
from kvcomm.core.kv import KV, place, to_position_free
from kvcomm.core.segments import Segment
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.runner import build_prompt

VARIANTS = {  # name -> (changes to the default PoolConfig, anchor dtype or None for the KV's own)
    "default": ({}, None),
    "float16 anchors": ({}, torch.float16),
    "bfloat16 anchors": ({}, torch.bfloat16),
    "4 candidates": ({"max_candidates": 4}, None),
    "equal weights": ({"temperature": 1e9}, None),
}


def converted(pool: AnchorPool, config: PoolConfig, dtype: torch.dtype | None) -> AnchorPool:
    """A pool with ``config`` holding ``pool``'s anchors, their tensors cast to ``dtype`` (shared if None)."""
    cast = (lambda kv: kv) if dtype is None else (lambda kv: None if kv is None else kv.to(dtype))  # noqa: E731
    anchors = [dataclasses.replace(a, base=cast(a.base), deviations={
        slot: dataclasses.replace(d, shared=cast(d.shared), following=cast(d.following))
        for slot, d in a.deviations.items()}) for a in pool.anchors]
    out = AnchorPool(config)
    out.restore(anchors, pool.next_serial)
    return out


WRITER = parse_pipeline({"agents": [{"name": "writer", "system": "You are agent 1, a critic. Be brief.",
                                     "template": "Task:\n{task}\n\nGive your view."}], "inputs": [{"task": "-"}]}).agents[0]
"""``--base-source first_use``: the agent that computed each text first."""


def first_use_base(executor, ids) -> KV:
    """The position-free KV of text ``ids`` in WRITER's prompt (the base ``first_use`` keeps)."""
    prompt = build_prompt(executor, WRITER, {"task": Segment(ids, slot="task")})
    index = shared_index(prompt)
    start = prompt.starts[index]
    computed = executor.generate(prompt.token_ids, None, 1).computed
    return to_position_free(computed.span(start, start + len(ids)), executor.rotary, start)


def relative_error(estimate: KV, real: KV, realigned: KV) -> tuple[float, float]:
    """(keys, values) of ||estimate - real|| / ||realigned - real||."""
    return tuple(float((getattr(estimate, n) - getattr(real, n)).norm() / (getattr(realigned, n) - getattr(real, n)).norm())
                 for n in ("keys", "values"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per shared segment (default 1000)")
    parser.add_argument("--anchors", type=int, default=8, help="anchors in the pool (default 8)")
    parser.add_argument("--probes", type=int, default=4, help="new segments estimated (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per probe and variant (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--base-source", choices=("standalone", "first_use"), default="standalone",
                        help="each text's base: its standalone prefill, or its KV in another agent's prompt (default standalone)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.anchors < 2 or args.probes < 1 or args.tokens < 8 or args.repeats < 1:
        parser.error("need --anchors >= 2, --probes >= 1, --tokens >= 8, --repeats >= 1")

    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    executor = TransformersExecutor(*load_model_and_tokenizer())
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    pool = engine.pool("task")
    def base_of(ids, segment):
        return first_use_base(executor, ids) if args.base_source == "first_use" else executor.base_kv(segment)

    for seed in bar(range(args.anchors), desc="fill anchors"):
        ids = synthetic_ids(executor, seed, args.tokens)
        prompt = reader_prompt(executor, ids)
        index = shared_index(prompt)
        engine.register_base(prompt.segments[index], base_of(ids, prompt.segments[index]))
        add_anchor(executor, engine, prompt)
    pools = {name: converted(pool, dataclasses.replace(pool.config, **changes), dtype)
             for name, (changes, dtype) in VARIANTS.items()}
    errors = {name: [] for name in VARIANTS}
    kls = {name: [] for name in VARIANTS}
    seconds = {name: [] for name in VARIANTS}
    for probe in bar(range(args.probes), desc="probes"):
        ids = synthetic_ids(executor, 1000 + probe, args.tokens)
        prompt = reader_prompt(executor, ids)
        index = shared_index(prompt)
        base = base_of(ids, prompt.segments[index])
        engine.register_base(prompt.segments[index], base)
        dense = executor.generate(prompt.token_ids, None, 1, keep_logprobs=True)
        real, reference = dense.computed, topk_reference(dense.prompt_logprobs[-1:])

        for rep in range(args.repeats):
            for name in alternate(rep + probe, list(VARIANTS)):
                engine.pools["task"] = pools[name]
                pools[name].distance_cache.clear()
                start = time.perf_counter()
                plan = engine.plan(prompt)
                with engine.materialized(plan) as kv:  # into the engine's reused memory, as run_agent does
                    seconds[name].append(time.perf_counter() - start)
                    if rep:
                        continue
                    (piece,) = plan.pieces
                    assert plan.reuse_end == len(prompt) - 1 and piece.following_base is not None, plan.note
                    spans = [(piece.start, piece.base), (piece.following_start, piece.following_base)]
                    errors[name].append([relative_error(kv.span(s, s + b.length), real.span(s, s + b.length),
                                                        place(b, executor.rotary, s)) for s, b in spans])
                    reused = executor.generate(prompt.token_ids, kv, 1, keep_logprobs=True).prompt_logprobs[-1:]
                    kls[name].append(float(kl_topk_other(reference, reused)[0]))
    engine.pools["task"] = pool
    results = {"tokens": args.tokens, "anchors": args.anchors, "probes": args.probes, "threads": torch.get_num_threads(),
               "base_source": args.base_source,
               "variants": {}}
    rows = []
    for name in VARIANTS:
        mean = lambda i, j: statistics.fmean(e[i][j] for e in errors[name])  # noqa: E731
        r = {"shared_keys": mean(0, 0), "shared_values": mean(0, 1), "following_keys": mean(1, 0),
             "following_values": mean(1, 1), "first_token_kl": statistics.fmean(kls[name]), "work_s": statistics.median(seconds[name]),
             "pool_bytes": pools[name].nbytes}
        results["variants"][name] = r
        rows.append([name, f"{r['shared_keys']:.4f}", f"{r['shared_values']:.4f}", f"{r['following_keys']:.4f}",
                     f"{r['following_values']:.4f}", f"{r['first_token_kl']:.2e}", ms(r["work_s"]), f"{r['pool_bytes'] / 2**20:.0f} MiB"])
    print(f"\nEstimate fidelity vs pool settings: SmolLM2-135M, {args.anchors} anchors, {args.probes} new "
          f"{args.tokens}-token segments, {args.base_source} bases, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(table(["variant", "keys", "values", "following keys", "following values", "first-token KL", "work (first agent)",
                 "pool"], rows))
    print("error: ||estimate - real|| / ||realigned base - real|| (1 = no better than realignment alone), mean over "
          "probes; first-token KL: KL(dense || reuse) after the prompt, mean over probes; work: plan + materialize with no distances cached, median.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
