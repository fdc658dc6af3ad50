"""The quality guard in the server's planner (``vllm.planning.guard``): plans made ahead sampled, the reuse
twin served its request's plan and learning nothing, a KL measured from sparse log-probabilities
(as `kvcomm serve` reads them from vLLM) equal to the in-process guard's, recorded and acted on,
and later plans cut at a disabled slot; driven as the connector drives the planner, on a tiny
random Llama."""

from __future__ import annotations

import pytest
import torch

from kvcomm.core.divergence import kl_topk_other, kl_topk_other_of, topk_reference
from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.place import place_all
from kvcomm.services.quality_guard import GuardConfig
from kvcomm.integrations.vllm.wire.config import guard_config
from kvcomm.integrations.vllm.wire.params import KvcommParamsError
from kvcomm.integrations.vllm.planning.server_planner import ServerPlanner
from .test_plan_ahead import CONFIG, MAX_TOKENS, _params, _run, agent_request


def _injected(executor, ids: list[int], order) -> KV | None:
    """The KV ``order`` injects, written as the worker writes it into the request's cache slots."""
    if order.inject is None:
        return None
    like = executor.generate(ids[:2], None, 1).computed
    layers, heads, _, dim = like.keys.shape
    n = order.inject.length
    prefix = KV(torch.empty(layers, heads, n, dim), torch.empty(layers, heads, n, dim))
    place_all(list(order.inject.pieces), KVTarget.contiguous(prefix, 0, n), executor.rotary)
    return prefix


def _first_token(executor, ids: list[int], prefix: KV | None) -> torch.Tensor:
    """``[vocab]`` log-probabilities of the first reply token after ``ids`` with ``prefix`` injected."""
    return executor.generate(ids, prefix, 1, keep_logprobs=True).prompt_logprobs[-1].float()


def _sampled_request(planner: ServerPlanner, executor, agent: int, ticket: str):
    """Plan agent ``agent``'s request ahead and serve it (preamble request first) as `kvcomm serve`
    does; returns (ids, body, summary, twin ticket)."""
    ids, spans = agent_request(agent)
    body = {"template": f"agent{agent}", "tenant": "t", "segments": spans}
    preamble, twin = planner.plan_ahead(ticket, ids, _params(ids, body))
    if preamble is not None:
        _run(planner, executor, ids[: preamble[1]], {"template": body["template"], "tenant": "t", "ticket": ticket,
                                                  "purpose": "preamble"}, 1)
    summary, _ = _run(planner, executor, ids, {**body, "ticket": ticket}, MAX_TOKENS)
    return ids, body, summary, twin


