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
greedily (a long reply, captured for learning when opted in: copied once, when the request
finished), on the plugin-free engine (a child process), the plugin's engine without opt-in, and
opted in (``VllmExecutor.generate``: prompt and reply captured); with ``--baseline-tree DIR``
also opted in through the kvcomm code of another checkout (a child process that imports
kvcomm from ``DIR``, e.g. ``git archive main`` unpacked: before and after a change in one
run). Per request: tokens/s (generated tokens over its wall time), CPU milliseconds per
token of the process running the engine (``time.process_time``: less sensitive to other jobs
on the cores than wall time) and, on the plugin's engines, kvcomm's own share of it: its
hooks' thread CPU time, both sides, as its step clocks observe it (``vllm.connector.step_time``). The engines take turns, in alternating order, ``--repeats``
times; reported per engine the medians, and per plugin engine its ratio to plugin-free within
each turn (median, quartiles, least and most) beside the ratio of medians. The goal: opted in
>= 0.98x plugin-free.

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

import sys
from pathlib import Path

# kvcomm (and bench_reuse, which imports it) is imported inside the functions: a child process
# started by ``_ChildEngine`` may import it from another checkout (``--baseline-tree``).

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


def use_kvcomm_from(tree: str | os.PathLike) -> None:
    """Import kvcomm from the checkout ``tree`` in this process (which must not have imported it
    yet): the editable install's finder (``pip install -e .``) is pointed at ``tree``'s folders.
    RuntimeError when kvcomm is imported already or not installed editable."""
    if any(name == "kvcomm" or name.startswith("kvcomm.") for name in sys.modules):
        raise RuntimeError("kvcomm was imported before its checkout could be chosen")
    finder = next((module for name, module in sys.modules.items() if name.startswith("__editable___kvcomm")), None)
    if finder is None:
        raise RuntimeError("kvcomm is not an editable install in this environment; --baseline-tree needs one")
    root, tree = Path(finder.MAPPING["kvcomm"]).parent, Path(tree).resolve()
    if not (tree / "kvcomm" / "__init__.py").is_file():
        raise RuntimeError(f"{tree} is not a kvcomm checkout (no kvcomm/__init__.py)")
    for package, folder in list(finder.MAPPING.items()):
        finder.MAPPING[package] = str(tree / Path(folder).relative_to(root))
    # ahead of the path finder, so that a kvcomm/ folder on sys.path (the working directory's) does not win
    sys.meta_path[:] = [finder._EditableFinder] + [f for f in sys.meta_path if f is not finder._EditableFinder]
    import kvcomm

    if not Path(kvcomm.__file__).resolve().is_relative_to(tree):
        raise RuntimeError(f"kvcomm was imported from {kvcomm.__file__}, not from {tree}")


