"""kvcomm's own time per engine step (``vllm.connector.step_time``): the clock itself, then the connector's
hooks and the plan-ahead RPC timed in the in-process engine, one observation per engine step
and side."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from kvcomm.integrations.vllm.connector.step_time import SIDES, StepClock


def _sample(name: str, side: str) -> float:
    return REGISTRY.get_sample_value(name, {"side": side}) or 0.0


def _observed(side: str) -> tuple[float, float, float]:
    """(steps, wall seconds, CPU seconds) observed so far for ``side`` in this process."""
    return (_sample("kvcomm_step_seconds_count", side), _sample("kvcomm_step_seconds_sum", side),
            _sample("kvcomm_step_cpu_seconds_sum", side))


def test_a_step_sums_its_calls_wall_and_cpu_time_and_the_longest_is_kept():
    clock = StepClock("rpc")
    steps, wall, cpu = _observed("rpc")

    @clock.timed()
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    @clock.timed()
    def fail() -> None:
        deadline = time.thread_time() + 0.01
        while time.thread_time() < deadline:
            pass
        raise ValueError

    @clock.timed(ends_step=True)
    def last() -> str:
        return "answer"

    sleep(0.02)
    with pytest.raises(ValueError):
        fail()
    sleep(0.01)
    assert clock.wall >= 0.04 and clock.cpu >= 0.01 and _observed("rpc")[0] == steps  # not ended yet
    assert last() == "answer"
    after = _observed("rpc")
    assert after[0] == steps + 1 and after[1] - wall >= 0.04
    assert 0.01 <= after[2] - cpu < 0.03  # sleeping costs no CPU time; the busy loop does
    assert clock.wall == clock.cpu == 0.0 and clock.longest >= 0.04
    assert REGISTRY.get_sample_value("kvcomm_step_max_seconds", {"side": "rpc"}) == clock.longest
    last()  # an empty step: observed, the longest kept
    assert _observed("rpc")[0] == steps + 2
    assert REGISTRY.get_sample_value("kvcomm_step_max_seconds", {"side": "rpc"}) == clock.longest >= 0.04


def test_every_side_is_exported_from_the_start():
    for side in SIDES:
        for name in ("kvcomm_step_seconds_count", "kvcomm_step_cpu_seconds_count", "kvcomm_step_max_seconds",
                     "kvcomm_step_cpu_max_seconds"):
            assert REGISTRY.get_sample_value(name, {"side": side}) is not None, (name, side)


@pytest.mark.slow
def test_the_connector_hooks_and_plan_ahead_are_timed_once_per_engine_step(vllm_llm, vllm_executor, own_tenant):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcomm.integrations.vllm.connector.worker_extension import KvcommWorkerExtension

    text = " ".join(f"pump {n} failed at the river station, the engineer wrote in report {n % 7}." for n in range(24))
    ids = vllm_executor.encode(text)
    assert len(ids) > 200  # several 64-token chunks: several prefill steps
    before = {side: _observed(side) for side in SIDES}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"kvcomm": {"tenant": own_tenant}}})  # detected, planned
    output = vllm_llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=own_tenant)], params, use_tqdm=False)[0]
    assert "error" not in output.kv_transfer_params["kvcomm"], output.kv_transfer_params
    answer = KvcommWorkerExtension().kvcomm_plan_ahead("step-time-ticket", ids, {"tenant": own_tenant})
    assert "error" not in answer, answer
    grown = {side: [a - b for a, b in zip(_observed(side), before[side])] for side in SIDES}
    print(f"\nsteps, wall s, CPU s per side: {grown}")
    worker, scheduler, ahead = grown["worker"], grown["scheduler"], grown["rpc"]
    # one pending step (the plan asked), 4+ prefill chunks, 5 decode steps; the worker's step
    # ends with each execution, the scheduler's with each schedule(): as many of each
    assert worker[0] >= 10 and worker[0] == scheduler[0], grown
    assert worker[1] > 0 and worker[2] > 0 and scheduler[1] > 0 and scheduler[2] > 0, grown
    assert ahead[0] == 1 and ahead[1] > 0, grown
    for side in SIDES:
        assert REGISTRY.get_sample_value("kvcomm_step_max_seconds", {"side": side}) >= grown[side][1] / grown[side][0]
