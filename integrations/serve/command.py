"""The `kvcomm serve` command: vLLM's OpenAI API server with the kvcomm connector and tenant
middleware (``serve_argv``), the API keys it accepts (``api_keys``), and the command itself
(``serve_command``; its options are parsed by ``kvcomm.cli``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcomm.reuse.scopes import DEFAULT_SCOPE


MIDDLEWARE = "kvcomm.integrations.serve.middleware.KvcommTenantMiddleware"
STATE_SHUTDOWN_TIMEOUT_S = 30
"""With --state-dir: vLLM's --shutdown-timeout (seconds the engine may take to stop) and
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (seconds a worker process may take to exit) unless given."""

WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
"""vLLM's grace period for a worker process at shutdown (default 5 s), then SIGTERM and, 4 s
later, SIGKILL: under vLLM's multiprocess engine the planner saves at exit in the worker, and a
save of a few tenants on a busy machine can take longer than that."""


def state_environment(state_dir: str | None, environ: dict) -> None:
    """With a state folder, give vLLM's worker processes ``STATE_SHUTDOWN_TIMEOUT_S`` to exit
    (``WORKER_SHUTDOWN_ENV`` in ``environ``, which they inherit) unless the user set it."""
    if state_dir:
        environ.setdefault(WORKER_SHUTDOWN_ENV, str(STATE_SHUTDOWN_TIMEOUT_S))


def serve_argv(
    model: str | None, plan: bool, slots: list[str] | None, vllm_args: list[str], engine: dict | None = None,
) -> list[str]:
    """vLLM OpenAI server arguments (``sys.argv`` of its API server entry point) for the model with the kvcomm connector (server-side planning
    of annotated requests on unless ``plan`` is False; ``engine``: more ``kv_connector_extra_config``
    such as gamma, max_anchors, byte caps) and kvcomm's tenant middleware; ``vllm_args`` pass through and win."""
    from kvcomm.integrations.transformers.embedded import resolve_model_dir
    from kvcomm.integrations.vllm.llm import CONNECTOR, CONNECTOR_MODULE

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
        # vLLM's default (0) force-kills the engine-core process (and so its worker) at once on
        # shutdown, before the planner in the worker can write its save at exit.
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


def engine_settings(args) -> dict:
    """The connector's extra config from `kvcomm serve`'s own options (None values: the defaults)."""
    engine = {"gamma": args.gamma, "max_anchors": args.max_anchors,
              "max_tenant_bytes": args.max_tenant_bytes, "max_total_bytes": args.max_total_bytes}
    if args.reuse_scope != DEFAULT_SCOPE:
        engine["reuse_scope"] = args.reuse_scope
    if args.state_dir:
        engine |= {"state_dir": str(Path(args.state_dir).resolve()), "save_interval_s": args.save_interval}
    return engine


def serve_command(args, vllm_args: list[str]) -> int:
    """`kvcomm serve`: check the options, set the environment, and run vLLM's API server with ``serve_argv``."""
    import os

    # vLLM's defaults apply: on CPU the engine core runs apart from the API server and its
    # worker in a process of its own (the connector plans in the worker and sends metadata
    # only, vllm.messages). VLLM_ENABLE_V1_MULTIPROCESSING=0, if the user sets it, keeps the
    # worker in the engine-core process instead; both are supported.
    for name in ("max_tenant_bytes", "max_total_bytes"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of bytes, got {getattr(args, name)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvcomm.integrations.serve.middleware import KEY_DIGESTS_ENV, key_digest

    keys = api_keys(vllm_args)
    os.environ[KEY_DIGESTS_ENV] = ",".join(key_digest(k) for k in keys) if args.tenant_per_key else ""
    # vLLM's own `vllm` CLI looks up the version of a distribution named "vllm", which
    # vllm-cpu is not; its API server entry point has no such lookup.
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()  # the connector's metrics live in the engine-core and worker processes
    if not args.save_interval > 0:
        raise ValueError(f"--save-interval must be a positive number of seconds, got {args.save_interval}")
    engine = engine_settings(args)
    state_environment(args.state_dir, os.environ)
    sys.argv = serve_argv(args.model, not args.no_plan, args.slots, vllm_args, engine)
    shown = [("<hidden>" if a in keys else a) for a in sys.argv]
    tenants = f"{len(keys)} API keys, one tenant each" if keys and args.tenant_per_key else "one tenant"
    print(f"kvcomm: {tenants}; " + " ".join(shown), file=sys.stderr)
    vllm_main()
    return 0
