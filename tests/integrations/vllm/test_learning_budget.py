"""Learning in the engine step is bounded (``vllm.planning.worker_plans``): the worker learns at most
``LEARN_POSITIONS_PER_STEP`` captured positions a step (at least one request), the oldest first,
reports each capture it lets go so the scheduler releases its bytes, and ends with the state it
would have had learning every request at once. Driven as the worker side drives ``WorkerPlans``
(plan asks, captures placed on the channel as the layer hooks place them, finished requests),
on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from kvcomm.integrations.vllm.wire.channel import Capture, Channel  # noqa: E402
from kvcomm.integrations.vllm.wire.messages import Finished, PlanAsk, handle_of  # noqa: E402
from kvcomm.integrations.vllm.wire.params import SERVER_KEY, parse_params  # noqa: E402
from kvcomm.integrations.vllm.planning.worker_plans import LEARN_POSITIONS_PER_STEP, WorkerPlans  # noqa: E402


def _plans(executor) -> WorkerPlans:
    from vllm.config import VllmConfig

    from kvcomm.integrations.vllm.wire.config import ConnectorConfig
    from kvcomm.integrations.vllm.wire.config import transfer_config

    channel = Channel()
    channel.rotary = executor.rotary
    config = VllmConfig(kv_transfer_config=transfer_config(extra={"plan": True, "gamma": 1.0}))
    return WorkerPlans(config, channel, ConnectorConfig.from_vllm(config))


def _serve(plans: WorkerPlans, executor, req_id: str, length: int, seed: int, twin: bool = False) -> None:
    """Plan request ``req_id`` (a prompt of ``length`` tokens, one shared span; ``twin``: as the
    quality guard's dense twin) and capture what its order asks for, as the layer hooks would,
    from a real prefill."""
    ids = torch.randint(100, 9000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    body = {"kvcomm": {"tenant": "t", "segments": [{"start": 8, "end": length - 4, "slot": "doc"}]}}
    if twin:
        body = {"kvcomm": {**body["kvcomm"], "calibrate": True}, SERVER_KEY: {"purpose": "dense_twin"}}
    params = parse_params(body, length)
    assert plans.answer(PlanAsk(req_id, tuple(ids), params, True, 1), None).error is None
    order = plans.channel.order(handle_of(req_id))
    computed = executor.generate(ids, None, 1).computed
    layers, heads, _, dim = computed.keys.shape
    capture = Capture.empty(layers, heads, length - order.capture_from, dim, computed.keys.dtype, start=order.capture_from)
    capture.keys.copy_(computed.keys[:, :, order.capture_from:])
    capture.values.copy_(computed.values[:, :, order.capture_from:])
    capture.mark(torch.arange(order.capture_from, length))
    plans.channel.captures[handle_of(req_id)] = capture


def _held(plans: WorkerPlans) -> tuple:
    engine = plans.planner.engine("t")
    return engine.nbytes, sorted(engine.base_ids()), {slot: len(pool.anchors) for slot, pool in engine.pools.items()}


def test_a_burst_of_long_requests_is_learned_over_the_next_steps_within_the_budget(tiny_executor):
    long = LEARN_POSITIONS_PER_STEP * 3 // 5  # two do not fit in one step's budget
    burst, at_once = _plans(tiny_executor), _plans(tiny_executor)
    for plans in (burst, at_once):
        for i in range(3):
            _serve(plans, tiny_executor, f"long{i}", long, seed=i)
        for i in range(4):
            _serve(plans, tiny_executor, f"short{i}", 64, seed=10 + i)
    for i in range(3):
        at_once._finish(Finished(f"long{i}", ()), at_once._planned.pop(f"long{i}"),
                        at_once.channel.take(handle_of(f"long{i}"))[0])
    for i in range(4):
        at_once._finish(Finished(f"short{i}", ()), at_once._planned.pop(f"short{i}"),
                        at_once.channel.take(handle_of(f"short{i}"))[0])

    for req_id in [f"long{i}" for i in range(3)] + [f"short{i}" for i in range(4)]:  # all finish in one step
        burst.finish(Finished(req_id, ()))
    steps = []
    while burst.queued:
        steps.append(burst.learn())
    print(f"\nreleased per step: {steps}")
    assert steps == [("long0",), ("long1",), ("long2", "short0", "short1", "short2", "short3")]
    assert burst.learn() == () and _held(burst) == _held(at_once)  # the same state as learning all at once
    assert _held(at_once)[0] > 0 and len(_held(at_once)[1]) == 7  # every request's shared content has a base

    _serve(burst, tiny_executor, "lone", long + LEARN_POSITIONS_PER_STEP, seed=99)  # over the budget alone
    burst.finish(Finished("lone", ()))
    assert burst.learn() == ("lone",)  # at least one request a step
    burst.finish(Finished("aborted", ()))  # never planned (aborted before its answer): let go at once
    assert burst.learn() == ("aborted",)


def test_a_dense_twin_is_learned_within_the_budget_like_a_clients_request(tiny_executor):
    """The guard's dense twin learns its whole prompt (calibration): it waits in the same queue as
    a client's request instead of being learned in the step it finishes."""
    plans = _plans(tiny_executor)
    long = LEARN_POSITIONS_PER_STEP * 3 // 5
    _serve(plans, tiny_executor, "client", long, seed=1)
    _serve(plans, tiny_executor, "twin", long, seed=2, twin=True)
    assert plans._planned["twin"].purpose == "dense_twin"
    plans.finish(Finished("client", ()))
    plans.finish(Finished("twin", ()))
    assert plans.queued == 2  # nothing learned in the step they finished
    assert plans.learn() == ("client",) and plans.learn() == ("twin",)  # one step each: two do not fit
