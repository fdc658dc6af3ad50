"""The `kvcomm serve` command: vLLM's OpenAI API server with the kvcomm connector and tenant
middleware (``serve_argv``), checked by vLLM's own parser before it starts (``serve.vllm_args``:
unknown flags, the API keys), and the command itself (``serve_command``; its options are parsed
by ``kvcomm.cli``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvcomm.integrations.vllm.wire.config import WORKER_SHUTDOWN_ENV, WORKER_SHUTDOWN_S
from kvcomm.reuse.scopes import DEFAULT_SCOPE
from kvcomm.services.quality_guard import GuardConfig


MIDDLEWARE = "kvcomm.integrations.serve.middleware.KvcommTenantMiddleware"
WORKER_EXTENSION = "kvcomm.integrations.vllm.connector.worker_extension.KvcommWorkerExtension"
DEFAULT_HOST = "127.0.0.1"
"""Where `kvcomm serve` listens unless ``--host`` is given: loopback only (vLLM's own default
binds every interface). ``--host 0.0.0.0`` serves other machines; pair it with ``--api-key``."""
ENGINE_TEARDOWN_S = 30
"""Seconds the engine-core process is given on top of its worker's grace: vLLM's 4 s from the
worker's SIGTERM to its SIGKILL, then the engine core's own teardown (3-8 s measured on an idle
2-core CPU, more under load)."""
STATE_SHUTDOWN_TIMEOUT_S = WORKER_SHUTDOWN_S + ENGINE_TEARDOWN_S
"""With --state-dir: vLLM's --shutdown-timeout unless given. vLLM's API server gives the
engine-core process this long to exit, then SIGKILLs its whole process tree, worker included,
and still exits with status 0; so it must exceed the worker's grace by ``ENGINE_TEARDOWN_S``,
or a save at exit that runs long is cut short without a trace (the worker's grace and this
timeout were once both 30 s)."""



def shutdown_timeout(vllm_args: list[str]) -> float | None:
    """The ``--shutdown-timeout`` among vLLM's arguments (None: not given)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--shutdown-timeout", type=float)
    return parser.parse_known_args(vllm_args)[0].shutdown_timeout


def state_environment(state_dir: str | None, environ: dict, engine_timeout_s: float = STATE_SHUTDOWN_TIMEOUT_S) -> str | None:
    """With a state folder, give vLLM's worker processes ``engine_timeout_s - ENGINE_TEARDOWN_S``
    seconds to exit (``WORKER_SHUTDOWN_ENV`` in ``environ``, which they inherit) unless the user
    set it. ``engine_timeout_s``: vLLM's --shutdown-timeout. Returns a warning when the two do
    not nest (a save at exit may then be killed), else None."""
    if not state_dir:
        return None
    if WORKER_SHUTDOWN_ENV not in environ:
        environ[WORKER_SHUTDOWN_ENV] = str(max(1, int(engine_timeout_s - ENGINE_TEARDOWN_S)))
    worker = float(environ[WORKER_SHUTDOWN_ENV])
    if worker + ENGINE_TEARDOWN_S > engine_timeout_s:
        return (f"kvcomm: warning: {WORKER_SHUTDOWN_ENV}={environ[WORKER_SHUTDOWN_ENV]} and --shutdown-timeout "
                f"{engine_timeout_s:g} leave the engine core less than {ENGINE_TEARDOWN_S} s after its worker's grace: "
                f"a long save at exit can be killed; give --shutdown-timeout >= {worker + ENGINE_TEARDOWN_S:g}")
    return None


