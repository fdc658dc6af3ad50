"""`kvcomm serve` arguments and the vLLM backend's option checks (no engine started)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcomm.cli import build_parser, main
from kvcomm.integrations.serve.command import serve_argv


def test_serve_loads_the_connector_and_passes_vllm_args_through():
    args, rest = build_parser().parse_known_args(["serve", "--slots", "task", "planner", "--port", "8001", "--dtype", "bfloat16"])
    argv = serve_argv(args.model, not args.no_plan, args.slots, rest)
    assert argv[:2] == ["kvcomm serve", "--model"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvcommConnector" and config["kv_role"] == "kv_both"
    assert config["kv_connector_module_path"] == "kvcomm.integrations.vllm.connector"
    assert config["kv_connector_extra_config"] == {"plan": True, "slots": ["task", "planner"]}
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"  # the user's value wins
    assert argv[-2:] == ["--dtype", "bfloat16"] and "--port" in argv


def test_eval_on_vllm_refuses_kl_and_cacheblend_with_a_clear_error(tmp_path, capsys):
    assert main(["eval", "--workload", "mmlu", "--out", str(tmp_path / "o"), "--backend", "vllm"]) == 2
    assert "--no-kl" in capsys.readouterr().err


def test_serve_adds_tenant_middleware_and_reads_api_keys(monkeypatch):
    from kvcomm.integrations.serve.command import MIDDLEWARE, WORKER_EXTENSION

    argv = serve_argv(None, True, None, ["--api-key", "k1", "k2"], {"gamma": 1.0, "max_tenant_bytes": 1 << 20})
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE and "--enable-prompt-tokens-details" in argv
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"plan": True, "gamma": 1.0, "max_tenant_bytes": 1 << 20}
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION  # preambles plan ahead through it
    # --no-plan: no planning, but API keys on every route and the tenants' cache salts still
    assert "--middleware" in serve_argv(None, False, None, [])
    assert "--worker-extension-cls" not in serve_argv(None, False, None, [])


def test_serve_reads_api_keys_as_vllm_does_in_every_form_and_refuses_repeated_flags(monkeypatch):
    """Issue 48: with `--api-key A --api-key B` vLLM kept only B while kvcomm accepted both, so A
    got 401 on vLLM's routes and 200 on /invocations and /metrics. The keys are now what vLLM's
    own parser reads; an option given twice (in any spelling) is refused before the server starts."""
    from kvcomm.integrations.serve.vllm_args import VllmArgsError, accepted_keys, read_vllm_args

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    base = serve_argv(None, True, None, [])[1:]
    for form, keys in ((["--api-key", "k1", "k2"], ["k1", "k2"]), (["--api-key=k1"], ["k1"]), (["--api_key", "k1"], ["k1"]),
                       (["--api-ke", "k1"], ["k1"]), ([], [])):
        assert accepted_keys(read_vllm_args(base + form)) == keys, form
    for form in (["--api-key", "a", "--api-key", "b"], ["--api-key=a", "--api-key=b"], ["--api-key", "a", "--api_key", "b"],
                 ["--api-key=a", "--api-ke", "b"]):
        with pytest.raises(VllmArgsError, match="given 2 times.*--api-key KEY1 KEY2"):
            read_vllm_args(base + form)
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert accepted_keys(read_vllm_args(base)) == ["env-key"]
    assert accepted_keys(read_vllm_args(base + ["--api-key", "k1"])) == ["k1"]  # vLLM's rule: the flag wins


def test_serve_refuses_an_unknown_flag_in_one_line(capsys):
    """A typo printed vLLM's whole usage before the error (issue 49); now one line from kvcomm."""
    assert main(["serve", "--gama", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --gama" in err and len(err.strip().splitlines()) == 1, err


def test_serve_refuses_a_non_positive_byte_cap(capsys):
    assert main(["serve", "--max-tenant-bytes", "0"]) == 2
    assert "--max-tenant-bytes must be a positive number of bytes" in capsys.readouterr().err


def _connector(kv_extra=None, **parallel):
    """The kvcomm connector built by vLLM's own config classes with ``parallel`` settings
    (what vLLM's scheduler does at engine start); no engine runs."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcomm.integrations.vllm.connector import KvcommConnector
    from kvcomm.integrations.vllm.wire.config import transfer_config

    config = VllmConfig(parallel_config=ParallelConfig(**parallel), kv_transfer_config=transfer_config(extra=kv_extra))
    full = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    return KvcommConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=groups))


def test_the_connector_refuses_pipeline_parallel_engines_and_accepts_both_executors(monkeypatch):
    """Pipeline parallelism is refused (the connector turns itself off with the reason; vLLM
    goes on serving requests that did not opt in), tensor parallelism accepted. The one-process
    executor and vLLM's default multiprocess one (which vLLM picks on CPU unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0) are both accepted."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert "pipeline_parallel_size 1 only" in (_connector(pipeline_parallel_size=2).refused or "")
    assert _connector(tensor_parallel_size=2, distributed_executor_backend="mp").refused is None
    accepted = _connector(distributed_executor_backend="uni")
    assert accepted.engine_id and accepted.refused is None
    assert _connector(distributed_executor_backend="mp").refused is None
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default: the worker in a process of its own
    assert _connector(distributed_executor_backend="uni").refused is None


def test_serve_passes_the_reuse_scope_to_the_connector_and_it_refuses_an_unknown_one_at_start():
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.scopes import SCOPES
    from kvcomm.integrations.serve.command import engine_settings

    parse = build_parser().parse_known_args
    assert "reuse_scope" not in engine_settings(parse(["serve"])[0])  # the default: nothing to pass
    extra = engine_settings(parse(["serve", "--reuse-scope", "content"])[0])
    assert extra["reuse_scope"] == "content"
    scope = SCOPES[ReuseConfig(scope=extra["reuse_scope"]).scope]
    assert scope.compute_trailing_text and scope.decode_reply_bases
    assert engine_settings(parse(["serve", "--reuse-scope", "all"])[0])["reuse_scope"] == "all"  # no longer the default
    with pytest.raises(ValueError, match="unknown reuse scope 'everything'; valid: all, all-reader-replies, content"):
        _connector(kv_extra={"reuse_scope": "everything"})


def test_a_state_dir_gives_the_engine_time_to_save_at_exit():
    """vLLM's default --shutdown-timeout 0 force-kills the engine-core process at once, before
    the save at exit: with --state-dir, `kvcomm serve` asks for a grace period; the user's own
    value wins."""
    from kvcomm.integrations.serve.command import STATE_SHUTDOWN_TIMEOUT_S

    state = {"state_dir": "/tmp/state", "save_interval_s": 60.0}
    argv = serve_argv(None, True, None, [], state)
    assert argv[argv.index("--shutdown-timeout") + 1] == str(STATE_SHUTDOWN_TIMEOUT_S) and STATE_SHUTDOWN_TIMEOUT_S > 0
    mine = serve_argv(None, True, None, ["--shutdown-timeout", "5"], state)
    assert mine.count("--shutdown-timeout") == 1 and mine[-2:] == ["--shutdown-timeout", "5"]
    assert "--shutdown-timeout" not in serve_argv(None, True, None, [], {"gamma": 1.0})  # no state: vLLM's default


def test_a_state_dir_gives_the_worker_process_time_to_save_at_exit_inside_the_engines_own_budget():
    """Under vLLM's multiprocess engine the save at exit runs in the worker. vLLM's API server
    gives the engine-core process --shutdown-timeout seconds, then SIGKILLs its process tree
    (worker included) and still exits 0; the engine core gives its worker
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, then needs seconds of its own. Both were 30 s, so a
    save at exit that ran long on a busy machine was killed without a trace (CI: a tenant's
    manifest unchanged after a clean stop). The worker's grace must nest inside the engine's
    budget with ENGINE_TEARDOWN_S to spare, for the default and for a user's --shutdown-timeout;
    a user's worker grace that does not nest is kept and warned about; nothing without a state folder."""
    from kvcomm.integrations.serve.command import (
        ENGINE_TEARDOWN_S, STATE_SHUTDOWN_TIMEOUT_S, WORKER_SHUTDOWN_ENV, shutdown_timeout, state_environment,
    )

    environ: dict = {}
    assert state_environment(None, environ) is None and environ == {}
    assert state_environment("/tmp/state", environ) is None
    worker = float(environ[WORKER_SHUTDOWN_ENV])
    assert worker >= 30 and worker + ENGINE_TEARDOWN_S <= STATE_SHUTDOWN_TIMEOUT_S and ENGINE_TEARDOWN_S >= 10
    theirs: dict = {}
    assert state_environment("/tmp/state", theirs, shutdown_timeout(["--port", "1", "--shutdown-timeout", "200"])) is None
    assert float(theirs[WORKER_SHUTDOWN_ENV]) == 200 - ENGINE_TEARDOWN_S
    mine = {WORKER_SHUTDOWN_ENV: "7"}
    assert state_environment("/tmp/state", mine) is None and mine == {WORKER_SHUTDOWN_ENV: "7"}
    tight = {WORKER_SHUTDOWN_ENV: "30"}
    warning = state_environment("/tmp/state", tight, 30)
    assert tight == {WORKER_SHUTDOWN_ENV: "30"} and "can be killed" in warning and ">= 60" in warning


@pytest.mark.parametrize("value", ["inf", "1e999", "nan", "0", "-5", "soon"])
def test_a_save_interval_that_would_never_save_is_refused_when_parsed(value, capsys):
    """`--save-interval inf` was accepted and the saver then died of an OverflowError, saving
    nothing; NaN, zero and negatives make no sense either: argparse refuses them, naming the value."""
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["serve", "--state-dir", "/tmp/x", "--save-interval", value])
    assert f"{value!r} is not a positive, finite number of seconds" in capsys.readouterr().err
    assert build_parser().parse_known_args(["serve", "--save-interval", "0.5"])[0].save_interval == 0.5


def test_api_keys_are_hidden_in_the_printed_command_line_in_every_spelling():
    from kvcomm.integrations.serve.command import hidden

    keys = ["sk-one", "sk-two"]
    argv = ["kvcomm serve", "--api-key=sk-one", "--api-key", "sk-two", "--port", "8000"]
    shown = " ".join(hidden(argv, keys))
    assert "sk-one" not in shown and "sk-two" not in shown and "--port 8000" in shown


def test_serve_passes_the_capture_budget_to_the_connector():
    from kvcomm.integrations.serve.command import engine_settings

    parse = build_parser().parse_known_args
    assert "max_capture_bytes" not in engine_settings(parse(["serve"])[0])  # the connector's default
    assert engine_settings(parse(["serve", "--max-capture-bytes", "1048576"])[0])["max_capture_bytes"] == 1 << 20


def _vllm_parsed(argv: list[str]):
    """``argv`` (``serve_argv``'s) as vLLM's own API server parses and validates it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[1:])
    validate_parsed_serve_args(args)
    return args


def test_serve_listens_on_loopback_and_reports_ttft_unless_told_otherwise():
    """vLLM binds every interface and leaves per-request metrics (the TTFT the remote clients
    report) off by default; `kvcomm serve` listens on 127.0.0.1 and turns the metrics on, and
    the user's --host, or --disable-log-stats (which vLLM refuses next to them), win."""
    from kvcomm.integrations.serve.command import DEFAULT_HOST

    args = _vllm_parsed(serve_argv(None, True, None, ["--port", "8001"]))
    assert DEFAULT_HOST == "127.0.0.1" and args.host == DEFAULT_HOST and args.enable_per_request_metrics
    args = _vllm_parsed(serve_argv(None, True, None, ["--host", "0.0.0.0"]))
    assert args.host == "0.0.0.0" and args.enable_per_request_metrics
    argv = serve_argv(None, True, None, ["--host=::1", "--disable-log-stats"])
    assert argv.count("--host") == 0 and "--enable-per-request-metrics" not in argv
    args = _vllm_parsed(argv)
    assert args.host == "::1" and not args.enable_per_request_metrics


@pytest.mark.parametrize("argv, reexec", [(["serve", "--port", "1"], True), (["demo"], True),
                                          (["demo", "--backend", "transformers"], False), (["serve", "--help"], False)])
def test_serve_and_demo_apply_the_cpu_thread_settings_unless_set(monkeypatch, argv, reexec):
    """Issue 48: `kvcomm serve` on a CPU ran with vLLM's one bound OpenMP thread per core, which
    `kvcomm demo` avoids; a user following the docs lost on wall time until they set them by hand.
    Both now re-execute themselves with DEMO_THREADS unless the caller set them."""
    import os

    from kvcomm import cli

    calls = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append((args, env)))
    for name in (*cli.DEMO_THREADS, "KVCOMM_DEMO_REEXEC"):
        monkeypatch.delenv(name, raising=False)
    cli._thread_environment(argv)
    assert bool(calls) == reexec
    if reexec:
        args, env = calls[0]
        assert args[-len(argv):] == argv and all(env[k] == v for k, v in cli.DEMO_THREADS.items())
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")
    calls.clear()
    cli._thread_environment(argv)
    assert calls == []  # the user's own settings win


def test_the_start_up_line_says_what_kvcomm_holds_at_most():
    from kvcomm.integrations.serve.command import memory_line

    line = memory_line(5 << 30, True, None)
    assert "reuse state capped at 5.0 GiB (the default)" in line and "captures in flight at 1.0 GiB" in line
    assert "kvcomm holds at most 6.0 GiB beside vLLM" in line
    assert "(the default)" not in memory_line(5 << 30, False, 1 << 29) and "at most 5.5 GiB" in memory_line(5 << 30, False, 1 << 29)
    assert "accelerator" in memory_line(None, True, None)
