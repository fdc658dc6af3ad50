"""The quality guard (shadow mode) against dense prefill of real models."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvcomm.anchors.pool import PoolConfig
from kvcomm.engine import ReuseConfig, ReuseEngine
from kvcomm.pipeline import parse_pipeline
from kvcomm.plan import ReusePlan
from kvcomm.quality_guard import GuardConfig, QualityGuard
from kvcomm.rope import Rotary
from kvcomm.runner import run_agent, run_row
from kvcomm.segments import Prompt, Segment
from one_thread import one_thread  # noqa: F401 (autouse fixture)
from two_agent_case import PIPELINE, agent_prompt

SPEC = parse_pipeline({**PIPELINE, "max_new_tokens": 2})


def _run(executor, guard: QualityGuard | None, gamma: float = 1.0):
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=gamma)))
    started = time.perf_counter()
    calls = [c for row in range(len(SPEC.inputs)) for c in run_row(SPEC, row, executor, engine, guard=guard)]
    return engine, calls, time.perf_counter() - started


@pytest.mark.slow
def test_tiny_budget_disables_the_slot_and_huge_budget_never_acts(smol_executor, caplog):
    baseline_engine, baseline, dense_free_s = _run(smol_executor, None)
    relaxed = QualityGuard(GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    relaxed_engine, calls, guarded_s = _run(smol_executor, relaxed)
    # a guard that never acts changes nothing: same decisions, same replies
    assert [(c.provenance.estimated_tokens, c.reply_ids) for c in calls] == [
        (c.provenance.estimated_tokens, c.reply_ids) for c in baseline]
    estimated = [c for c in calls if c.provenance.estimated_tokens > 0]
    metrics = relaxed.metrics()
    assert estimated and metrics["shadowed"] == len(estimated)
    assert not any(s["disabled"] or s["tightenings"] for s in metrics["slots"].values())
    assert all(s["kl_mean"] > 0 for s in metrics["slots"].values())  # estimates are not exact here
    assert relaxed_engine.pool("doc").config.gamma == 1.0
    overhead = guarded_s / dense_free_s - 1
    print(f"shadow mode at fraction 1.0: {guarded_s:.1f} s vs {dense_free_s:.1f} s without guard "
          f"(+{100 * overhead:.0f}%, {metrics['shadowed']} of {len(calls)} calls shadowed, "
          f"{metrics['shadow_seconds']:.1f} s in shadow prefills); KL per slot "
          f"{ {k: round(v['kl_mean'], 4) for k, v in metrics['slots'].items()} }")

    strict = QualityGuard(GuardConfig(fraction=1.0, budget=1e-9, min_samples=1, action="disable"))
    with caplog.at_level(logging.WARNING, logger="kvcomm.quality_guard"):
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
    shadow KL must be ~0: the guard compares the right two distributions."""
    engine = ReuseEngine(smol_executor.rotary, ReuseConfig(exact_prefix=False))
    guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e-3, min_samples=1))
    prompt = agent_prompt(smol_executor, SPEC.agents[1], {"doc": SPEC.inputs[0]["doc"], "reader": "A river."})
    run_agent(smol_executor, engine, prompt, 2, guard=guard)
    _, provenance = run_agent(smol_executor, engine, prompt, 2, guard=guard)
    assert provenance.estimated_tokens > 0
    metrics = guard.metrics()
    assert metrics["shadowed"] == 1
    assert all(s["kl_last"] < 1e-6 and not s["disabled"] for s in metrics["slots"].values())


@pytest.mark.slow
def test_tighten_lowers_gamma_then_disables(tiny_executor):
    guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e-12, min_samples=1, max_tightenings=2))
    engine, calls, _ = _run(tiny_executor, guard)
    engine2, calls2, _ = _run(tiny_executor, None)
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
            GuardConfig(**bad)
    guard = QualityGuard()
    rotary = Rotary(torch.ones(4))
    plan = ReusePlan(Prompt("t", (Segment((1, 2, 3)),)))
    guard.restrict(ReuseEngine(rotary), plan)
    with pytest.raises(ValueError, match="one guard per engine"):
        guard.restrict(ReuseEngine(rotary), plan)
