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
