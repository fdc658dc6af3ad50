"""The quality guard's Prometheus export equals what the guards measured (tiny model, real dense twins)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.local.guard_metrics import export
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.services.quality_guard import GuardConfig, QualityGuard
from kvcomm.reuse.runner import run_row
from kvcomm.services.tenants import tenant_label
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from support.two_agent_case import PIPELINE

SPEC = parse_pipeline({**PIPELINE, "max_new_tokens": 2})


def _guarded_run(executor, guard: QualityGuard) -> None:
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    for row in range(len(SPEC.inputs)):
        run_row(SPEC, row, executor, engine, step=guard.run_agent)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exported_series_equal_the_guards_numbers_per_tenant(tiny_executor):
    relaxed = QualityGuard(GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    strict = QualityGuard(GuardConfig(fraction=1.0, budget=1e-12, min_samples=1, action="disable"))
    _guarded_run(tiny_executor, relaxed)
    _guarded_run(tiny_executor, strict)
    registry = CollectorRegistry()
    collector = export(relaxed, "alice-secret-key", registry)
    export(strict, "bob-secret-key", registry, collector)
    got = _samples(registry)
    assert "secret" not in generate_latest(registry).decode()  # tenant keys may be API keys: labels only
    for tenant, guard in (("alice-secret-key", relaxed), ("bob-secret-key", strict)):
        label, numbers = tenant_label(tenant), guard.metrics()
        assert numbers["measured"] > 0 and numbers["slots"]
        assert got[("kvcomm_guard_measured_total", (("tenant", label),))] == numbers["measured"]
        assert got[("kvcomm_guard_budget", (("tenant", label),))] == numbers["budget"]
        for slot, values in numbers["slots"].items():
            key = (("slot", slot), ("tenant", label))
            assert got[("kvcomm_guard_kl_mean", key)] == values["kl_mean"] > 0
            assert got[("kvcomm_guard_samples", key)] == values["samples"]
            assert got[("kvcomm_guard_disabled", key)] == float(values["disabled"])
    assert all(v == 0.0 for (name, _), v in got.items() if name == "kvcomm_guard_disabled"
               and dict(_)["tenant"] == tenant_label("alice-secret-key"))
    assert any(v == 1.0 for (name, _), v in got.items() if name == "kvcomm_guard_disabled"
               and dict(_)["tenant"] == tenant_label("bob-secret-key"))
    registry.unregister(collector)
    assert not any(name.startswith("kvcomm_guard") for name, _ in _samples(registry))
