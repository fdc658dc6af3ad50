"""The `kvcomm` command: run pipelines dense vs reuse side by side, the demo, the RoPE self-check, serve over HTTP."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tqdm import tqdm

from kvcomm.anchors.pool import PoolConfig
from kvcomm.engine.engine import BASE_SOURCES, ReuseConfig, ReuseEngine
from kvcomm.engine.pipeline import PipelineError, PipelineSpec, load_bundled_pipeline, load_pipeline
from kvcomm.core.rope import RopeError
from kvcomm.engine.runner import run_row

BACKENDS = ("transformers", "vllm")


def load_executor(model: str | None, backend: str = "transformers", dtype: str = "float32"):
    """(executor, model path) for ``model`` or the embedded model: the transformers
    reference, or vLLM in-process with the kvcomm connector (``backend="vllm"``).

    dtype: the model dtype (``embedded.DTYPES``). With vLLM, the engine runs in it and the
    transformers copy that only checks RoPE and renders prompts stays float32."""
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, parse_dtype, resolve_model_dir
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    parse_dtype(dtype)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    path = resolve_model_dir(model)
    hf_model, tokenizer = load_model_and_tokenizer(str(path), "float32" if backend == "vllm" else dtype)
    if backend == "vllm":
        from kvcomm.integrations.vllm.engine import make_llm
        from kvcomm.integrations.vllm.executor import VllmExecutor

        return VllmExecutor(make_llm(str(path), dtype=dtype), hf_model, tokenizer), str(path)
    return TransformersExecutor(hf_model, tokenizer), str(path)


def run_side_by_side(spec: PipelineSpec, executor, config: ReuseConfig, progress: bool = True):
    """Every input row dense, then with reuse (one engine across rows), interleaved row by row.

    Returns (dense calls, reuse calls, engine)."""
    engine = ReuseEngine(executor.rotary, config)
    dense, reuse = [], []
    bar = tqdm(total=2 * len(spec.inputs) * len(spec.agents), desc="agent calls", disable=not progress, file=sys.stderr)
    for row in range(len(spec.inputs)):
        dense += run_row(spec, row, executor, None, on_call=lambda _: bar.update())
        reuse += run_row(spec, row, executor, engine, on_call=lambda _: bar.update())
    bar.close()
    return dense, reuse, engine


def _cmd_run(args, spec: PipelineSpec) -> int:
    from kvcomm.eval.report import compare, format_table, to_json

    executor, model_path = load_executor(args.model, args.backend, args.dtype)
    config = ReuseConfig(pool=PoolConfig(gamma=args.gamma, max_anchors=args.max_anchors), base_source=args.base_source)
    dense, reuse, engine = run_side_by_side(spec, executor, config, progress=not args.json)
    calls = compare(dense, reuse)
    if args.json:
        meta = {"model": model_path, "backend": args.backend, "dtype": args.dtype, "gamma": args.gamma, "max_anchors": args.max_anchors,
                "base_source": args.base_source,
                "anchors": {slot: len(pool) for slot, pool in engine.pools.items()}}
        print(json.dumps(to_json(calls, meta), indent=2))
    else:
        print(format_table(calls))
        print(f"anchors per slot: {', '.join(f'{s}={len(p)}' for s, p in engine.pools.items())}")
    return 0


DEMO_PIPELINE = "review"
DEMO_GAMMA = 1.0
DEMO_CHART = "kvcomm-demo.png"


def _cmd_demo(args, spec: PipelineSpec) -> int:
    """The demo: ``spec`` through the baseline and through kvcomm (``integrations/demo.py``);
    prints the per-agent table and headline figures (or ``--json``) and writes the chart."""
    import os

    from kvcomm.eval.demo_report import demo_json, format_demo, write_chart
    from kvcomm.integrations.demo import DenseTransformers, StockVllm, run_demo

    chart = Path(args.chart)
    if not chart.resolve().parent.is_dir():
        raise ValueError(f"--chart {args.chart}: folder {chart.resolve().parent} does not exist; create it or pick another path")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported: keep the demo's output readable
    executor, model_path = load_executor(args.model, args.backend)
    baseline = StockVllm(executor.llm, executor.stop_ids) if args.backend == "vllm" else DenseTransformers(executor)
    config = ReuseConfig(pool=PoolConfig(gamma=args.gamma, max_anchors=args.max_anchors), base_source=args.base_source)
    calls, engine = run_demo(spec, executor, baseline, config)
    meta = {"model": model_path, "backend": args.backend, "baseline": baseline.name, "gamma": args.gamma,
            "max_anchors": args.max_anchors, "base_source": args.base_source,
            "anchors": {slot: len(pool) for slot, pool in engine.pools.items()}, "chart": str(chart.resolve())}
    report = demo_json(calls, meta)
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


MIDDLEWARE = "kvcomm.integrations.serve.middleware.KvcommTenantMiddleware"
STATE_SHUTDOWN_TIMEOUT_S = 30
"""With --state-dir: vLLM's --shutdown-timeout (seconds the engine may take to stop) unless given."""