def _engine_worker(connection, tree: str | None) -> None:
    """Child process: a plugin-free engine (``tree`` None) that times the prompts it is sent, or
    the plugin's engine built from the kvcomm checkout ``tree`` that times opted-in decodes
    (None ends it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tree is not None:
        use_kvcomm_from(tree)
        from kvcomm.integrations.transformers.embedded import load_tokenizer
        from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor
        from kvcomm.integrations.vllm.inprocess.llm import make_llm

        executor = VllmExecutor(make_llm(), load_tokenizer())
        connection.send("ready")
        while (job := connection.recv()) is not None:  # ("decode", ids, max_tokens, stop ids)
            connection.send(_opted_in_decode(executor, job[1], job[2]))
        executor.close()
        return
    from vllm import LLM

    from kvcomm.integrations.transformers.embedded import embedded_model_dir
    from kvcomm.integrations.vllm.inprocess.llm import DEFAULTS

    llm = LLM(model=str(embedded_model_dir()), **DEFAULTS)
    connection.send("ready")
    while (ids := connection.recv()) is not None:
        if isinstance(ids, tuple):  # ("decode", ids, max_tokens, stop ids)
            connection.send(_decode(llm, *ids[1:], None))
        else:
            connection.send(_prefill_seconds(llm, ids, None))


def _kvcomm_cpu_seconds() -> float:
    """kvcomm's hooks' thread CPU seconds so far in this process, scheduler and worker sides, as
    their step clocks observed them (``kvcomm_step_cpu_seconds``; a side's step is observed when
    it ends, so a request's last hooks may be counted with the next request)."""
    from prometheus_client import REGISTRY

    import kvcomm.integrations.vllm.connector.step_time  # noqa: F401  (registers the metrics)

    return sum(REGISTRY.get_sample_value("kvcomm_step_cpu_seconds_sum", {"side": side}) or 0.0
               for side in ("scheduler", "worker"))


Sample = tuple[float, float, "float | None", int]
"""One request: wall s, the engine process's CPU s, kvcomm's hooks' CPU s (None: no plugin), generated tokens."""


def _decode(llm, ids: list[int], max_tokens: int, stop_ids: list[int], extra_args: dict | None,
            plugin: bool = False) -> Sample:
    """One greedy request of ``max_tokens`` (prefix cache reset); ``plugin``: the engine loads
    kvcomm's connector, whose CPU time is counted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_ids, detokenize=False,
                            extra_args=extra_args)
    hooks = _kvcomm_cpu_seconds() if plugin else None
    start, cpu = time.perf_counter(), time.process_time()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, None if hooks is None else _kvcomm_cpu_seconds() - hooks, len(out[0].outputs[0].token_ids)


def _opted_in_decode(executor, ids: list[int], max_tokens: int) -> Sample:
    """``_decode`` through ``VllmExecutor.generate``: prompt and reply captured, ``max_tokens``
    generated."""
    executor.llm.reset_prefix_cache()
    hooks = _kvcomm_cpu_seconds()
    start, cpu = time.perf_counter(), time.process_time()
    reply = executor.generate(ids, None, max_tokens - 1).reply_ids  # generates one more, fed back and captured
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, _kvcomm_cpu_seconds() - hooks, len(reply) + 1


class _ChildEngine:
    """A vLLM engine in a spawned process, timed turn by turn with the plugin's engine: plugin-free
    (``tree`` None) or the plugin built from the kvcomm checkout ``tree`` (opted-in decodes)."""

    def __init__(self, tree: str | None = None) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_engine_worker, args=(child, tree), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child alone: its death ends recv() with EOFError
        try:
            ready = self.connection.recv()
        except EOFError:
            ready = None
        if ready != "ready":
            what = "plugin-free vLLM engine" if tree is None else f"plugin engine of {tree}"
            raise RuntimeError(f"the {what} did not start (its process ended; see its output above)")

    def prefill_seconds(self, ids: list[int]) -> float:
        self.connection.send(ids)
        return self.connection.recv()

    def decode(self, ids: list[int], max_tokens: int, stop_ids: list[int]) -> Sample:
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
    from bench_reuse import interleave  # this folder is on sys.path when the script runs

    stock = _ChildEngine()

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
    from bench_reuse import synthetic_ids
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.inprocess.llm import make_llm
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

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


def decode_speed(repeats: int, tokens: int, baseline_tree: str | None = None) -> dict:
    """Decode speed per request (see the module docstring): ``decode_report`` of ``repeats``
    interleaved turns of the engines."""
    from bench_reuse import interleave, synthetic_ids
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor
    from kvcomm.integrations.vllm.inprocess.llm import make_llm

    children = {"plugin_free": _ChildEngine()}
    if baseline_tree is not None:
        children["plugin_opt_in_baseline"] = _ChildEngine(baseline_tree)
    executor = VllmExecutor(make_llm(), load_tokenizer())
    ids = list(executor.lead_in_ids) + list(synthetic_ids(executor, 0, 100))
    stops = sorted(executor.stop_ids)
    try:
        steps = {"plugin_free": lambda: children["plugin_free"].decode(ids, tokens, stops),
                 "plugin_no_opt_in": lambda: _decode(executor.llm, ids, tokens, stops, None, plugin=True),
                 "plugin_opt_in": lambda: _opted_in_decode(executor, ids, tokens)}
        if baseline_tree is not None:
            steps["plugin_opt_in_baseline"] = lambda: children["plugin_opt_in_baseline"].decode(ids, tokens, stops)
        samples = interleave(repeats, steps, "decode")
    finally:
        for child in children.values():
            child.close()
        executor.close()
    return {"prompt_tokens": len(ids), "max_tokens": tokens, "baseline_tree": baseline_tree,
            **decode_report(samples)}


def _spread(values: list[float]) -> dict:
    """Median, quartiles, least and most of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"p50": round(median, 4), "q1": round(q1, 4), "q3": round(q3, 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def decode_report(samples: dict[str, list[Sample]]) -> dict:
    """The decode section from a ``Sample`` per turn and engine (``plugin_free`` among them;
    each engine ran once per turn). Per engine: tokens/s, CPU ms per token and (plugin engines)
    kvcomm's hooks' CPU ms per token, medians over the turns; per engine but plugin-free: its
    tokens/s over plugin-free's within each turn (``ratio``: median, quartiles, least, most),
    the ratio of the medians, and its CPU per token over plugin-free's, the same way."""
    turns = len(samples["plugin_free"])
    if turns == 0 or any(len(values) != turns for values in samples.values()):
        raise ValueError(f"every engine needs one sample per turn: {({k: len(v) for k, v in samples.items()})}")
    rates = {name: [n / wall for wall, _, _, n in values] for name, values in samples.items()}
    cpu = {name: [1000 * seconds / n for _, seconds, _, n in values] for name, values in samples.items()}
    report = {"samples": turns, "generated": {name: [n for *_, n in values] for name, values in samples.items()},
              "engines": {}}
    for name, values in samples.items():
        engine = {"tokens_per_s_p50": round(statistics.median(rates[name]), 3),
                  "cpu_ms_per_token_p50": round(statistics.median(cpu[name]), 3)}
        if all(hooks is not None for _, _, hooks, _ in values):
            engine["kvcomm_cpu_ms_per_token"] = _spread([1000 * hooks / n for _, _, hooks, n in values])
        if name != "plugin_free":
            engine["ratio"] = _spread([mine / free for mine, free in zip(rates[name], rates["plugin_free"])])
            engine["ratio_of_medians"] = round(engine["tokens_per_s_p50"] / statistics.median(rates["plugin_free"]), 4)
            engine["cpu_ratio"] = _spread([mine / free for mine, free in zip(cpu[name], cpu["plugin_free"])])
        report["engines"][name] = engine
    return report


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
    from bench_reuse import synthetic_ids
    from kvcomm.cli import add_reuse_scope_option
    from kvcomm.reuse.config import BASE_SOURCES

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
    parser.add_argument("--baseline-tree", help="--decode: also time opted-in decodes with the kvcomm code of this "
                        "checkout (a folder holding kvcomm/, anchors/, eval/, integrations/), in a child process")
    args = parser.parse_args()
    if args.rows < 1 or args.passes < 0 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1, --passes >= 0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the child engines' too: stdout is the result
    if args.data_path:
        print(json.dumps(data_path(args.repeats, args.tokens)))
        return
    if args.baseline_tree is not None and not args.decode:
        parser.error("--baseline-tree goes with --decode")
    if args.decode:
        print(json.dumps(decode_speed(args.repeats, args.decode_tokens, args.baseline_tree)))
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
