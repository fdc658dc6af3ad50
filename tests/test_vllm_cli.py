"""`kvcomm serve` arguments and the vLLM backend's option checks (no engine started)."""

from __future__ import annotations

import json

from kvcomm.integrations.cli import build_parser, main, serve_argv


def test_serve_loads_the_connector_and_passes_vllm_args_through():
    args, rest = build_parser().parse_known_args(["serve", "--slots", "task", "planner", "--port", "8001", "--dtype", "bfloat16"])
    argv = serve_argv(args.model, not args.no_plan, args.slots, rest)
    assert argv[:2] == ["kvcomm serve", "--model"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvcommConnector" and config["kv_role"] == "kv_both"
    assert config["kv_connector_module_path"] == "kvcomm.integrations.vllm_connector"
    assert config["kv_connector_extra_config"] == {"plan": True, "slots": ["task", "planner"]}
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"  # the user's value wins
    assert argv[-2:] == ["--dtype", "bfloat16"] and "--port" in argv


def test_eval_on_vllm_refuses_kl_and_cacheblend_with_a_clear_error(tmp_path, capsys):
    assert main(["eval", "--workload", "mmlu", "--out", str(tmp_path / "o"), "--backend", "vllm"]) == 2
    assert "--no-kl" in capsys.readouterr().err


def test_serve_adds_tenant_middleware_and_reads_api_keys(monkeypatch):
    from kvcomm.integrations.cli import MIDDLEWARE, api_keys

    argv = serve_argv(None, True, None, ["--api-key", "k1", "k2"], {"gamma": 1.0, "max_tenant_bytes": 1 << 20})
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE and "--enable-prompt-tokens-details" in argv
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"plan": True, "gamma": 1.0, "max_tenant_bytes": 1 << 20}
    assert "--middleware" not in serve_argv(None, False, None, [])  # --no-plan: stock vLLM serving
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys(["--port", "1", "--api-key", "k1", "k2", "--api-key=k3"]) == ["k1", "k2", "k3"]
    assert api_keys([]) == []
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert api_keys([]) == ["env-key"]


def test_serve_refuses_a_non_positive_byte_cap(capsys):
    assert main(["serve", "--max-tenant-bytes", "0"]) == 2
    assert "--max-tenant-bytes must be a positive number of bytes" in capsys.readouterr().err
