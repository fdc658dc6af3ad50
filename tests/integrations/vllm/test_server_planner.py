"""The server planner's tenants, byte caps and metrics, driven like the connector drives it
(prepare, a real forward with the injected prefix, captured KV, finish) on a tiny random
Llama: no vLLM engine needed."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.services.tenants import tenant_label
from kvcomm.integrations.vllm.wire.channel import Capture
from kvcomm.integrations.vllm.wire.params import parse_params
from kvcomm.integrations.vllm.planning.server_planner import ServerPlanner


def serve(planner: ServerPlanner, executor, ids: list[int], spans: list[dict], tenant: str, max_tokens: int = 3,
          template: str = "agent", calibrate: bool = False, adapter: str | None = None) -> dict:
    """One annotated request (under LoRA adapter identity ``adapter``, None: the base model):
    plan, prefill with the planned prefix, capture, learn."""
    body = {"template": template, "tenant": tenant, "segments": spans, "calibrate": calibrate}
    params = parse_params({"kvcomm": body}, len(ids))
    planned = planner.prepare(ids, params, salted=True, max_tokens=max_tokens, adapter=adapter)
    reuse_end = planned.plan.reuse_end
    # what the worker writes into the request's cache slots (the same pieces, into a buffer)
    assert (planned.order.inject is None) == (reuse_end == 0)
    generation = executor.generate(ids, planned.engine.materialize(planned.plan), max_tokens)
    n, reply = len(ids), list(generation.reply_ids)
    layers, heads, _, dim = generation.computed.keys.shape
    capture = Capture.empty(layers, heads, n + max_tokens, dim, generation.computed.keys.dtype)
    pieces = [(reuse_end, generation.computed)] + ([(n, generation.reply_kv)] if generation.reply_kv is not None else [])
    for start, kv in pieces:
        capture.keys[:, :, start : start + kv.length] = kv.keys
        capture.values[:, :, start : start + kv.length] = kv.values
        capture.filled[start : start + kv.length] = True
    planner.finish(planned, capture, reply)
    return planned.summary()


def request(seed: int, length: int = 24, lead: int = 6) -> tuple[list[int], list[dict]]:
    """A prompt of ``lead`` fixed tokens, one shared span (distinct content per seed), 4 fixed tokens."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(100, 5000, (length,), generator=generator).tolist()
    ids = list(range(1, lead + 1)) + shared + [7, 8, 9, 10]
    return ids, [{"start": lead, "end": lead + length, "slot": "task"}]


@pytest.fixture()
def planner(tiny_executor):
    return ServerPlanner(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=3)))


def test_tenants_do_not_share_what_they_learned(planner, tiny_executor):
    ids, spans = request(0)
    serve(planner, tiny_executor, ids, spans, "team-a")
    repeat = serve(planner, tiny_executor, ids, spans, "team-a")
    assert repeat["exact_tokens"] == len(ids) - 1
    # the response says it in plain words too (issue 49), from the same counts
    assert repeat["reason"].startswith(f"reused {len(ids) - 1} of {len(ids)} tokens (exact {len(ids) - 1})")
    other = serve(planner, tiny_executor, ids, spans, "team-b")
    assert other["exact_tokens"] == other["estimated_tokens"] == 0
    assert planner.engine("team-a") is not planner.engine("team-b")
    assert planner.runs("team-a") is not planner.runs("team-b")


def test_tenant_byte_cap_holds_and_does_not_touch_other_tenants(tiny_executor):
    uncapped = ServerPlanner(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    ids, spans = request(1)
    serve(uncapped, tiny_executor, ids, spans, "one")
    per_request = uncapped.registry.nbytes
    cap = 3 * per_request
    planner = ServerPlanner(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)), max_tenant_bytes=cap)
    serve(planner, tiny_executor, ids, spans, "quiet")
    quiet = planner.registry.metrics()["tenants"][tenant_label("quiet")]["bytes"]
    for seed in range(2, 10):
        serve(planner, tiny_executor, *request(seed), "busy")
        assert planner.engine("busy").nbytes <= cap
    numbers = planner.registry.metrics()["tenants"]
    assert sum(numbers[tenant_label("busy")]["evicted"].values()) > 0
    assert numbers[tenant_label("quiet")]["bytes"] == quiet  # one tenant's load evicts nothing of another's


def test_metrics_count_what_the_requests_reported(planner, tiny_executor):
    """Counters from the summaries (``record_served``, as the connector's scheduler side calls
    it), pool gauges from the planner itself after it learned."""
    from kvcomm.integrations.vllm.planning.metrics import record_served

    def sample(source: str) -> float:
        return REGISTRY.get_sample_value("kvcomm_prompt_tokens_total", {"source": source}) or 0.0

    before = {s: sample(s) for s in ("exact", "estimated", "computed")}
    # the same contents behind leads of other lengths: anchors are admitted, then estimated from
    summaries = [serve(planner, tiny_executor, *request(seed, 20, lead), "m") for lead in (6, 9, 13, 3) for seed in range(3)]
    for summary in summaries:
        record_served(summary)
    assert sum(s["estimated_tokens"] for s in summaries) > 0
    for source in before:
        assert sample(source) - before[source] == sum(s[f"{source}_tokens"] for s in summaries)
    assert REGISTRY.get_sample_value("kvcomm_tenant_bytes", {"tenant": tenant_label("m")}) == planner.registry.nbytes
    assert REGISTRY.get_sample_value("kvcomm_anchors", {"slot": "task"}) == len(planner.engine("m").pools["task"])