def serve_argv(
    model: str | None, plan: bool, slots: list[str] | None, vllm_args: list[str], engine: dict | None = None,
) -> list[str]:
    """vLLM OpenAI server arguments (``sys.argv`` of its API server entry point) for the model with the kvcomm connector (server-side planning
    of annotated requests on unless ``plan`` is False; ``engine``: more ``kv_connector_extra_config``
    such as gamma, max_anchors, byte caps) and kvcomm's tenant middleware; ``vllm_args`` pass through and win."""
    from kvcomm.integrations.transformers.embedded import resolve_model_dir
    from kvcomm.integrations.vllm.engine import CONNECTOR, CONNECTOR_MODULE

    extra: dict = {"plan": plan, **(engine or {})}
    if slots:
        extra["slots"] = slots
    config = {"kv_connector": CONNECTOR, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE,
              "kv_connector_extra_config": extra}
    argv = ["kvcomm serve", "--model", str(resolve_model_dir(model)), "--kv-transfer-config", json.dumps(config)]
    given = {a.split("=", 1)[0] for a in vllm_args if a.startswith("--")}
    for flag, value in (("--dtype", "float32"), ("--max-model-len", "2048")):
        if flag not in given:
            argv += [flag, value]
    for flag in ("--enforce-eager", "--enable-prompt-tokens-details"):
        if flag not in given:
            argv.append(flag)
    if (engine or {}).get("state_dir") and "--shutdown-timeout" not in given:
        # vLLM's default (0) force-kills the engine-core process at once on shutdown, before
        # the planner there can write its save at exit.
        argv += ["--shutdown-timeout", str(STATE_SHUTDOWN_TIMEOUT_S)]
    if plan:
        argv += ["--middleware", MIDDLEWARE]
    return argv + vllm_args


def api_keys(vllm_args: list[str]) -> list[str]:
    """The API keys vLLM will accept: ``--api-key K [K ...]`` (repeatable) or ``$VLLM_API_KEY``."""
    import os

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--api-key", nargs="+", action="extend", default=[])
    keys = [k for k in parser.parse_known_args(vllm_args)[0].api_key if k]
    return keys or [k for k in [os.environ.get("VLLM_API_KEY", "")] if k]


