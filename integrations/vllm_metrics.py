"""Prometheus metrics of the kvcomm vLLM plugin (``prometheus_client``, installed with vLLM).

They live in the process running vLLM's scheduler. ``kvcomm serve`` sets up Prometheus
multiprocess mode before vLLM starts, so the API server's ``/metrics`` aggregates them with
vLLM's own.

- ``kvcomm_prompt_tokens_total{source="exact"|"estimated"|"computed"}``: prompt tokens of
  planned (annotated) requests by where their KV came from.
- ``kvcomm_requests_total{outcome="planned"|"rejected"}``; ``kvcomm_fallbacks_total``: planned
  requests whose shared content was all recomputed.
- ``kvcomm_anchors{slot}``, ``kvcomm_pool_bytes``, ``kvcomm_evictions`` (gauges, refreshed
  after each planned request).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

PROMPT_TOKENS = Counter("kvcomm_prompt_tokens", "Prompt tokens of planned requests by KV source", ["source"])
REQUESTS = Counter("kvcomm_requests", "Requests that opted into kvcomm, by outcome", ["outcome"])
FALLBACKS = Counter("kvcomm_fallbacks", "Planned requests whose shared content was all recomputed")
ANCHORS = Gauge("kvcomm_anchors", "Anchors held per slot", ["slot"], multiprocess_mode="livesum")
POOL_BYTES = Gauge("kvcomm_pool_bytes", "Bytes held by all anchor pools", multiprocess_mode="livesum")
EVICTIONS = Gauge("kvcomm_evictions", "Anchors evicted so far", multiprocess_mode="livesum")


def record_planned(provenance, engines) -> None:
    """Count one finished planned request and refresh the pool gauges from ``engines``."""
    PROMPT_TOKENS.labels("exact").inc(provenance.exact_tokens)
    PROMPT_TOKENS.labels("estimated").inc(provenance.estimated_tokens)
    PROMPT_TOKENS.labels("computed").inc(provenance.computed_tokens)
    REQUESTS.labels("planned").inc()
    if provenance.fallback:
        FALLBACKS.inc()
    pools = [(slot, pool) for engine in engines for slot, pool in engine.pools.items()]
    for slot in {slot for slot, _ in pools}:
        ANCHORS.labels(slot).set(sum(len(p) for s, p in pools if s == slot))
    POOL_BYTES.set(sum(p.nbytes for _, p in pools))
    EVICTIONS.set(sum(p.evictions for _, p in pools))


def record_rejected() -> None:
    REQUESTS.labels("rejected").inc()