def test_calibration_requests_fill_a_pool_past_what_estimating_requests_leave_it(tiny_executor):
    """Five contents, each seen once behind template "a" (its base), then behind template "b"
    (another lead): ordinary requests add an anchor only where they compute the content anyway
    (the first behind template "b", whose text is new; later ones serve the cold slot
    realigned), calibration requests reuse nothing and add every one of them."""
    pools = {}
    for calibrate in (False, True):
        planner = ServerPlanner(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
        for seed in range(5):
            serve(planner, tiny_executor, *request(seed, 20, 6), "t", template="a")
            second = serve(planner, tiny_executor, *request(seed, 20, 11), "t", template="b", calibrate=calibrate)
            if calibrate:
                assert second["exact_tokens"] == second["estimated_tokens"] == 0 and second["note"].startswith("calibration")
        pools[calibrate] = len(planner.engine("t").pools["task"])
    assert pools[False] == 1 and pools[True] == 5, pools


def test_a_segment_id_is_bound_to_its_content(planner, tiny_executor):
    """A client id names one content: the id sent again with other tokens is refused (the request
    is served without reuse), never estimated from the first content's base; the same content
    under any id, or none, is the same content to the engine."""
    from kvcomm.integrations.vllm.wire.params import KvcommParamsError

    first, spans = request(1)
    named = [{**spans[0], "id": "doc-1"}]
    serve(planner, tiny_executor, first, named, "t")
    again = serve(planner, tiny_executor, first, named, "t")
    assert again["exact_tokens"] + again["estimated_tokens"] > 0  # the id still works for its own content
    other, _ = request(2)
    body = {"template": "agent", "tenant": "t", "segments": named}
    with pytest.raises(KvcommParamsError, match=r"segments\[0\]\.id 'doc-1' was sent before with other tokens"):
        planner.prepare(other, parse_params({"kvcomm": body}, len(other)), salted=True, max_tokens=3)
    fresh = serve(planner, tiny_executor, other, [{**spans[0], "id": "doc-2"}], "t")
    assert fresh["estimated_tokens"] == 0  # new content: its own base, nothing of doc-1's
    assert serve(planner, tiny_executor, other, [{**spans[0], "id": "doc-1"}], "u")["estimated_tokens"] == 0  # per tenant
    assert set(planner.engine("t")._bases) <= {s for s in planner.engine("t")._bases if len(s) == 32}  # content ids


def test_remembered_segment_ids_are_bounded():
    from kvcomm.integrations.vllm.planning.segment_ids import SegmentIds
    from kvcomm.integrations.vllm.wire.params import parse_params as parse

    ids = SegmentIds(max_ids=10)
    for n in range(100):
        tokens = [n, n + 1, n + 2]
        ids.bind("t", tokens, parse({"kvcomm": {"segments": [{"start": 0, "end": 3, "slot": "s", "id": f"id-{n}"}]}}, 3))
    assert len(ids) == 10


def test_metric_labels_are_bounded_whatever_the_clients_name(tiny_executor, monkeypatch):
    """Slot names (and, without API keys, tenants) come from clients: 100 tenants with 100 slots
    export at most MAX_*_LABELS label values each, the rest summed under "other"."""
    from kvcomm.anchors.pool import AnchorPool
    from kvcomm.integrations.vllm.planning import metrics

    monkeypatch.setattr(metrics, "_labels", {"slot": {}, "tenant": {}})
    planner = ServerPlanner(tiny_executor.rotary)
    for t in range(100):
        engine = planner.engine(f"client-tenant-{t}")
        engine.pools[f"client-slot-{t}"] = AnchorPool(engine.config.pool, engine.head_shards)
    ids, spans = request(1)
    serve(planner, tiny_executor, ids, spans, "client-tenant-99")  # learning refreshes the gauges
    names = {tenant_label(f"client-tenant-{t}") for t in range(100)}
    exported = {m.name: {s.labels.get("slot") or s.labels.get("tenant") for s in m.samples} for m in REGISTRY.collect()
                if m.name in ("kvcomm_anchors", "kvcomm_tenant_bytes")}
    assert len(exported["kvcomm_tenant_bytes"] & names) == metrics.MAX_TENANT_LABELS
    assert len({s for s in exported["kvcomm_anchors"] if s.startswith("client-slot-")}) == metrics.MAX_SLOT_LABELS
    assert "other" in exported["kvcomm_anchors"] and "other" in exported["kvcomm_tenant_bytes"]
    assert REGISTRY.get_sample_value("kvcomm_tenant_bytes", {"tenant": "other"}) == sum(
        planner.engine(t).nbytes for t in planner.registry.tenants if tenant_label(t) not in metrics._labels["tenant"])
