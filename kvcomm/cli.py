"""The `kvcomm` command: run pipelines dense vs reuse side by side, the demo, the RoPE self-check, serve over HTTP."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import BASE_SOURCES, ReuseConfig
from kvcomm.reuse.scopes import DEFAULT_SCOPE, SCOPES
from kvcomm.reuse.strategies import MODES, RECOMPUTE_MODES
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.executor import namespaced
from kvcomm.reuse.pipeline import PipelineError, PipelineSpec, load_bundled_pipeline, load_pipeline
from kvcomm.core.rope import RopeError
from kvcomm.reuse.runner import run_row
from kvcomm.services.quality_guard import QUALITY_BUDGET, GuardConfig
from kvcomm.integrations.runtimes import BACKENDS, close_executor, load_executor
from kvcomm.integrations.serve.command import STATE_SHUTDOWN_TIMEOUT_S, save_interval, serve_command
from kvcomm.integrations.vllm.connector.refusals import DEVICE_MEMORY_SHARE, HOST_MEMORY_SHARE


def run_side_by_side(spec: PipelineSpec, executor, config: ReuseConfig, progress: bool = True):
    """Every input row dense, then with reuse (one engine across rows), interleaved row by row.

    On a runtime with a prefix cache of its own (vLLM) each system runs in a namespace of its
    own (``namespaced``): dense calls are served only blocks earlier dense calls computed (stock
    vLLM with prefix caching), kvcomm's calls that inject nothing only blocks kvcomm's calls
    computed, never their dense twin's. Returns (dense calls, reuse calls, engine)."""
    engine = ReuseEngine(executor.rotary, config)
    dense_executor, reuse_executor = namespaced(executor, "run-dense"), namespaced(executor, "run-kvcomm")
    dense, reuse = [], []
    bar = tqdm(total=2 * len(spec.inputs) * len(spec.agents), desc="agent calls", disable=not progress, file=sys.stderr)
    for row in range(len(spec.inputs)):
        dense += run_row(spec, row, dense_executor, None, on_call=lambda _: bar.update())
        reuse += run_row(spec, row, reuse_executor, engine, on_call=lambda _: bar.update())
    bar.close()
    return dense, reuse, engine


def _cmd_run(args, spec: PipelineSpec) -> int:
    from kvcomm.eval.precision_floor import precision_floor
    from kvcomm.eval.report import compare, format_table, to_json

    if args.mode in RECOMPUTE_MODES and args.backend == "vllm":
        raise ValueError(f"--mode {args.mode} recomputes selected tokens inside the reused KV, which the transformers "
                         "executor does and the vLLM connector does not: use --backend transformers, or --mode "
                         f"{'kvcomm' if args.mode == 'kvblend' else 'realign'} (the same plan without the recompute)")
    config = ReuseConfig(pool=PoolConfig(gamma=args.gamma, max_anchors=args.max_anchors), base_source=args.base_source,
                         mode=args.mode, scope=args.reuse_scope)
    executor, model_path = load_executor(args.model, args.backend, args.dtype, args.device)
    try:
        dense, reuse, engine = run_side_by_side(spec, executor, config)  # progress on stderr, --json or not
    finally:
        close_executor(executor)
    calls = compare(dense, reuse)
    floor = None if args.no_precision_floor else precision_floor(
        args.model, args.backend, args.dtype, [c.prompt_ids for c in dense], [c.reply_ids for c in dense],
        spec.max_new_tokens, device=args.device)
    if args.json:
        meta = {"model": model_path, "backend": args.backend, "dtype": args.dtype, "device": args.device or "cpu",
                "mode": args.mode, "gamma": args.gamma, "max_anchors": args.max_anchors,
                "base_source": args.base_source,
                "anchors": {slot: len(pool) for slot, pool in engine.pools.items()}}
        print(json.dumps(to_json(calls, meta, floor), indent=2))
    else:
        print(format_table(calls, floor))
        print(f"anchors per slot: {', '.join(f'{s}={len(p)}' for s, p in engine.pools.items())}")
    return 0


