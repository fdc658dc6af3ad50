"""The quality guard (dense twins) against dense prefill of real models."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.plan import ReusePlan
from kvcomm.services.quality_guard import GuardConfig, QualityGuard
from kvcomm.core.rope import Rotary
from kvcomm.reuse.runner import run_agent, run_row
from kvcomm.core.segments import Prompt, Segment
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from support.two_agent_case import PIPELINE, agent_prompt

SPEC = parse_pipeline({**PIPELINE, "max_new_tokens": 2})


def _run(executor, guard: QualityGuard | None, gamma: float = 1.0, base_source: str = "first_use"):
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=gamma), base_source=base_source))
    started = time.perf_counter()
    calls = [c for row in range(len(SPEC.inputs)) for c in run_row(SPEC, row, executor, engine, step=guard.run_agent if guard else run_agent)]
    return engine, calls, time.perf_counter() - started


@pytest.mark.slow
def test_tiny_budget_disables_the_slot_and_huge_budget_never_acts(smol_executor, caplog):
    baseline_engine, baseline, dense_free_s = _run(smol_executor, None)
    relaxed = QualityGuard(GuardConfig(fraction=1.0, learn=False, budget=1e9, min_samples=1))
    relaxed_engine, calls, guarded_s = _run(smol_executor, relaxed)
    # a guard that never acts changes nothing: same decisions, same replies
    assert [(c.provenance.estimated_tokens, c.reply_ids) for c in calls] == [
        (c.provenance.estimated_tokens, c.reply_ids) for c in baseline]
    estimated = [c for c in calls if c.provenance.estimated_tokens > 0]
    metrics = relaxed.metrics()
    assert estimated and metrics["measured"] == len(estimated)
    assert not any(s["disabled"] or s["tightenings"] for s in metrics["slots"].values())
    assert all(s["kl_mean"] > 0 for s in metrics["slots"].values())  # estimates are not exact here
    assert relaxed_engine.pool("doc").config.gamma == 1.0
    overhead = guarded_s / dense_free_s - 1
    print(f"the guard at fraction 1.0: {guarded_s:.1f} s vs {dense_free_s:.1f} s without guard "
          f"(+{100 * overhead:.0f}%, {metrics['measured']} of {len(calls)} calls measured, "
          f"{metrics['twin_seconds']:.1f} s in dense twins); KL per slot "
          f"{ {k: round(v['kl_mean'], 4) for k, v in metrics['slots'].items()} }")

    strict = QualityGuard(GuardConfig(fraction=1.0, learn=False, budget=1e-9, min_samples=1, action="disable"))
    with caplog.at_level(logging.WARNING, logger="kvcomm.services.quality_guard"):
        strict_engine, calls, _ = _run(smol_executor, strict)
    first = next(i for i, c in enumerate(calls) if c.provenance.estimated_tokens > 0)
    slot = next(iter(strict.metrics()["slots"]))
    assert strict.disabled(slot) and "exceeds budget" in caplog.text and slot in caplog.text
    assert any("quality guard: reuse disabled" in c.provenance.note for c in calls[first + 1:])
    assert sum(c.provenance.estimated_tokens for c in calls) < sum(c.provenance.estimated_tokens for c in baseline)
    for c in calls[first + 1:]:  # replanned now, no call would reuse a disabled slot's content
        agent = next(a for a in SPEC.agents if a.name == c.agent)
        prompt = agent_prompt(smol_executor, agent, {"doc": SPEC.inputs[c.input_index]["doc"], "reader": "x"})
        plan = strict_engine.plan(prompt, smol_executor.base_kv)
        strict.restrict(strict_engine, plan)
        assert not any(strict.disabled(prompt.segments[p.segment_index].slot) for p in plan.pieces)


@pytest.mark.slow
def test_exact_reuse_measures_zero_kl(smol_executor):
    """Behind the context it was recorded in, a reused segment reproduces dense KV, so the
    twin KL must be ~0: the guard compares the right two distributions. (first_use: the first
    run takes the bases, the second and third reuse them realigned, which is exact behind this
    context; a prefix store with no room, so they serve no exact prefix. Both are sampled.)"""
    engine = ReuseEngine(smol_executor.rotary, ReuseConfig(prefix_store_bytes=0))
    guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e-3, min_samples=1))
    prompt = agent_prompt(smol_executor, SPEC.agents[1], {"doc": SPEC.inputs[0]["doc"], "reader": "A river."})
    for _ in range(2):
        guard.run_agent(smol_executor, engine, prompt, 2)
    _, provenance = guard.run_agent(smol_executor, engine, prompt, 2)
    assert provenance.estimated_tokens > 0
    metrics = guard.metrics()
    assert metrics["measured"] == 2
    assert all(s["kl_last"] < 1e-6 and not s["disabled"] for s in metrics["slots"].values())


@pytest.mark.slow
def test_tighten_lowers_gamma_then_disables(tiny_executor):
    guard = QualityGuard(GuardConfig(fraction=1.0, learn=False, budget=1e-12, min_samples=1, max_tightenings=2))
    # standalone bases estimate from the second row on: enough measured samples in four rows to
    # tighten twice and disable (first_use estimates only the asker's last two rows)
    engine, calls, _ = _run(tiny_executor, guard, base_source="standalone")
    engine2, calls2, _ = _run(tiny_executor, None, base_source="standalone")
    state = guard.metrics()["slots"]
    assert state and any(s["tightenings"] >= 1 for s in state.values())
    for s in state.values():
        assert s["gamma"] == pytest.approx(0.5 ** s["tightenings"])  # each breach halves gamma
        assert s["disabled"] == (s["samples"] > 2)  # the third breach, after 2 tightenings, disables
    assert sum(c.provenance.estimated_tokens for c in calls) < sum(c.provenance.estimated_tokens for c in calls2)


def test_bad_guard_config_is_refused_and_a_guard_serves_one_engine():
    for bad, message in (({"fraction": 1.5}, "fraction"), ({"budget": -1}, "budget"), ({"action": "raise"}, "action"),
                         ({"min_samples": 50}, "min_samples"), ({"tighten_factor": 1.0}, "tighten_factor")):
        with pytest.raises(ValueError, match=message):
            GuardConfig(**{"budget": 0.1, **bad})
    for floor, times, message in ((-1e-4, 5, "floor"), (float("nan"), 5, "floor"), (1e-4, -1, "multiple"),
                                  (1e-4, float("inf"), "multiple")):
        with pytest.raises(ValueError, match=message):
            GuardConfig.for_floor(floor, times)
    guard = QualityGuard(GuardConfig(budget=0.1))
    rotary = Rotary(torch.ones(4))
    plan = ReusePlan(Prompt("t", (Segment((1, 2, 3)),)))
    guard.restrict(ReuseEngine(rotary), plan)
    with pytest.raises(ValueError, match="one guard per engine"):
        guard.restrict(ReuseEngine(rotary), plan)


def _estimated_plan(executor):
    """(engine, plan) of a prompt whose shared segment is estimated from an anchor: the same
    prompt seen twice before (a prefix store with no room, so only the anchor path can reuse
    it; the first call, the agent's first, serves the cold slot realigned behind its new
    system prompt, the second, a dense calibration call, makes it an anchor: its very
    deviation, served without further evidence)."""
    engine = ReuseEngine(executor.rotary, ReuseConfig(prefix_store_bytes=0, base_source="standalone"))
    prompt = agent_prompt(executor, SPEC.agents[1], {"doc": SPEC.inputs[0]["doc"], "reader": "A river."})
    run_agent(executor, engine, prompt, 1)
    run_agent(executor, engine, prompt, 1, calibrate=True)
    plan = engine.plan(prompt, executor.base_kv)
    assert plan.estimated_tokens > 0 and any(p.match is not None and p.match.identical for p in plan.pieces)
    return engine, prompt, plan


def test_sampling_measures_the_configured_fraction_of_estimated_requests(tiny_executor):
    """``fraction`` is the share of requests with estimated KV that are measured: over n draws
    the count is Binomial(n, fraction), drawn from the guard's own seeded RNG, so the check
    below is deterministic (it sits 4 standard deviations wide). Requests that estimated
    nothing are never measured, even at fraction 1."""
    _, prompt, plan = _estimated_plan(tiny_executor)
    slots = tuple(dict.fromkeys(prompt.segments[p.segment_index].slot for p in plan.pieces
                                if prompt.segments[p.segment_index].is_shared))
    n = 4000
    for fraction in (0.0, 0.05, 0.25, 0.8, 1.0):
        guard = QualityGuard(GuardConfig(budget=0.1, fraction=fraction))
        picks = [guard.sample(plan) for _ in range(n)]
        count = sum(bool(p) for p in picks)
        spread = 4 * (n * fraction * (1 - fraction)) ** 0.5
        assert abs(count - n * fraction) <= spread, (fraction, count)
        assert all(p == slots for p in picks if p)  # a sample goes to every slot the request estimated
        if 0 < fraction < 1:
            again = QualityGuard(GuardConfig(budget=0.1, fraction=fraction))
            assert [bool(again.sample(plan)) for _ in range(n)] == [bool(p) for p in picks]  # seeded
            other = QualityGuard(GuardConfig(budget=0.1, fraction=fraction, seed=1))
            assert [bool(other.sample(plan)) for _ in range(n)] != [bool(p) for p in picks]
    computed_only = ReusePlan(prompt)
    assert QualityGuard(GuardConfig(budget=0.1, fraction=1.0)).sample(computed_only) == ()


def test_fraction_zero_never_measures_a_pipeline(tiny_executor):
    """The runner measures only what ``sample`` picked: at fraction 0 no dense prefill runs,
    though calls estimated KV."""
    guard = QualityGuard(GuardConfig(fraction=0.0, budget=0.0, min_samples=1, action="disable"))
    _, calls, _ = _run(tiny_executor, guard)
    assert any(c.provenance.estimated_tokens > 0 for c in calls)
    metrics = guard.metrics()
    assert metrics["measured"] == 0 and metrics["slots"] == {}
    assert not any("quality guard" in c.provenance.note for c in calls)


def _twin_kls(executor):
    """(engine, prompt, reuse log-probs giving KL ~0, reuse log-probs giving KL > 1): the
    first is the dense distribution itself, the second one that puts nearly all its mass on
    dense's top token, leaving almost none for the rest (which holds most of the dense mass
    of this near-uniform random model)."""
    engine, prompt, _ = _estimated_plan(executor)
    dense = executor.generate(prompt.token_ids, None, 1, time.perf_counter(), keep_logprobs=True).prompt_logprobs[-1]
    wrong = torch.zeros_like(dense)
    wrong[int(dense.argmax())] = 30.0
    return engine, prompt, dense, torch.log_softmax(wrong, -1)


def test_the_guard_acts_on_the_rolling_window_after_min_samples(tiny_executor):
    """The rolling mean covers the last ``window`` samples only, and the guard does not act
    before ``min_samples`` samples; samples are fed through ``measure`` (a real dense prefill)
    with reuse distributions of known KL: ~0 (the dense one) or K > 1 (a wrong one)."""
    engine, ids, dense, wrong = _twin_kls(tiny_executor)
    probe = QualityGuard(GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    high = probe.measure(tiny_executor, engine, ids, wrong, ("doc",))
    low = probe.measure(tiny_executor, engine, ids, dense, ("doc",))
    assert high > 1.0 and 0 <= low < 1e-6

    guard = QualityGuard(GuardConfig(fraction=1.0, budget=0.4 * high, window=3, min_samples=3, action="disable"))
    expected_disabled = []
    # K alone exceeds the budget, but 1 < min_samples; [K, 0, 0] and [0, 0, K] average K/3
    # (the whole history's 2K/4 would exceed the budget); [0, K, K] averages 2K/3: disable.
    for reuse, disabled in ((wrong, False), (dense, False), (dense, False), (wrong, False), (wrong, True)):
        guard.measure(tiny_executor, engine, ids, reuse, ("doc",))
        expected_disabled.append(disabled)
        assert guard.disabled("doc") == disabled, (len(expected_disabled), guard.metrics())
    state = guard.metrics()["slots"]["doc"]
    assert state["samples"] == 5 and state["kl_mean"] == pytest.approx((low + 2 * high) / 3, rel=1e-3)
    assert "over the last 3 measured requests" in state["reason"]


def test_tightening_restarts_the_window_so_min_samples_applies_again(tiny_executor):
    engine, ids, _, wrong = _twin_kls(tiny_executor)
    guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e-3, window=4, min_samples=2, max_tightenings=5))
    gamma = engine.pool("doc").config.gamma
    tightenings = []
    for _ in range(6):
        guard.measure(tiny_executor, engine, ids, wrong, ("doc",))
        tightenings.append(guard.metrics()["slots"]["doc"]["tightenings"])
    # every second sample completes a fresh window of min_samples = 2 and tightens once more
    assert tightenings == [0, 1, 1, 2, 2, 3]
    assert engine.pool("doc").config.gamma == pytest.approx(gamma * 0.5 ** 3) and not guard.disabled("doc")


def test_a_tightened_slot_loosens_back_after_a_full_window_well_within_budget(tiny_executor):
    """Admission adapts both ways: breaches tighten gamma; a full window whose mean is at or
    below ``loosen_below * budget`` gives one tightening back, never past the gamma the slot
    had before; a window between the two thresholds changes nothing."""
    engine, ids, dense, wrong = _twin_kls(tiny_executor)
    high = QualityGuard(GuardConfig(fraction=1.0, budget=1e9)).measure(tiny_executor, engine, ids, wrong, ("doc",))
    gamma = engine.pool("doc").config.gamma
    guard = QualityGuard(GuardConfig(fraction=1.0, budget=0.6 * high, window=2, min_samples=1, loosen_below=0.25))
    steps = []
    # K > budget twice: two tightenings; [0] is not a full window; [0, 0]: loosen; [0, K] = K/2
    # is within budget but above loosen_below * budget: nothing; [K, 0] likewise; [0, 0]: loosen
    # back to the start, and no further
    for reuse in (wrong, wrong, dense, dense, dense, wrong, dense, dense, dense, dense):
        guard.measure(tiny_executor, engine, ids, reuse, ("doc",))
        state = guard.metrics()["slots"]["doc"]
        steps.append((state["tightenings"], state["loosenings"]))
    assert steps == [(1, 0), (2, 0), (2, 0), (1, 1), (1, 1), (1, 1), (1, 1), (0, 2), (0, 2), (0, 2)]
    assert engine.pool("doc").config.gamma == pytest.approx(gamma) and not guard.disabled("doc")
    assert "gamma raised to" in guard.metrics()["slots"]["doc"]["reason"]


@pytest.mark.parametrize("base_source", ["first_use", "standalone"])
def test_dense_twins_teach_the_pools_only_when_asked(tiny_executor, base_source):
    """``learn``: each measured request's dense prefill records its shared segments as anchors,
    which the estimating request itself never does, so pools grow past the two anchors a slot
    needs to estimate; without it a twin leaves the engine as it was."""
    sizes = {}
    for learn in (False, True):
        guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e9, learn=learn))
        engine, calls, _ = _run(tiny_executor, guard, base_source=base_source)
        assert guard.metrics()["measured"] > 0
        assert all(pool.problems() == [] for pool in engine.pools.values())
        sizes[learn] = sum(len(pool) for pool in engine.pools.values())
    baseline, _, _ = _run(tiny_executor, None, base_source=base_source)
    assert sizes[False] == sum(len(pool) for pool in baseline.pools.values()) < sizes[True]
