"""The connector's settings (``vllm.wire.config``): read once into a ``ConnectorConfig``, with
today's defaults; every bad value and every unknown key refused at start-up with a message that
names it; what `kvcomm serve` builds loads as vLLM's own parser hands it over; and no other module
reads ``kv_connector_extra_config``. No engine runs."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvcomm.anchors.config import PoolConfig  # noqa: E402
from kvcomm.integrations.vllm.wire.config import ConnectorConfig  # noqa: E402
from kvcomm.integrations.vllm.wire.params import shown  # noqa: E402
from kvcomm.reuse.scopes import DEFAULT_SCOPE  # noqa: E402
from kvcomm.services.quality_guard import GuardConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _connector(role: str, extra: dict):
    """The kvcomm connector of ``role`` ("SCHEDULER" or "WORKER") as vLLM builds it, on
    ``extra`` as its ``kv_connector_extra_config``; no engine runs."""
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcomm.integrations.vllm.connector import KvcommConnector
    from kvcomm.integrations.vllm.wire.config import transfer_config

    config = VllmConfig(kv_transfer_config=transfer_config(extra=extra))
    full = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    return KvcommConnector(config, getattr(KVConnectorRole, role),
                           KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=groups))


def test_the_defaults_are_the_ones_each_reader_used_before():
    """The defaults each module passed to ``get_from_extra_config`` before the settings were read
    in one place (scheduler, worker, worker_plans, connector, guard): the pool's and the scope's
    own defaults, 1 GiB of captures, saves every 60 s, everything else off."""
    config = ConnectorConfig.from_extra({})
    assert config == ConnectorConfig() == ConnectorConfig.from_extra(None)
    assert (config.plan, config.strict, config.reuse_scope) == (False, False, DEFAULT_SCOPE)
    assert (config.gamma, config.max_anchors) == (PoolConfig.gamma, PoolConfig.max_anchors)
    assert (config.max_tenant_bytes, config.max_total_bytes, config.max_capture_bytes) == (None, None, 1 << 30)
    assert (config.slots, config.guard, config.state_dir, config.save_interval_s) == (None, None, None, 60.0)
    assert isinstance(config.gamma, float) and isinstance(config.save_interval_s, float)


def test_values_are_read_as_typed_settings():
    config = ConnectorConfig.from_extra({
        "plan": True, "strict": True, "reuse_scope": "all", "gamma": 0, "max_anchors": 3, "max_tenant_bytes": 1 << 20,
        "max_total_bytes": 1 << 22, "max_capture_bytes": 1 << 21, "slots": ["task", "planner"],
        "guard": {"budget": 0.05, "fraction": 0.5}, "state_dir": Path("/tmp/kvcomm-state"), "save_interval_s": 5})
    assert config.plan and config.strict and config.reuse_scope == "all"
    assert config.gamma == 0.0 and isinstance(config.gamma, float) and config.max_anchors == 3
    assert (config.max_tenant_bytes, config.max_total_bytes, config.max_capture_bytes) == (1 << 20, 1 << 22, 1 << 21)
    assert config.slots == frozenset({"task", "planner"})
    assert config.guard == GuardConfig(budget=0.05, fraction=0.5)
    assert config.state_dir == "/tmp/kvcomm-state" and config.save_interval_s == 5.0
    with pytest.raises(AttributeError):
        config.gamma = 2.0  # frozen: read once, never changed


BAD = [
    ("plan", "yes", "true or false"), ("plan", 1, "true or false"),
    ("strict", "false", "true or false"), ("strict", None, "true or false"),
    ("reuse_scope", "everything", "valid: all, all-reader-replies, content"), ("reuse_scope", ["all"], "valid: all"),
    ("gamma", -0.1, "a finite number >= 0"), ("gamma", "1", "a finite number >= 0"),
    ("gamma", True, "a finite number >= 0"), ("gamma", math.nan, "a finite number >= 0"),
    ("gamma", math.inf, "a finite number >= 0"), ("gamma", None, "a finite number >= 0"),
    ("max_anchors", 0, "an integer >= 1"), ("max_anchors", 2.5, "an integer >= 1"),
    ("max_anchors", True, "an integer >= 1"),
    ("max_tenant_bytes", 0, "a positive number of bytes"), ("max_tenant_bytes", 1.5e9, "a positive number of bytes"),
    ("max_tenant_bytes", "1GB", "a positive number of bytes"),
    ("max_total_bytes", -1, "a positive number of bytes"), ("max_total_bytes", True, "a positive number of bytes"),
    ("max_capture_bytes", 0, "a positive number of bytes"), ("max_capture_bytes", None, "a positive number of bytes"),
    ("max_capture_bytes", 1024.0, "a positive number of bytes"),
    ("slots", "task", "a non-empty list of slot names"), ("slots", [], "a non-empty list of slot names"),
    ("slots", ["bad name"], "a non-empty list of slot names"), ("slots", [1], "a non-empty list of slot names"),
    ("guard", {"fraction": 0.5}, "must be an object"), ("guard", 0.1, "must be an object"),
    ("guard", {"budget": -1}, "budget must be >= 0"), ("guard", {"budget": 0.1, "fraction": 2}, "fraction must be in"),
    ("state_dir", "", "a folder path"), ("state_dir", 3, "a folder path"),
    ("save_interval_s", 0, "a positive, finite number of seconds"),
    ("save_interval_s", math.inf, "a positive, finite number of seconds"),
    ("save_interval_s", "60", "a positive, finite number of seconds"),
]


@pytest.mark.parametrize("key, value, expected", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_key_the_value_and_what_is_expected(key, value, expected):
    with pytest.raises(ValueError) as refused:
        ConnectorConfig.from_extra({key: value})
    message = str(refused.value)
    assert f"kv_connector_extra_config {key}" in message and expected in message
    assert shown(value) in message or str(value) in message


def test_every_setting_has_a_bad_value_checked():
    assert {key for key, _, _ in BAD} == {name for name in ConnectorConfig.__dataclass_fields__}


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_each_side_refuses_a_bad_setting_when_its_connector_is_built(role):
    """vLLM builds the connector once per role: each refuses at construction (the engine fails to
    start), not at the first plan or at ``register_kv_caches``."""
    for extra, words in (({"max_anchors": 0}, "max_anchors must be an integer >= 1"),
                         ({"guard": {"budget": -1}}, "guard"), ({"reuse_scope": "everything"}, "unknown reuse scope"),
                         ({"max_anchor": 5}, "'max_anchor' (did you mean 'max_anchors'?)")):
        with pytest.raises(ValueError, match=re.escape(words)):
            _connector(role, {"plan": True, **extra})
    built = _connector(role, {"plan": True, "gamma": 0.5, "slots": ["task"]})
    assert built.config == ConnectorConfig(plan=True, gamma=0.5, slots=frozenset({"task"}))
    side = built.connector_scheduler or built.connector_worker
    assert side is not None and built.refused is None


def test_an_unknown_key_is_refused_with_the_closest_setting():
    with pytest.raises(ValueError) as refused:
        ConnectorConfig.from_extra({"plan": True, "max_anchor": 5, "colour": "red"})
    message = str(refused.value)
    assert "'max_anchor' (did you mean 'max_anchors'?)" in message and "'colour'" in message
    assert "it reads plan, strict, reuse_scope" in message
    with pytest.raises(ValueError, match="must be an object of kvcomm's settings"):
        ConnectorConfig.from_extra(["plan"])


def test_what_kvcomm_serve_builds_loads_as_vllms_parser_hands_it_over(tmp_path):
    """Every `kvcomm serve` option that sets the connector, through ``engine_settings`` and
    ``serve_argv`` into ``--kv-transfer-config``, read back by vLLM's own parser, loads into the
    settings the flags asked for; so do the defaults."""
    from kvcomm.cli import build_parser
    from kvcomm.integrations.serve.command import engine_settings, serve_argv
    from kvcomm.integrations.serve.vllm_args import read_vllm_args

    def loaded(flags: list[str], budget: float | None = None, default_total: int | None = None) -> ConnectorConfig:
        args, rest = build_parser().parse_known_args(["serve", *flags])
        args.guard_budget = budget  # what serve_command sets from --quality-budget and the model's floor
        argv = serve_argv(args.model, not args.no_plan, args.slots, rest, engine_settings(args, default_total))
        return ConnectorConfig.from_transfer(read_vllm_args(argv[1:]).kv_transfer_config)

    config = loaded(["--slots", "task", "planner", "--gamma", "0.5", "--max-anchors", "7", "--reuse-scope", "all",
                     "--max-tenant-bytes", str(1 << 20), "--max-total-bytes", str(1 << 24), "--max-capture-bytes",
                     str(1 << 22), "--state-dir", str(tmp_path), "--save-interval", "30", "--guard-fraction", "0.25"],
                    budget=0.05)
    assert config == ConnectorConfig(
        plan=True, reuse_scope="all", gamma=0.5, max_anchors=7, max_tenant_bytes=1 << 20, max_total_bytes=1 << 24,
        max_capture_bytes=1 << 22, slots=frozenset({"task", "planner"}), guard=GuardConfig(budget=0.05, fraction=0.25),
        state_dir=str(tmp_path.resolve()), save_interval_s=30.0)
    assert loaded([], default_total=1 << 30) == ConnectorConfig(plan=True, max_total_bytes=1 << 30)
    assert loaded(["--no-plan"]) == ConnectorConfig()


def test_make_llm_refuses_a_bad_setting_before_vllm_starts(monkeypatch):
    from kvcomm.integrations.vllm.inprocess.llm import make_llm
    from kvcomm.integrations.vllm.wire.config import transfer_config

    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                        ("VLLM_LOGGING_STREAM", "ext://sys.stderr")):
        monkeypatch.setenv(name, value)  # make_llm sets them; restored after the test
    with pytest.raises(ValueError, match=re.escape("'stat_dir' (did you mean 'state_dir'?)")):
        make_llm(kv_transfer_config=transfer_config(extra={"plan": True, "stat_dir": "/tmp/kvcomm-state"}))


def test_only_the_settings_module_reads_the_extra_config():
    """``kv_connector_extra_config`` is read (an attribute read, or vLLM's ``get_from_extra_config``)
    in ``connector_config.py`` only; the other modules take the typed settings."""
    readers = set()
    for path in (ROOT / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("kv_connector_extra_config", "get_from_extra_config"):
                readers.add(path.relative_to(ROOT).as_posix())
    assert readers == {"integrations/vllm/wire/config.py"}