DEMO_PIPELINE = "review"
DEMO_GAMMA = 1.0
DEMO_CHART = "kvcomm-demo.png"


def _cmd_demo(args, spec: PipelineSpec) -> int:
    """The demo: ``spec`` through the baseline and through kvcomm (``eval/demo.py``);
    prints the per-agent table and headline figures (or ``--json``) and writes the chart."""
    import os

    from kvcomm.eval.demo_report import demo_json, format_demo, write_chart
    from kvcomm.eval.demo import DenseTransformers, StockVllm, run_demo
    from kvcomm.eval.precision_floor import precision_floor

    chart = Path(args.chart)
    if not chart.resolve().parent.is_dir():
        raise ValueError(f"--chart {args.chart}: folder {chart.resolve().parent} does not exist; create it or pick another path")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported: keep the demo's output readable
    executor, model_path = load_executor(args.model, args.backend, args.dtype, args.device)
    try:
        baseline = StockVllm(executor.llm, executor.stop_ids) if args.backend == "vllm" else DenseTransformers(executor)
        config = ReuseConfig(pool=PoolConfig(gamma=args.gamma, max_anchors=args.max_anchors), base_source=args.base_source,
                             scope=args.reuse_scope)
        dense_calls: list = []
        calls, engine = run_demo(spec, executor, baseline, config, dense_calls=dense_calls)
    finally:
        close_executor(executor)
    floor = None if args.no_precision_floor else precision_floor(
        args.model, args.backend, args.dtype, [p for p, _ in dense_calls], [r for _, r in dense_calls],
        spec.max_new_tokens, device=args.device, stock_vllm=args.backend == "vllm")
    meta = {"model": model_path, "backend": args.backend, "dtype": args.dtype, "device": args.device or "cpu",
            "baseline": baseline.name, "gamma": args.gamma,
            "max_anchors": args.max_anchors, "base_source": args.base_source, "reuse_scope": args.reuse_scope,
            "anchors": {slot: len(pool) for slot, pool in engine.pools.items()}, "chart": str(chart.resolve())}
    report = demo_json(calls, meta, floor)
    write_chart(report, chart, baseline.name)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(spec.description, "\n")
        print(f"model {model_path}, backend {args.backend}, baseline {baseline.name}, gamma {args.gamma}, "
              f"max anchors {args.max_anchors}, base source {args.base_source}\n")
        print(format_demo(report, baseline.name))
        print(f"anchors per slot: {', '.join(f'{s}={n}' for s, n in meta['anchors'].items()) or 'none'}")
        print(f"chart: {meta['chart']}")
    return 0


def _cmd_selfcheck(args) -> int:
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, resolve_model_dir
    from kvcomm.integrations.transformers.rotary import rotary_from_model

    path = resolve_model_dir(args.model)
    model, _ = load_model_and_tokenizer(str(path), args.dtype, args.device)
    where = {"model": str(path), "dtype": args.dtype, "device": str(model.device)}
    try:
        rotary, check = rotary_from_model(model)
    except RopeError as error:
        result = {**where, "passed": False, "error": str(error)}
    else:
        result = {**where, "passed": True, "max_abs_error": check.max_abs_error,
                  "layer0_abs_error": check.layer0_abs_error, "key_scale": check.key_scale,
                  "tolerance": check.tolerance * max(1.0, check.key_scale),
                  "rotary_dim": rotary.rotary_dim, "head_dim": rotary.head_dim,
                  "pairing": "interleaved" if rotary.interleaved else "half-split",
                  "attention_scaling": rotary.attention_scaling}
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["passed"]:
        print(f"RoPE self-check passed for {path} in {args.dtype} on {result['device']}: max abs realignment error "
              f"{result['max_abs_error']:.3g} over all layers (tolerance {result['tolerance']:.3g}; layer 0: "
              f"{result['layer0_abs_error']:.3g}; keys up to {result['key_scale']:.3g}), "
              f"{result['pairing']} pairing, rotary dim {result['rotary_dim']}/{result['head_dim']}")
    else:
        print(f"RoPE self-check FAILED: {result['error']}", file=sys.stderr)
    return 0 if result["passed"] else 1