def save_interval(text: str) -> float:
    """``--save-interval``: a positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive, finite number of seconds (saves at exit happen anyway; "
            "for rare saves give a large number such as 86400)")
    return value


def hidden(argv: list[str], keys: list[str]) -> list[str]:
    """``argv`` for printing: API keys, given as ``--api-key K`` or ``--api-key=K``, as ``<hidden>``."""
    out = []
    for arg in argv:
        if arg.startswith("--api-key="):
            out.append("--api-key=<hidden>")
        elif arg in keys or any(k and k in arg for k in keys):
            out.append("<hidden>")
        else:
            out.append(arg)
    return out


def serve_argv(
    model: str | None, plan: bool, slots: list[str] | None, vllm_args: list[str], engine: dict | None = None,
) -> list[str]:
    """vLLM OpenAI server arguments (``sys.argv`` of its API server entry point) for the model with the kvcomm connector (server-side planning
    of annotated requests on unless ``plan`` is False; ``engine``: more ``kv_connector_extra_config``
    such as gamma, max_anchors, byte caps) and kvcomm's tenant middleware; ``vllm_args`` pass through and win.
    Unless given: ``--host 127.0.0.1`` (``DEFAULT_HOST``) and per-request metrics (TTFT in every
    response), besides fp32, a 2,048-token context, eager mode and prompt token details."""
    from kvcomm.integrations.transformers.embedded import resolve_model_dir
    from kvcomm.integrations.vllm.wire.config import CONNECTOR, CONNECTOR_MODULE

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
    # the server's TTFT per request in each response (ChatCall.provenance.ttft_s of the remote
    # clients); vLLM refuses it next to --disable-log-stats
    if "--enable-per-request-metrics" not in given and "--disable-log-stats" not in given:
        argv.append("--enable-per-request-metrics")
    if "--host" not in given:
        argv += ["--host", DEFAULT_HOST]  # vLLM's default binds every interface
    if (engine or {}).get("state_dir") and "--shutdown-timeout" not in given:
        # vLLM's default (0) force-kills the engine-core process (and so its worker) at once on
        # shutdown, before the planner in the worker can write its save at exit; see
        # STATE_SHUTDOWN_TIMEOUT_S for why it exceeds the worker's grace.
        argv += ["--shutdown-timeout", str(STATE_SHUTDOWN_TIMEOUT_S)]
    argv += ["--middleware", MIDDLEWARE]  # keys on every route and tenants' salts, planning or not
    if plan and "--worker-extension-cls" not in given:  # preambles: the middleware plans ahead through it
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    return argv + vllm_args


def default_max_total_bytes(capture_bytes: int | None) -> int | None:
    """``--max-total-bytes`` when not given: on a CPU ``refusals.host_memory_budget`` (a quarter
    of host memory less the capture budget), decided here so that the context API's retained
    contexts count against the same cap as the worker's reuse state; on an accelerator None (the
    worker sizes it from the device memory vLLM leaves free, ``refusals.device_memory_budget``)."""
    from vllm.platforms import current_platform

    from kvcomm.integrations.vllm.connector.refusals import host_memory_budget
    from kvcomm.integrations.vllm.wire.config import DEFAULT_MAX_CAPTURE_BYTES

    if not current_platform.is_cpu():
        return None
    return host_memory_budget(DEFAULT_MAX_CAPTURE_BYTES if capture_bytes is None else capture_bytes)


def memory_line(cap: int | None, default: bool, capture_bytes: int | None) -> str:
    """What the start-up line says of kvcomm's memory: the reuse state's cap and the capture
    budget of the requests in flight, which together bound what kvcomm holds."""
    from kvcomm.integrations.vllm.wire.config import DEFAULT_MAX_CAPTURE_BYTES

    gib = 1 << 30
    captures = (DEFAULT_MAX_CAPTURE_BYTES if capture_bytes is None else capture_bytes) / gib
    if not cap:
        return (f"reuse state capped at 90% of the accelerator memory vLLM leaves free less the captures in flight "
                f"({captures:.1f} GiB)")
    return (f"reuse state capped at {cap / gib:.1f} GiB{' (the default)' if default else ''} and captures in flight at "
            f"{captures:.1f} GiB: kvcomm holds at most {cap / gib + captures:.1f} GiB beside vLLM")


def engine_settings(args, default_total_bytes: int | None = None) -> dict:
    """The connector's extra config from `kvcomm serve`'s own options (None values: the
    defaults; ``default_total_bytes``: ``--max-total-bytes`` when not given)."""
    total = default_total_bytes if args.max_total_bytes is None else args.max_total_bytes
    engine = {"gamma": args.gamma, "max_anchors": args.max_anchors,
              "max_tenant_bytes": args.max_tenant_bytes, "max_total_bytes": total}
    if getattr(args, "max_capture_bytes", None) is not None:
        engine["max_capture_bytes"] = args.max_capture_bytes
    if args.reuse_scope != DEFAULT_SCOPE:
        engine["reuse_scope"] = args.reuse_scope
    if args.state_dir:
        engine |= {"state_dir": str(Path(args.state_dir).resolve()), "save_interval_s": args.save_interval}
    budget, fraction = getattr(args, "guard_budget", None), getattr(args, "guard_fraction", None)
    if fraction is not None and budget is None:
        raise ValueError("--guard-fraction needs the quality guard: leave out --quality-budget off")
    if budget is not None:
        guard = GuardConfig(budget=budget, fraction=GuardConfig.fraction if fraction is None else fraction)  # checks both
        engine["guard"] = {"budget": guard.budget, "fraction": guard.fraction}
    return engine


def contexts_config(engine: dict, vllm_args: list[str]) -> str:
    """The context API's settings (``serve.contexts.CONFIG_ENV``, JSON): the byte caps retained
    contexts count against, the state folder their records are kept in, the served dtype."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtype", default="float32")  # serve_argv's default
    return json.dumps({"max_tenant_bytes": engine.get("max_tenant_bytes"), "max_total_bytes": engine.get("max_total_bytes"),
                       "state_dir": engine.get("state_dir"), "dtype": parser.parse_known_args(vllm_args)[0].dtype})


