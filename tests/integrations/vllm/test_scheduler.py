"""The connector's scheduler side without an engine (``vllm.connector.scheduler``, built through
``KvcommConnector`` as vLLM builds it): an annotated request is answered "not yet" and asked
for in the step's metadata; the worker's answer makes it claimable; errors and aborts travel
back; finished requests go down before new asks."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvcomm.integrations.vllm.wire.messages import FinalCapture, Finished, KvcommWorkerMetadata, PlanAnswer  # noqa: E402


def _scheduler_connector(**extra):
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcomm.integrations.vllm.connector import KvcommConnector
    from kvcomm.integrations.vllm.wire.config import transfer_config

    config = VllmConfig(kv_transfer_config=transfer_config(extra={"plan": True, **extra}))
    full = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    return KvcommConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=groups))


def _request(req_id: str, n: int = 40, options: dict | None = None):
    """What the connector reads of a vLLM ``Request``; a ``handle`` in ``options`` goes to
    ``kvcomm_server``, as ``VllmExecutor`` sends it."""
    kvcomm = {"segments": [{"start": 4, "end": 20, "slot": "task"}]} if options is None else dict(options)
    params = {"kvcomm": kvcomm} if "handle" not in kvcomm else {"kvcomm": {}, "kvcomm_server": {"handle": kvcomm.pop("handle")}}
    return SimpleNamespace(
        request_id=req_id, kv_transfer_params=params, num_prompt_tokens=n, prompt_token_ids=list(range(n)),
        cache_salt="salt", max_tokens=5, output_token_ids=[7, 8, 2], num_computed_tokens=n + 2,
        sampling_params=SimpleNamespace(all_stop_token_ids={2}),
    )


def _output(answers: dict):
    return SimpleNamespace(kv_connector_worker_meta=KvcommWorkerMetadata(answers))


def _step(connector):
    return connector.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={}))


def test_an_annotated_request_waits_for_the_workers_plan_then_claims_it():
    connector = _scheduler_connector()
    assert connector.refused is None
    request = _request("a")
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)  # not yet
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)  # asked once only
    meta = _step(connector)
    assert [ask.req_id for ask in meta.asks] == ["a"] and meta.asks[0].token_ids == tuple(range(40))
    assert meta.asks[0].salted and meta.asks[0].max_tokens == 5 and meta.asks[0].params.segments[0].slot == "task"
    assert pickle.loads(pickle.dumps(meta)).asks == meta.asks  # crosses the process boundary
    assert _step(connector).asks == []
    summary = {"prompt_tokens": 40, "exact_tokens": 0, "estimated_tokens": 20, "computed_tokens": 20,
               "fallback": False, "note": ""}
    connector.update_connector_output(_output({"a": PlanAnswer(20, 20, summary)}))
    assert connector.get_num_new_matched_tokens(request, 16) == (4, False)  # beyond vLLM's own hit
    assert connector.request_finished(request, []) == (False, {"kvcomm": summary})
    assert _step(connector).finished == [Finished("a", (7, 8))]  # the stop token is not the reply's


def test_a_reply_cut_by_max_tokens_is_learned_without_its_last_token():
    """vLLM never feeds back the last token it samples, so that token has no KV: a stop token,
    or the last token of a reply cut by max_tokens. The worker learns the reply without it (the
    remote chat clients ask for one token more than they keep, so what they pass on is a base)."""
    connector = _scheduler_connector()
    request = _request("c")
    request.output_token_ids = [7, 8, 9]  # no stop token: cut by max_tokens
    connector.get_num_new_matched_tokens(request, 0)
    _step(connector)
    summary = {"prompt_tokens": 40, "exact_tokens": 0, "estimated_tokens": 0, "computed_tokens": 40,
               "fallback": True, "note": ""}
    connector.update_connector_output(_output({"c": PlanAnswer(0, 0, summary)}))
    connector.request_finished(request, [])
    assert _step(connector).finished == [Finished("c", (7, 8))]


def test_a_workers_error_is_that_requests_error_and_an_abort_before_the_answer_is_clean():
    connector = _scheduler_connector()
    failing, aborted = _request("f"), _request("x")
    for request in (failing, aborted):
        assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert [ask.req_id for ask in _step(connector).asks] == ["f", "x"]
    assert connector.request_finished(aborted, []) == (False, None)  # aborted while its plan was pending
    connector.update_connector_output(_output({"f": PlanAnswer(error="kvcomm planning failed (boom)"),
                                               "x": PlanAnswer(10, 10, {})}))
    assert connector.get_num_new_matched_tokens(failing, 0) == (0, False)  # served without reuse
    assert connector.request_finished(failing, []) == (False, {"kvcomm": {"error": "kvcomm planning failed (boom)"}})
    # the worker drops what it planned; the rejected request's Finished has no reply (nothing to learn)
    assert _step(connector).finished == [Finished("x", (7, 8)), Finished("f", ())]


def test_bad_options_are_refused_at_once_without_asking_the_worker():
    connector = _scheduler_connector()
    request = _request("b", options={"segments": [{"start": 4, "end": 99, "slot": "task"}]})
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert _step(connector).asks == []
    assert "prompt length" in connector.request_finished(request, [])[1]["kvcomm"]["error"]


def test_an_in_process_order_is_claimed_beyond_vllms_hit_and_its_load_sent_as_slots_of_the_bound_block_table():
    from kvcomm.core.kv import KV
    from kvcomm.integrations.vllm.wire.channel import Injection, Order

    connector = _scheduler_connector()
    inject = Injection.of_kv(KV(torch.zeros(1, 3, 20, 64), torch.zeros(1, 3, 20, 64)))
    connector.channel.place("h", Order(inject, capture_from=20, capture_to=45))
    connector.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: ([5, 0, 7],), block_pool=None))
    request = _request("o", options={"handle": "h"})
    assert connector.get_num_new_matched_tokens(request, 16) == (4, False)  # 20 planned, 16 cached by vLLM
    connector.update_state_after_alloc(request, None, 4)
    meta = connector.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="o", num_computed_tokens=16)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]), num_scheduled_tokens={"o": 24}))
    (step,) = meta.requests
    assert step.handle == "h" and step.prompt_done
    assert step.load_positions.tolist() == [16, 17, 18, 19] and step.load_slots.tolist() == [0, 1, 2, 3]  # block 0
    request.num_computed_tokens = 40  # the prompt's last token computed; a decode step sends nothing
    assert _step_of(connector, "o", 40, 1).requests == []
    # Finished: vLLM keeps its blocks (delay-free) until the worker copied positions [20, 42)
    # in the next step; the caller waits for that copy, then takes the capture.
    request.num_computed_tokens = 42
    assert connector.request_finished(request, [5, 0, 7]) == (True, None)
    assert connector.channel.awaits_final("h")
    (final,) = _step(connector).final
    assert final == FinalCapture("o", "h", (5, 0, 7), 16, 20, 42)
    assert final.slots().tolist() == list(range(4, 16)) + list(range(112, 122))  # blocks 0 and 7 (block size 16)
    assert _step(connector).final == []  # once
    connector.channel.take("h")
    assert not connector.channel.awaits_final("h")


def _step_of(connector, req_id: str, computed: int, count: int):
    return connector.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], num_computed_tokens=[computed]),
        num_scheduled_tokens={req_id: count}))


def test_a_finished_request_keeps_its_blocks_only_when_there_is_something_to_capture():
    """Delay-free True exactly when a FinalCapture goes down: an annotated request with its plan,
    up to what was computed; not a request aborted before its plan came back, one preempted (its
    blocks are gone, nothing computed), one whose order the in-process caller took back, or a
    rejected one. The capture ends at what was computed, or at capture_to."""
    from kvcomm.integrations.vllm.wire.channel import Order

    connector = _scheduler_connector()
    summary = {"prompt_tokens": 40, "exact_tokens": 0, "estimated_tokens": 0, "computed_tokens": 40,
               "fallback": True, "note": ""}
    done, pending, preempted = _request("done"), _request("pending"), _request("preempted")
    for request in (done, pending, preempted):
        connector.get_num_new_matched_tokens(request, 0)
    _step(connector)
    connector.update_connector_output(_output({"done": PlanAnswer(0, 8, summary), "preempted": PlanAnswer(0, 0, summary)}))
    done.num_computed_tokens = 44  # 40 prompt + 5 sampled, the last never fed back
    assert connector.request_finished(done, [3, 1, 4]) == (True, {"kvcomm": summary})
    assert connector.request_finished(pending, [2]) == (False, None)
    preempted.num_computed_tokens = 0
    assert connector.request_finished(preempted, [])[0] is False
    meta = _step(connector)
    assert meta.final == [FinalCapture("done", "request-done", (3, 1, 4), 16, 8, 44)]
    assert pickle.loads(pickle.dumps(meta)).final == meta.final  # crosses the process boundary
    assert [f.req_id for f in meta.finished] == ["done", "pending", "preempted"]  # the worker still forgets them
    assert not connector.channel.awaits_final("request-done")  # annotated: no in-process caller waits

    cut = _request("cut", n=10, options={"segments": [{"start": 2, "end": 8, "slot": "task"}]})
    connector.get_num_new_matched_tokens(cut, 0)
    _step(connector)
    connector.update_connector_output(_output({"cut": PlanAnswer(0, 0, {**summary, "prompt_tokens": 10}, capture_to=12)}))
    cut.num_computed_tokens = 14
    assert connector.request_finished(cut, [9])[0] is True
    assert _step(connector).final[0].end == 12  # capture_to

    taken = _request("taken", options={"handle": "gone"})
    connector.channel.place("gone", Order(None, 0, 45))
    connector.get_num_new_matched_tokens(taken, 0)
    connector.channel.take("gone")
    assert connector.request_finished(taken, [1, 2, 3]) == (False, None)
    bad = _request("bad", options={"segments": [{"start": 4, "end": 99, "slot": "task"}]})
    connector.get_num_new_matched_tokens(bad, 0)
    assert connector.request_finished(bad, [1, 2, 3])[0] is False
    assert _step(connector).final == []
    with pytest.raises(ValueError, match="do not lie in its 1 blocks of 16 tokens"):
        FinalCapture("x", "h", (1,), 16, 0, 17)


def test_request_finished_all_groups_passes_the_one_groups_blocks():
    connector = _scheduler_connector()
    request = _request("g")
    connector.get_num_new_matched_tokens(request, 0)
    _step(connector)
    connector.update_connector_output(_output({"g": PlanAnswer(0, 0, None)}))
    assert connector.request_finished_all_groups(request, ([6, 2, 8],))[0] is True
    assert _step(connector).final[0].block_ids == (6, 2, 8)
    with pytest.raises(RuntimeError, match="finished with 2 KV cache groups"):
        connector.request_finished_all_groups(_request("h"), ([1], [2]))


def test_a_request_whose_capture_would_exceed_the_budget_is_served_plainly_with_a_note():
    """The worker captures prompt + max_tokens positions x layers x K and V x heads x head_dim x
    dtype bytes on the KV device, outside vLLM's budget: here 1 layer x 2 x 3 x 64 x 4 = 1,536
    bytes a position. Over max_capture_bytes the request is not planned (no ask, nothing
    claimed or captured); the reason comes back in its kv_transfer_params."""
    from kvcomm.integrations.vllm.connector.scheduler import capture_bytes_per_token

    connector = _scheduler_connector(max_capture_bytes=45 * 1536)
    assert capture_bytes_per_token(connector.scheduler._kv_cache_config) == 1536
    fits, too_big = _request("fits", n=40), _request("big", n=41)  # 40 + 5 positions fit, 41 + 5 do not
    assert connector.get_num_new_matched_tokens(fits, 0) == (None, False)
    assert connector.get_num_new_matched_tokens(too_big, 0) == (0, False)
    assert [ask.req_id for ask in _step(connector).asks] == ["fits"]
    _, params = connector.request_finished(too_big, [])
    assert "would capture 70656 bytes" in params["kvcomm"]["error"] and "max_capture_bytes 69120" in params["kvcomm"]["error"]
    with pytest.raises(ValueError, match="max_capture_bytes must be a positive number of bytes"):
        _scheduler_connector(max_capture_bytes=0)


def test_captures_in_flight_together_stay_within_the_budget():
    """max_capture_bytes bounds the captures of all requests in flight: prompt + max_tokens
    positions are reserved at the ask, cut to the plan's capture range at the answer (here the
    prompt's computed tail only), and released when the worker reports it let the capture go
    (learned from: maybe steps after the request's Finished went down); a request that does not
    fit is served plainly."""
    position = 1536
    connector = _scheduler_connector(max_capture_bytes=100 * position)
    scheduler = connector.scheduler
    a, b, c = _request("a"), _request("b"), _request("c")  # 40 + 5 positions each
    assert connector.get_num_new_matched_tokens(a, 0) == (None, False)
    assert connector.get_num_new_matched_tokens(b, 0) == (None, False)
    assert scheduler.capture_bytes_held == 90 * position
    assert connector.get_num_new_matched_tokens(c, 0) == (0, False)  # 135 positions would not fit
    assert "requests in flight hold 138240 bytes" in connector.request_finished(c, [])[1]["kvcomm"]["error"]
    assert [ask.req_id for ask in _step(connector).asks] == ["a", "b"]
    summary = {"prompt_tokens": 40, "exact_tokens": 20, "estimated_tokens": 0, "computed_tokens": 20,
               "fallback": False, "note": ""}
    connector.update_connector_output(_output({"a": PlanAnswer(20, 20, summary, capture_to=40)}))
    assert scheduler.capture_bytes_held == (20 + 45) * position  # a captures [20, 40) only
    d = _request("d", n=30)
    assert connector.get_num_new_matched_tokens(d, 0) == (None, False)  # 65 + 35 = 100 positions: fits
    assert scheduler.capture_bytes_held == 100 * position
    connector.request_finished(a, [])
    assert scheduler.capture_bytes_held == 100 * position  # the worker has not freed a's buffer yet
    assert _step(connector).finished[0].req_id == "a"
    for _ in range(3):  # the worker is still learning from it (its step's learning budget was spent)
        _step(connector)
        connector.update_connector_output(_output({}))
        assert scheduler.capture_bytes_held == 100 * position
    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvcommWorkerMetadata({}, ("a",))))
    assert scheduler.capture_bytes_held == 80 * position  # learned: the buffer is gone
    e = _request("e", n=15, options={"segments": [{"start": 2, "end": 10, "slot": "task"}]})
    assert connector.get_num_new_matched_tokens(e, 0) == (None, False)  # 80 + 20 = 100


def test_an_opted_in_request_under_a_lora_adapter_is_asked_for_with_the_adapters_identity(tmp_path):
    """vLLM hands the connector the Request with its lora_request; the worker plans it in the
    tenant's engine for that adapter, named by ``adapter_identity``: the same for the same
    adapter, another for another name, another path, or the same path with other files."""
    from vllm.lora.request import LoRARequest

    from kvcomm.integrations.vllm.connector.scheduler import adapter_identity

    folder = tmp_path / "critic"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    connector = _scheduler_connector()
    persona, base = _request("lora"), _request("base")
    persona.lora_request, base.lora_request = LoRARequest("critic-persona", 1, str(folder)), None
    assert connector.get_num_new_matched_tokens(persona, 0) == (None, False)
    assert connector.get_num_new_matched_tokens(base, 0) == (None, False)
    asks = {ask.req_id: ask for ask in _step(connector).asks}
    same = adapter_identity(LoRARequest("critic-persona", 7, str(folder)))
    assert asks["lora"].adapter == same and len(same) == 24 and asks["base"].adapter is None
    assert pickle.loads(pickle.dumps(asks["lora"])) == asks["lora"]
    assert adapter_identity(LoRARequest("writer-persona", 1, str(folder))) != same
    assert adapter_identity(LoRARequest("critic-persona", 1, str(tmp_path))) != same
    (folder / "adapter_model.safetensors").write_bytes(b"other weights")
    assert adapter_identity(LoRARequest("critic-persona", 1, str(folder))) != same  # replaced weights: another adapter


def _captured_from(connector, request, hit: int) -> tuple[int, dict]:
    """The first position the request's capture holds when it finishes, with vLLM's hit at
    ``hit``; and its kv_transfer_params."""
    connector.update_state_after_alloc(request, None, 0)
    delay, params = connector.request_finished(request, [1, 2, 3])
    (final,) = _step(connector).final
    assert delay and final.req_id == request.request_id
    return final.start, params


def test_a_prefix_hit_on_blocks_that_may_hold_approximate_kv_is_not_learned_from():
    """vLLM's prefix cache may serve a later request (same salt) blocks into which kvcomm loaded
    estimates, or blocks computed after them. A plan that computes those positions would learn
    them as real KV; instead the request learns nothing from its prompt (its capture starts at
    the hit) and says so. A hit on blocks of a request that reused exactly is learned from."""
    connector = _scheduler_connector()
    connector.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3],), block_pool=None))
    summary = {"prompt_tokens": 40, "exact_tokens": 0, "estimated_tokens": 16, "computed_tokens": 24,
               "fallback": False, "note": ""}
    computed = {**summary, "estimated_tokens": 0, "computed_tokens": 40, "fallback": True}

    def planned(req_id: str, hashes: list[str], answer: PlanAnswer):
        request = _request(req_id)
        request.block_hashes = hashes
        connector.get_num_new_matched_tokens(request, 0)
        _step(connector)
        connector.update_connector_output(_output({req_id: answer}))
        return request

    estimated = planned("est", ["h0", "h1"], PlanAnswer(32, 32, summary))
    assert connector.get_num_new_matched_tokens(estimated, 0) == (32, False)
    connector.update_state_after_alloc(estimated, None, 32)  # kvcomm loads [0, 32): estimates among them
    connector.request_finished(estimated, [])
    exact = planned("exact", ["e0", "e1"], PlanAnswer(32, 32, {**summary, "exact_tokens": 32, "estimated_tokens": 0}))
    connector.get_num_new_matched_tokens(exact, 0)
    connector.update_state_after_alloc(exact, None, 32)
    connector.request_finished(exact, [])

    tainted = planned("after-est", ["h0", "h1"], PlanAnswer(0, 0, computed))  # planned to compute everything
    assert connector.get_num_new_matched_tokens(tainted, 32) == (0, False)  # vLLM's hit: the estimated blocks
    start, params = _captured_from(connector, tainted, 32)
    assert start == 32  # the prompt stays incomplete: nothing learned
    assert "may hold approximate KV: not learned from" in params["kvcomm"]["note"]
    clean = planned("after-exact", ["e0", "e1"], PlanAnswer(0, 0, computed))
    assert connector.get_num_new_matched_tokens(clean, 32) == (0, False)
    start, params = _captured_from(connector, clean, 32)
    assert start == 0  # exact blocks: learned from as before
    assert "approximate" not in params["kvcomm"]["note"]