def _add_dtype_option(parser: argparse.ArgumentParser) -> None:
    """--dtype and --device, the model's precision and (transformers backend) where it runs."""
    from kvcomm.integrations.transformers.embedded import DTYPES

    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="model dtype: weights, activations and KV cache (default float32)")
    parser.add_argument("--device", help="where the transformers model runs: cpu (default), cuda or cuda:N; the "
                        "engine keeps its bases and anchors in that device's memory (vLLM places its model itself)")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", choices=BACKENDS, default="transformers")
    _add_dtype_option(parser)
    parser.add_argument("--gamma", type=float, default=PoolConfig.gamma, help="admission entropy threshold factor")
    parser.add_argument("--max-anchors", type=int, default=PoolConfig.max_anchors, help="V, anchors per pool")
    parser.add_argument("--base-source", choices=BASE_SOURCES, default=ReuseConfig.base_source,
                        help="new shared content's base KV: a standalone prefill, or its KV in the first prompt "
                        "that computes it (no extra forward pass)")
    add_reuse_scope_option(parser)
    parser.add_argument("--limit", type=int, help="run only the first N input rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/reference.md); "
                        "progress goes to stderr")
    parser.add_argument("--no-precision-floor", action="store_true",
                        help="skip the precision floor: the dense calls' prompts rerun densely in the other dtype "
                        "(bfloat16 for float32, float32 otherwise), their replies compared with the dense ones, "
                        "printed beside reply agreement")


