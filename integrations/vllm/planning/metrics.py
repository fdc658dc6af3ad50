"""Prometheus metrics of the kvcomm vLLM plugin (``prometheus_client``, installed with vLLM).

Counters live in the process running vLLM's scheduler (the engine core), counted when a
request finishes (``record_served``, ``record_rejected``), before its response leaves; the
pool gauges live where the pools are, vLLM's worker (``record_pools``, after the worker
learned from a finished request: an engine step or more after its response). With vLLM's default
engine those are two processes; ``kvcomm serve`` sets up Prometheus multiprocess mode before
vLLM starts, so the API server's ``/metrics`` aggregates both with vLLM's own.

- ``kvcomm_prompt_tokens_total{source="exact"|"estimated"|"computed"}``: prompt tokens of
  planned (annotated) requests whose prefill completed, by where their KV came from.
- ``kvcomm_requests_total{outcome="planned"|"rejected"}``; ``kvcomm_fallbacks_total``: planned
  requests whose shared content was all recomputed.
- ``kvcomm_guard_measured_total``: requests the quality guard measured against their dense
  twin (``vllm.planning.guard``); per guarded slot ``kvcomm_guard_kl_mean{tenant,slot}`` (rolling mean
  KL(dense || reuse) of the first reply token, nats, top-k + other: a lower bound),
  ``kvcomm_guard_kl_last{tenant,slot}``, ``kvcomm_guard_samples{tenant,slot}``, ``kvcomm_guard_gamma{tenant,slot}`` (the slot's gamma
  now), ``kvcomm_guard_tightenings{tenant,slot}`` and ``kvcomm_guard_disabled{tenant,slot}``
  (1: reuse off), refreshed by rank 0 after each sample.
- ``kvcomm_anchors{slot}``, ``kvcomm_pool_bytes``, ``kvcomm_tenant_bytes{tenant}`` (hash
  label, never the key), ``kvcomm_evictions`` (gauges, refreshed after each learned request);
  ``kvcomm_pool_problems``: invariants found broken (V and byte caps, embedding index, access
  counts adding up; each is also logged), 0 when the pools are consistent.

Label sets are bounded: slot names come from clients and tenants (without API keys) too, so
each process exports the first ``MAX_SLOT_LABELS`` slots and ``MAX_TENANT_LABELS`` tenant labels
it sees under their own name and the rest summed under ``OTHER``. With API keys, `kvcomm
serve` puts ``/metrics`` behind them (``serve.middleware``).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from kvcomm.services.quality_guard import SLOT_METRICS
from kvcomm.services.tenants import tenant_label

log = logging.getLogger(__name__)

MAX_SLOT_LABELS = 32
MAX_TENANT_LABELS = 64
OTHER = "other"
"""The label of everything past the bounds (a slot name cannot be "other": slot names that
would be are exported as "other" too, which only merges them)."""
_labels: dict[str, dict[str, None]] = {"slot": {}, "tenant": {}}


def bounded(kind: str, value: str) -> str:
    """``value`` as a label of ``kind`` ("slot" or "tenant"): itself while fewer than the bound
    were seen in this process (or it was seen before), else ``OTHER``."""
    seen, bound = _labels[kind], MAX_SLOT_LABELS if kind == "slot" else MAX_TENANT_LABELS
    if value in seen:
        return value
    if len(seen) < bound:
        seen[value] = None
        return value
    return OTHER

PROMPT_TOKENS = Counter("kvcomm_prompt_tokens", "Prompt tokens of planned requests by KV source", ["source"])
REQUESTS = Counter("kvcomm_requests", "Requests that opted into kvcomm, by outcome", ["outcome"])
FALLBACKS = Counter("kvcomm_fallbacks", "Planned requests whose shared content was all recomputed")
ANCHORS = Gauge("kvcomm_anchors", "Anchors held per slot (all tenants)", ["slot"], multiprocess_mode="livesum")
POOL_BYTES = Gauge("kvcomm_pool_bytes", "Bytes held by all anchor pools (all tenants)", multiprocess_mode="livesum")
TENANT_BYTES = Gauge("kvcomm_tenant_bytes", "Bytes held per tenant (pools, bases, exact prefixes)", ["tenant"],
                     multiprocess_mode="livesum")
EVICTIONS = Gauge("kvcomm_evictions", "Anchors evicted so far (V cap and byte caps)", multiprocess_mode="livesum")
GUARD_MEASURED = Counter("kvcomm_guard_measured", "Requests the quality guard measured against their dense twin")
GUARD = {name: Gauge(f"kvcomm_guard_{name}", SLOT_METRICS[name], ["tenant", "slot"], multiprocess_mode="mostrecent")
         for name in ("kl_mean", "kl_last", "samples", "gamma", "tightenings", "disabled")}
PROBLEMS = Gauge("kvcomm_pool_problems", "Broken pool invariants found by TenantRegistry.problems() (0 when consistent)",
                 multiprocess_mode="livesum")


def record_served(summary: dict) -> None:
    """Count one finished planned request from its summary (``PlannedRequest.summary``); a preamble
    request counts nothing (its tokens are the preamble of the request it serves), nor does
    a quality guard's reuse twin."""
    if summary.get("purpose", "client") != "client":
        return
    for source in ("exact", "estimated", "computed"):
        PROMPT_TOKENS.labels(source).inc(summary[f"{source}_tokens"])
    REQUESTS.labels("planned").inc()
    if summary["fallback"]:
        FALLBACKS.inc()


def record_pools(registry) -> None:
    """Refresh the pool gauges from ``registry`` (a ``kvcomm.services.tenants.TenantRegistry``;
    tenants are exported under their hash label). Under tensor parallelism every rank reports
    the bytes and problems of what it holds (the gauges add up over ranks) and only rank 0 the
    anchor and eviction counts, which all ranks share."""
    numbers = registry.metrics()
    problems = registry.problems()
    for problem in problems:
        log.error("kvcomm pool inconsistency: %s", problem)
    PROBLEMS.set(len(problems))
    POOL_BYTES.set(sum(sum(t["pool_bytes"].values()) for t in numbers["tenants"].values()))
    tenant_bytes: dict[str, int] = {}
    for label, tenant in numbers["tenants"].items():
        label = bounded("tenant", label)
        tenant_bytes[label] = tenant_bytes.get(label, 0) + tenant["bytes"]
    for label, held in tenant_bytes.items():
        TENANT_BYTES.labels(label).set(held)
    if registry.head_shards.rank != 0:
        return
    anchors: dict[str, int] = {}
    for tenant in numbers["tenants"].values():
        for slot, count in tenant["anchors"].items():
            slot = bounded("slot", slot)
            anchors[slot] = anchors.get(slot, 0) + count
    for slot, count in anchors.items():
        ANCHORS.labels(slot).set(count)
    pools = [pool for tenant in registry.tenants for pool in registry.engine(tenant).pools.values()]
    EVICTIONS.set(sum(pool.evictions for pool in pools))


def record_guard(tenant: str, numbers: dict) -> None:
    """Count one guard sample and refresh its gauges from ``QualityGuard.metrics()`` of
    ``tenant``'s guard (tenant under its hash label; bounded labels)."""
    GUARD_MEASURED.inc()
    label = bounded("tenant", tenant_label(tenant))
    for slot, values in numbers["slots"].items():
        for name, gauge in GUARD.items():
            if values[name] is not None:
                gauge.labels(label, bounded("slot", slot)).set(float(values[name]))


def record_rejected() -> None:
    REQUESTS.labels("rejected").inc()