def test_the_reuse_twin_is_served_its_requests_plan_and_the_measured_kl_drives_the_guard(tiny_executor):
    probe = ServerPlanner(tiny_executor.rotary, CONFIG, guard=GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    _, _, first, sampled = _sampled_request(probe, tiny_executor, 0, "a0")
    assert first["estimated_tokens"] == 0 and sampled is None  # nothing estimated: nothing to measure
    ids, body, summary, sampled = _sampled_request(probe, tiny_executor, 1, "a1")
    assert summary["estimated_tokens"] > 0 and sampled == "a1.twin"

    engine = probe.engine("t")
    held = (engine.nbytes, {slot: len(pool.anchors) for slot, pool in engine.pools.items()}, sorted(engine.base_ids()))
    twin = probe.prepare(ids, _params(ids, {**body, "ticket": sampled, "purpose": "reuse_twin"}), salted=True, max_tokens=1)
    assert twin.purpose == twin.summary()["purpose"] == "reuse_twin" and twin.summary()["estimated_tokens"] == summary["estimated_tokens"]
    assert (twin.order.capture_from, twin.order.capture_to) == (0, 0)  # captures nothing
    probe.finish(twin, None, [1, 2])
    assert (engine.nbytes, {slot: len(pool.anchors) for slot, pool in engine.pools.items()},
            sorted(engine.base_ids())) == held  # learned nothing

    # the KL `kvcomm serve` computes from the twins' sparse log-probabilities is the in-process guard's
    dense = _first_token(tiny_executor, ids, None)
    reuse = _first_token(tiny_executor, ids, _injected(tiny_executor, ids, twin.order))
    reference = topk_reference(dense[None], 20)
    top = {int(i): float(v) for i, v in zip(reference.ids[0], reference.logprobs[0])}
    kl = kl_topk_other_of(top, {i: float(reuse[i]) for i in top})
    assert kl == pytest.approx(float(kl_topk_other(reference, reuse[None])[0]), rel=1e-6, abs=1e-9) and kl > 0
    print(f"first-token KL of agent 1's reuse: {kl:.4g} nats")

    assert probe.guard_record(sampled, kl, 0.5) and not probe.guard_record(sampled, kl, 0.5)  # recorded once
    with pytest.raises(KvcommParamsError, match="names no sampled plan"):  # recorded: the twin's plan is gone
        probe.prepare(ids, _params(ids, {**body, "ticket": sampled, "purpose": "reuse_twin"}), salted=True, max_tokens=1)
    numbers = probe.guards.guard("t", engine).metrics()
    assert numbers["measured"] == 1 and numbers["slots"]["task"]["kl_last"] == pytest.approx(kl)
    assert not numbers["slots"]["task"]["disabled"] and numbers["slots"]["task"]["gamma"] == 1.0  # within budget

    # the same traffic under a budget below that KL: the slot is disabled, later plans reuse nothing of it
    strict = ServerPlanner(tiny_executor.rotary, CONFIG, guard=GuardConfig(
        fraction=1.0, budget=kl / 2, min_samples=1, action="disable"))
    _sampled_request(strict, tiny_executor, 0, "b0")
    _, _, summary, sampled = _sampled_request(strict, tiny_executor, 1, "b1")
    assert summary["estimated_tokens"] > 0 and strict.guard_record(sampled, kl, 0.5)
    assert strict.guards.guard("t", strict.engine("t")).disabled("task")
    _, _, summary, sampled = _sampled_request(strict, tiny_executor, 2, "b2")
    assert summary["estimated_tokens"] == 0 and sampled is None and "quality guard" in summary["note"]
    ids, spans = agent_request(5, lead=0)  # the note first: the engine step's plans (no preamble) estimate it
    body = {"template": "agent5", "tenant": "t", "segments": spans}
    assert probe.prepare(ids, _params(ids, body), salted=True, max_tokens=1).plan.estimated_tokens > 0
    planned = strict.prepare(ids, _params(ids, body), salted=True, max_tokens=1)  # cut there too
    assert planned.plan.estimated_tokens == 0 and "quality guard" in planned.plan.note


def test_the_dense_twin_teaches_the_slot_it_measures_and_counts_nowhere(tiny_executor):
    """The dense twin `kvcomm serve` sends for a sampled request (``calibrate``, purpose
    ``dense_twin``): planned as calibration (nothing reused, the whole prompt captured) and learned
    from, so the slot it measures gets the anchor its estimate must earn evidence with; its summary
    says its purpose, so no metric counts it. Purpose ``dense_twin`` without calibrate is refused."""
    probe = ServerPlanner(tiny_executor.rotary, CONFIG, guard=GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    _sampled_request(probe, tiny_executor, 0, "c0")
    ids, body, summary, sampled = _sampled_request(probe, tiny_executor, 1, "c1")
    assert summary["realigned_tokens"] > 0 and sampled == "c1.twin"  # a cold slot: realigned, sampled
    pool = probe.engine("t").pool("task")
    assert not any(("agent1", "task") in anchor.deviations for anchor in pool.anchors)

    twin = probe.prepare(ids, _params(ids, {**body, "calibrate": True, "purpose": "dense_twin"}), salted=False, max_tokens=1)
    assert twin.plan.reuse_end == 0 and (twin.order.capture_from, twin.order.capture_to) == (0, len(ids))
    dense, _ = _run(probe, tiny_executor, ids, {**body, "calibrate": True, "purpose": "dense_twin"}, 1)
    assert dense["purpose"] == "dense_twin" and dense["computed_tokens"] == len(ids)
    assert any(("agent1", "task") in anchor.deviations for anchor in pool.anchors)  # learned

    with pytest.raises(KvcommParamsError, match="'dense_twin' needs calibrate"):
        _params(ids, {**body, "purpose": "dense_twin"})


def test_guard_settings_are_checked_when_the_connector_starts():
    assert guard_config(None) is None
    assert guard_config({"budget": 0.05}) == GuardConfig(budget=0.05)
    assert guard_config({"budget": 1, "fraction": 0.5}) == GuardConfig(budget=1.0, fraction=0.5)
    for bad, words in (({"fraction": 0.5}, "must be an object"), ({"budget": "0.1"}, "must be an object"),
                       ({"budget": 0.1, "action": "disable"}, "must be an object"), (0.1, "must be an object"),
                       ({"budget": -1}, "budget must be >= 0"), ({"budget": 0.1, "fraction": 2}, "fraction must be in")):
        with pytest.raises(ValueError, match=words):
            guard_config(bad)