def add_reuse_scope_option(parser: argparse.ArgumentParser) -> None:
    """``--reuse-scope``, one of ``SCOPES`` (kvcomm run, demo, serve and bench_vllm.py)."""
    parser.add_argument("--reuse-scope", choices=tuple(SCOPES), default=DEFAULT_SCOPE,
                        help="what is served from stored KV: all-reader-replies (default: the template text, "
                        "inputs and replies, each reply computed by its first reader and reused by the later ones as "
                        "that reader computed it), all (replies served from their producer's decode KV), content (as "
                        "all, but the template text after the shared content computed); docs/anchor-pool.md")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline JSON dense and with reuse, side by side")
    run.add_argument("pipeline", help="pipeline JSON file")
    _add_run_options(run)
    run.add_argument("--mode", choices=MODES, default=ReuseConfig.mode,
                     help="reuse mode (default kvcomm: anchor estimates, the most reuse); kvblend: the same plan, then "
                     "15%% of the estimated tokens recomputed (CacheBlend's selection), lower KL at less reuse; "
                     "realign, cacheblend, exact: the baselines (docs/evaluation.md). kvblend and cacheblend need "
                     "--backend transformers")
    demo = sub.add_parser("demo", help="the bundled document-review pipeline through kvcomm and through stock vLLM "
                          "(prefix caching on) side by side, with a chart")
    _add_run_options(demo)
    # The demo's own settings, whatever the library defaults: the vLLM server's base source
    # (first_use), and gamma 1 (reuse whenever two compatible anchors exist), since the five
    # bundled documents differ in content and a lower gamma may compute them all.
    demo.set_defaults(backend="vllm", gamma=DEMO_GAMMA, base_source="first_use")
    demo.add_argument("--chart", default=DEMO_CHART, help=f"where to write the PNG chart (default: {DEMO_CHART})")
    serve = sub.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with the kvcomm plugin, on 127.0.0.1 unless --host is given "
        "(other args go to vLLM)", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SERVE_EPILOG)
    serve.add_argument("--model", help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--no-plan", action="store_true", help="no server-side planning of annotated requests")
    serve.add_argument("--slots", nargs="+", help="the slot names annotations may use (default: any)")
    serve.add_argument("--gamma", type=float, default=PoolConfig.gamma,
                       help=f"admission entropy threshold factor (default {PoolConfig.gamma:g})")
    serve.add_argument("--max-anchors", type=int, default=PoolConfig.max_anchors,
                       help=f"V, anchors per pool (default {PoolConfig.max_anchors})")
    add_reuse_scope_option(serve)
    serve.add_argument("--max-tenant-bytes", type=int, help="byte cap of each tenant's pools, bases, prefixes and "
                       "retained contexts (default: none; the total cap applies)")
    serve.add_argument("--max-total-bytes", type=int, help="byte cap of all tenants' reuse state and retained contexts "
                       f"together (default on a CPU: {HOST_MEMORY_SHARE:.0%}% of host memory less --max-capture-bytes, "
                       f"here {_host_default_gib():.1f} GiB; on a GPU: {DEVICE_MEMORY_SHARE:.0%}% of the memory vLLM leaves "
                       "free, less --max-capture-bytes); what does not fit is evicted by the pools' rule, a retained "
                       "context that does not fit is refused with 409")
    serve.add_argument("--max-capture-bytes", type=int, help="bytes of KV the opted-in requests in flight "
                       "may capture together for learning (default 1 GiB); a request that does not fit: served without reuse")
    serve.add_argument("--state-dir", help="keep anchor pools and bases here across restarts (restored at start, "
                       "saved every --save-interval seconds and at exit; gives vLLM --shutdown-timeout "
                       f"{STATE_SHUTDOWN_TIMEOUT_S} unless set, so the engine lives long enough to save)")
    serve.add_argument("--save-interval", type=save_interval, default=60.0,
                       help="seconds between saves of --state-dir (default 60; positive and finite; also saved at exit)")
    from kvcomm.eval.cli_eval import quality_budget

    serve.add_argument("--quality-budget", type=quality_budget, default=QUALITY_BUDGET, metavar="TIMES",
                       help="quality guard: measure a sample of opted-in /v1/completions token requests that reused KV "
                       "against their dense twin, after the response, and tighten or disable a slot whose rolling mean "
                       "first-token KL exceeds TIMES x the model's first-token KL floor (dense in the served dtype vs "
                       f"the other, measured once per model and cached); 'off': no guard (default {QUALITY_BUDGET:g})")
    serve.add_argument("--guard-fraction", type=float, metavar="SHARE",
                       help=f"the share of such requests measured (default {GuardConfig.fraction}: at most "
                       f"{100 * GuardConfig.fraction:g} dense twins per 100 requests)")
    serve.add_argument("--no-tenant-per-key", dest="tenant_per_key", action="store_false",
                       help="with vLLM's --api-key: one tenant for all keys (default: each key its own tenant)")
    check = sub.add_parser("selfcheck", help="RoPE realignment self-check on a model")
    check.add_argument("--model", help="local transformers model folder (default: the embedded model)")
    _add_dtype_option(check)
    check.add_argument("--json", action="store_true")
    from kvcomm.eval.cli_eval import add_eval_parser
    from kvcomm.eval.frontier import add_arguments as add_frontier_arguments
    from kvcomm.eval.paired import add_arguments as add_paired_arguments

    add_eval_parser(sub)
    add_frontier_arguments(sub.add_parser("frontier", help="KL-vs-reuse table and chart over several `kvcomm eval` result folders"))
    add_paired_arguments(sub.add_parser("paired", help="two `kvcomm eval` runs compared on the calls both served the same way"))
    return parser


SERVE_EPILOG = """\
vLLM's flags: every flag kvcomm does not know goes to vLLM's OpenAI server (`vllm serve --help`
lists them); an unknown one is refused in one line. The common ones:
  --host HOST        listen address (kvcomm's default 127.0.0.1, loopback only; 0.0.0.0 with --api-key)
  --port PORT        (default 8000)
  --api-key K [K ...]  keys every route but /health and /ping needs, one flag for all keys; each key
                     is its own tenant unless --no-tenant-per-key ($VLLM_API_KEY if no flag)
  --max-model-len N  (kvcomm's default 2048), --dtype (kvcomm's default float32), --block-size N
kvcomm also sets, unless given: --enforce-eager, --enable-prompt-tokens-details,
--enable-per-request-metrics, --middleware (keys, tenants), --worker-extension-cls (plans made ahead)
and, with --state-dir, --shutdown-timeout. On a CPU it runs with VLLM_CPU_OMP_THREADS_BIND=nobind
and OMP_NUM_THREADS=1 unless set (on a large CPU host of its own, set them yourself)."""


def _host_default_gib() -> float:
    """``--max-total-bytes``' default on this host, in GiB (with the default capture budget)."""
    from kvcomm.integrations.vllm.connector.refusals import host_memory_budget

    return host_memory_budget(1 << 30) / (1 << 30)


DEMO_THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Environment of `kvcomm demo` on vLLM and `kvcomm serve` on a CPU unless the caller set these:
vLLM's CPU worker binds one OpenMP thread per core by default, and on a small machine shared with
other work those threads stall at barriers; one unbound thread does not. OpenMP reads them when
torch is first imported, so the command re-executes itself with them (``_thread_environment``).
On a large CPU host given to the server alone, set both yourself (e.g. ``OMP_NUM_THREADS`` to the
cores vLLM may use)."""


def _thread_environment(argv: list[str]) -> None:
    """Re-execute `kvcomm demo` (vLLM backend) or `kvcomm serve` (on a CPU) with
    :data:`DEMO_THREADS` set when they are not (command-line entry point only); returns without
    doing anything otherwise."""
    import os

    if os.environ.get("KVCOMM_DEMO_REEXEC") or all(k in os.environ for k in DEMO_THREADS):
        return
    if "--help" in argv or "-h" in argv:
        return
    if argv[:1] == ["demo"] and ("--backend" in argv and argv[argv.index("--backend") + 1:][:1] == ["transformers"]
                                 or "--backend=transformers" in argv):
        return
    if argv[:1] == ["serve"]:
        import torch

        if torch.cuda.is_available():
            return
    env = {**DEMO_THREADS, **os.environ, "KVCOMM_DEMO_REEXEC": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvcomm.cli", *argv], env)


def _guard_budget(args, vllm_args: list[str]) -> float | None:
    """`kvcomm serve`'s guard budget in nats: ``--quality-budget`` x the served model's
    first-token KL floor (``kvcomm.eval.kl_floor``, cached), or None with 'off'."""
    if args.quality_budget is None:
        return None
    from kvcomm.eval.kl_floor import kl_floor

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtype", default="float32")  # serve_argv's default
    return args.quality_budget * kl_floor(args.model, parser.parse_known_args(vllm_args)[0].dtype).kl_mean


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] in (["demo"], ["serve"]):
        _thread_environment(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        args, vllm_args = build_parser().parse_known_args(argv)
    else:
        args, vllm_args = build_parser().parse_args(argv), []
    try:
        if args.command == "serve":
            args.guard_budget = _guard_budget(args, vllm_args)
            return serve_command(args, vllm_args)
        if args.command == "selfcheck":
            return _cmd_selfcheck(args)
        if args.command == "eval":
            return args.eval_command(args)
        if args.command == "frontier":
            from kvcomm.eval.frontier import run_frontier_command

            return run_frontier_command(args)
        if args.command == "paired":
            from kvcomm.eval.paired import run_paired_command

            return run_paired_command(args)
        spec = load_bundled_pipeline(DEMO_PIPELINE) if args.command == "demo" else load_pipeline(args.pipeline)
        if args.limit is not None:
            if args.limit < 1:
                raise ValueError(f"--limit must be >= 1, got {args.limit}")
            spec = dataclasses.replace(spec, inputs=spec.inputs[: args.limit])
        if args.command == "demo":
            return _cmd_demo(args, spec)
        return _cmd_run(args, spec)
    except (PipelineError, RopeError, FileNotFoundError, ValueError) as error:
        print(f"kvcomm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
