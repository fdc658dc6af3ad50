"""Prometheus export of quality guards (``kvcomm.services.quality_guard``), read at scrape time.

``export(guard, tenant)`` registers a collector (``prometheus_client``) that turns
``guard.metrics()`` into these series, labelled by tenant label (never a raw key) and slot:

- ``kvcomm_guard_kl_mean{tenant,slot}``: rolling mean KL(dense || reuse) of the first reply
  token's distribution, nats (top-k + "other" bucket: a lower bound of the full KL);
  ``kvcomm_guard_kl_last{tenant,slot}``: the latest sample;
- ``kvcomm_guard_samples{tenant,slot}``, ``kvcomm_guard_tightenings{tenant,slot}`` (net of
  loosenings), ``kvcomm_guard_loosenings{tenant,slot}``, ``kvcomm_guard_disabled{tenant,slot}``
  (1 when the guard turned the slot's reuse off), ``kvcomm_guard_gamma{tenant,slot}`` (the slot pool's gamma now);
- ``kvcomm_guard_measured_total{tenant}``, ``kvcomm_guard_twin_seconds_total{tenant}``
  (dense twins and the time they took), ``kvcomm_guard_budget{tenant}``.

Scraping reads the guard under its lock; nothing is pushed, so an idle guard costs nothing.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcomm.services.quality_guard import SLOT_METRICS, QualityGuard
from kvcomm.services.tenants import tenant_label



class GuardCollector:
    """A ``prometheus_client`` collector over one or more guards, keyed by tenant key."""

    def __init__(self) -> None:
        self.guards: dict[str, QualityGuard] = {}

    def add(self, guard: QualityGuard, tenant: str = "default") -> None:
        self.guards[tenant] = guard

    def collect(self):
        per_slot = {name: GaugeMetricFamily(f"kvcomm_guard_{name}", doc, labels=["tenant", "slot"])
                    for name, doc in SLOT_METRICS.items()}
        measured = CounterMetricFamily("kvcomm_guard_measured", "Requests the guard also prefilled densely", labels=["tenant"])
        seconds = CounterMetricFamily("kvcomm_guard_twin_seconds", "Seconds spent in dense twins", labels=["tenant"])
        budget = GaugeMetricFamily("kvcomm_guard_budget", "KL budget of a slot's rolling mean, nats", labels=["tenant"])
        for tenant, guard in list(self.guards.items()):
            label = tenant_label(tenant)
            numbers = guard.metrics()
            measured.add_metric([label], numbers["measured"])
            seconds.add_metric([label], numbers["twin_seconds"])
            budget.add_metric([label], numbers["budget"])
            for slot, values in numbers["slots"].items():
                for name, family in per_slot.items():
                    value = values[name]
                    if value is not None:
                        family.add_metric([label, slot], float(value))
        yield from per_slot.values()
        yield from (measured, seconds, budget)


def export(guard: QualityGuard, tenant: str = "default", registry: CollectorRegistry = REGISTRY,
           collector: GuardCollector | None = None) -> GuardCollector:
    """Expose ``guard`` on ``registry`` (default: the process-wide one that ``/metrics`` and
    ``prometheus_client.start_http_server`` serve). Pass the returned collector back to add
    more tenants' guards to it; ``registry.unregister(collector)`` stops the export."""
    if collector is None:
        collector = GuardCollector()
        collector.add(guard, tenant)
        registry.register(collector)
    else:
        collector.add(guard, tenant)
    return collector