def serve_command(args, vllm_args: list[str]) -> int:
    """`kvcomm serve`: check the options (vLLM's with vLLM's own parser), set the environment,
    and run vLLM's API server with ``serve_argv``."""
    import os

    # vLLM's defaults apply: on CPU the engine core runs apart from the API server and its
    # worker in a process of its own (the connector plans in the worker and sends metadata
    # only, vllm.messages). VLLM_ENABLE_V1_MULTIPROCESSING=0, if the user sets it, keeps the
    # worker in the engine-core process instead; both are supported.
    for name in ("max_tenant_bytes", "max_total_bytes", "max_capture_bytes"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of bytes, got {getattr(args, name)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvcomm.integrations.serve.contexts import CONFIG_ENV as CONTEXTS_CONFIG_ENV
    from kvcomm.integrations.serve.preambles import PLAN_AHEAD_ENV
    from kvcomm.integrations.serve.middleware import API_KEY_DIGESTS_ENV, KEY_DIGESTS_ENV, key_digest
    from kvcomm.integrations.serve.vllm_args import accepted_keys, read_vllm_args

    save_interval(str(args.save_interval))  # also when called with a namespace built elsewhere
    engine = engine_settings(args, default_max_total_bytes(args.max_capture_bytes))
    argv = serve_argv(args.model, not args.no_plan, args.slots, vllm_args, engine)
    parsed = read_vllm_args(argv[1:])  # one-line errors before anything starts; the keys as vLLM reads them
    keys = accepted_keys(parsed)
    if parsed.api_key and os.environ.get("VLLM_API_KEY"):
        print("kvcomm: VLLM_API_KEY is ignored: --api-key is given (as vLLM does)", file=sys.stderr)
    digests = ",".join(key_digest(k) for k in keys)
    os.environ[API_KEY_DIGESTS_ENV] = digests  # every route needs a key, not only vLLM's guarded prefixes
    os.environ[KEY_DIGESTS_ENV] = digests if args.tenant_per_key else ""
    # vLLM's own `vllm` CLI looks up the version of a distribution named "vllm", which
    # vllm-cpu is not; its API server entry point has no such lookup.
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()  # the connector's metrics live in the engine-core and worker processes
    # prometheus_client picks where metric values live when it is first imported (vLLM imported
    # it above, before the directory was set): without this, the metrics this process creates
    # (vLLM's own TTFT and latency histograms, kvcomm's TTFT histogram) stay in its memory, which
    # /metrics (multiprocess mode: the directory only) never reads; this is the process's one
    # multiprocess value class (a second one would open its files twice: serve.contexts)
    import prometheus_client.values

    prometheus_client.values.ValueClass = prometheus_client.values.get_value_class()
    os.environ[CONTEXTS_CONFIG_ENV] = contexts_config(engine, vllm_args)
    given = shutdown_timeout(vllm_args)
    warning = state_environment(args.state_dir, os.environ, STATE_SHUTDOWN_TIMEOUT_S if given is None else given)
    if warning:
        print(warning, file=sys.stderr)
    os.environ[PLAN_AHEAD_ENV] = "0" if args.no_plan else "1"
    sys.argv = argv
    tenants = f"{len(keys)} API keys, one tenant each" if keys and args.tenant_per_key else "one tenant"
    memory = memory_line(engine["max_total_bytes"], args.max_total_bytes is None, args.max_capture_bytes)
    print(f"kvcomm: {tenants}; {memory}; " + " ".join(hidden(sys.argv, keys)), file=sys.stderr)
    vllm_main()
    return 0