def _cmd_serve(args, vllm_args: list[str]) -> int:
    import os

    # On CPU, vLLM runs its worker in a process of its own unless multiprocessing is off; the
    # connector's scheduler and worker sides must share the engine-core process (vllm.channel).
    # The engine core still runs apart from the API server.
    for name in ("max_tenant_bytes", "max_total_bytes"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of bytes, got {getattr(args, name)}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvcomm.integrations.serve.middleware import KEY_DIGESTS_ENV, key_digest

    keys = api_keys(vllm_args)
    os.environ[KEY_DIGESTS_ENV] = ",".join(key_digest(k) for k in keys) if args.tenant_per_key else ""
    # vLLM's own `vllm` CLI looks up the version of a distribution named "vllm", which
    # vllm-cpu is not; its API server entry point has no such lookup.
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()  # the connector's metrics live in the engine process
    if not args.save_interval > 0:
        raise ValueError(f"--save-interval must be a positive number of seconds, got {args.save_interval}")
    engine = {"gamma": args.gamma, "max_anchors": args.max_anchors,
              "max_tenant_bytes": args.max_tenant_bytes, "max_total_bytes": args.max_total_bytes}
    if args.state_dir:
        engine |= {"state_dir": str(Path(args.state_dir).resolve()), "save_interval_s": args.save_interval}
    sys.argv = serve_argv(args.model, not args.no_plan, args.slots, vllm_args, engine)
    shown = [("<hidden>" if a in keys else a) for a in sys.argv]
    tenants = f"{len(keys)} API keys, one tenant each" if keys and args.tenant_per_key else "one tenant"
    print(f"kvcomm: {tenants}; " + " ".join(shown), file=sys.stderr)
    vllm_main()
    return 0


def _cmd_selfcheck(args) -> int:
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, resolve_model_dir
    from kvcomm.integrations.transformers.rotary import rotary_from_model

    path = resolve_model_dir(args.model)
    model, _ = load_model_and_tokenizer(str(path), args.dtype)
    try:
        rotary, check = rotary_from_model(model)
    except RopeError as error:
        result = {"model": str(path), "dtype": args.dtype, "passed": False, "error": str(error)}
    else:
        result = {"model": str(path), "dtype": args.dtype, "passed": True, "max_abs_error": check.max_abs_error,
                  "layer0_abs_error": check.layer0_abs_error, "key_scale": check.key_scale,
                  "tolerance": check.tolerance * max(1.0, check.key_scale),
                  "rotary_dim": rotary.rotary_dim, "head_dim": rotary.head_dim,
                  "pairing": "interleaved" if rotary.interleaved else "half-split",
                  "attention_scaling": rotary.attention_scaling}
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["passed"]:
        print(f"RoPE self-check passed for {path} in {args.dtype}: max abs realignment error "
              f"{result['max_abs_error']:.3g} over all layers (tolerance {result['tolerance']:.3g}; layer 0: "
              f"{result['layer0_abs_error']:.3g}; keys up to {result['key_scale']:.3g}), "
              f"{result['pairing']} pairing, rotary dim {result['rotary_dim']}/{result['head_dim']}")
    else:
        print(f"RoPE self-check FAILED: {result['error']}", file=sys.stderr)
    return 0 if result["passed"] else 1


def _add_dtype_option(parser: argparse.ArgumentParser) -> None:
    from kvcomm.integrations.transformers.embedded import DTYPES

    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="model dtype: weights, activations and KV cache (default float32)")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", choices=BACKENDS, default="transformers")
    _add_dtype_option(parser)
    parser.add_argument("--gamma", type=float, default=PoolConfig.gamma, help="admission entropy threshold factor")
    parser.add_argument("--max-anchors", type=int, default=PoolConfig.max_anchors, help="V, anchors per pool")
    parser.add_argument("--base-source", choices=BASE_SOURCES, default=ReuseConfig.base_source,
                        help="new shared content's base KV: a standalone prefill, or its KV in the first prompt "
                        "that computes it (no extra forward pass)")
    parser.add_argument("--limit", type=int, help="run only the first N input rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/reference.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline JSON dense and with reuse, side by side")
    run.add_argument("pipeline", help="pipeline JSON file")
    _add_run_options(run)
    demo = sub.add_parser("demo", help="the bundled document-review pipeline through kvcomm and through stock vLLM "
                          "(prefix caching on) side by side, with a chart")
    _add_run_options(demo)
    # The demo's own settings, whatever the library defaults: the vLLM server's base source
    # (first_use), and gamma 1 (reuse whenever two compatible anchors exist), since the five
    # bundled documents differ in content and a lower gamma may compute them all.
    demo.set_defaults(backend="vllm", gamma=DEMO_GAMMA, base_source="first_use")
    demo.add_argument("--chart", default=DEMO_CHART, help=f"where to write the PNG chart (default: {DEMO_CHART})")
    serve = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with the kvcomm plugin (other args go to vLLM)")
    serve.add_argument("--model", help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--no-plan", action="store_true", help="no server-side planning of annotated requests")
    serve.add_argument("--slots", nargs="+", help="the slot names annotations may use (default: any)")
    serve.add_argument("--gamma", type=float, default=PoolConfig.gamma, help="admission entropy threshold factor")
    serve.add_argument("--max-anchors", type=int, default=PoolConfig.max_anchors, help="V, anchors per pool")
    serve.add_argument("--max-tenant-bytes", type=int, help="byte cap of each tenant's pools, bases and prefixes")
    serve.add_argument("--max-total-bytes", type=int, help="byte cap of all tenants together")
    serve.add_argument("--state-dir", help="keep anchor pools and bases here across restarts (restored at start, "
                       "saved every --save-interval seconds and at exit; gives vLLM --shutdown-timeout "
                       f"{STATE_SHUTDOWN_TIMEOUT_S} unless set, so the engine lives long enough to save)")
    serve.add_argument("--save-interval", type=float, default=60.0, help="seconds between saves of --state-dir (default 60)")
    serve.add_argument("--no-tenant-per-key", dest="tenant_per_key", action="store_false",
                       help="with vLLM's --api-key: one tenant for all keys (default: each key its own tenant)")
    check = sub.add_parser("selfcheck", help="RoPE realignment self-check on a model")
    check.add_argument("--model", help="local transformers model folder (default: the embedded model)")
    _add_dtype_option(check)
    check.add_argument("--json", action="store_true")
    from kvcomm.eval.cli_eval import add_eval_parser

    add_eval_parser(sub)
    return parser


DEMO_THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Environment of `kvcomm demo` on vLLM unless the caller set these: vLLM's CPU worker binds one
OpenMP thread per core by default, and on a small machine shared with other work those threads
stall at barriers; one unbound thread does not. OpenMP reads them when torch is first
imported, so the command re-executes itself with them (``_demo_environment``)."""


def _demo_environment(argv: list[str]) -> None:
    """Re-execute `kvcomm demo` with :data:`DEMO_THREADS` set when they are not (vLLM backend
    only, command-line entry point only); returns without doing anything otherwise."""
    import os

    if os.environ.get("KVCOMM_DEMO_REEXEC") or all(k in os.environ for k in DEMO_THREADS):
        return
    if "--backend" in argv and argv[argv.index("--backend") + 1:][:1] == ["transformers"] or "--backend=transformers" in argv:
        return
    env = {**DEMO_THREADS, **os.environ, "KVCOMM_DEMO_REEXEC": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvcomm.integrations.cli", *argv], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["demo"]:
        _demo_environment(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        args, vllm_args = build_parser().parse_known_args(argv)
    else:
        args, vllm_args = build_parser().parse_args(argv), []
    try:
        if args.command == "serve":
            return _cmd_serve(args, vllm_args)
        if args.command == "selfcheck":
            return _cmd_selfcheck(args)
        if args.command == "eval":
            return args.eval_command(args)
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
