"""kvblend's recompute chosen by the engine: span starts, then where the anchors disagree."""

from __future__ import annotations

import pytest
import torch

from kvcomm.reuse.config import ReuseConfig

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.plan import BlendRequest, ratio_count
from kvcomm.reuse.runner import run_agent, run_row
from support.two_agent_case import PIPELINE as TWO_AGENT_PIPELINE, agent_prompt

PIPELINE = {**TWO_AGENT_PIPELINE, "max_new_tokens": 6}


# -- configuration (no model) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "kvblend", "recompute_selection": "random"}, "unknown recompute_selection 'random'; valid: check_layer, disagreement"),
        ({"mode": "cacheblend", "recompute_selection": "disagreement"}, "needs anchor estimates: mode 'kvblend', not 'cacheblend'"),
        ({"mode": "kvblend", "recompute_boundary": -1}, "recompute_boundary must be an integer >= 0"),
    ],
)
def test_config_rejects_what_it_cannot_serve(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReuseConfig(**kwargs)


def test_blend_positions_are_checked_and_cut_with_the_plan():
    with pytest.raises(ValueError, match=r"sorted, distinct and in \[2, 9\)"):
        BlendRequest(2, 9, 0.5, 1, (3, 3))
    with pytest.raises(ValueError, match=r"in \[2, 9\)"):
        BlendRequest(2, 9, 0.5, 1, (1, 4))
    blend = BlendRequest(2, 9, 0.5, 1, (2, 5, 8))
    assert blend.count == 3 and BlendRequest(2, 9, 0.5, 1).count == ratio_count(0.5, 7) == 4
    assert blend.cut(6) == BlendRequest(2, 6, 0.5, 1, (2, 5))
    assert blend.cut(2) is None
    assert BlendRequest(2, 9, 0.5, 1).cut(6) == BlendRequest(2, 6, 0.5, 1)


# -- on a tiny model ---------------------------------------------------------------------------


def _prompt(executor, agent: int, fill: dict[str, str]):
    return agent_prompt(executor, parse_pipeline(PIPELINE).agents[agent], fill)


def _estimating_plan(executor, **config):
    """A kvblend engine whose asker estimates row 2's document from two anchors (rows 0 and 1)."""
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="kvblend", recompute_selection="disagreement", **config))
    spec = parse_pipeline(PIPELINE)
    for row in range(2):
        run_row(spec, row, executor, engine)
    run_agent(executor, engine, _prompt(executor, 0, PIPELINE["inputs"][2]), 1)
    prompt = _prompt(executor, 1, {"doc": PIPELINE["inputs"][2]["doc"], "reader": "A short summary of the text."})
    return engine, prompt, engine.plan(prompt, executor.base_kv)


@pytest.mark.slow
def test_recompute_takes_span_starts_and_the_executor_recomputes_exactly_them(tiny_executor):
    engine, prompt, plan = _estimating_plan(tiny_executor, recompute_ratio=0.3, recompute_boundary=2)
    blend = plan.blend
    assert blend is not None and blend.positions is not None
    assert (blend.start, blend.end) == (plan.exact_length, plan.reuse_end) and plan.estimated_tokens > 0
    assert blend.count == ratio_count(0.3, plan.estimated_tokens)
    starts = [p.start for p in plan.pieces] + [p.following_start for p in plan.pieces if p.following_base is not None]
    assert set(s + i for s in starts for i in range(2)) <= set(blend.positions)
    generation = tiny_executor.generate(prompt.token_ids, engine.materialize(plan), 1, None, blend=blend)
    assert generation.recomputed == blend.positions


@pytest.mark.slow
def test_the_token_the_anchors_dispute_is_the_one_recomputed(tiny_executor):
    """With a budget of one token and no span starts, the pick is the token where one anchor's
    deviation was pushed far from the other's: a selection blind to the anchors would miss it."""
    engine, prompt, plan = _estimating_plan(tiny_executor, recompute_ratio=1e-3, recompute_boundary=0)
    piece = next(p for p in plan.pieces if p.match is not None and len(p.match.anchors) >= 2)
    disputed = piece.base.length // 2
    deviation = piece.match.anchors[0].deviations[piece.match.slot].shared
    deviation.keys[:, :, disputed] += 100.0
    replanned = engine.plan(prompt, tiny_executor.base_kv)
    assert replanned.blend.positions == (piece.start + disputed,)


@pytest.mark.slow
def test_recomputing_every_estimated_token_is_dense(tiny_executor):
    engine, prompt, plan = _estimating_plan(tiny_executor, recompute_ratio=1.0)
    assert plan.blend.positions == tuple(range(plan.exact_length, plan.reuse_end))
    generation = tiny_executor.generate(prompt.token_ids, engine.materialize(plan), 4, None, blend=plan.blend)
    dense = tiny_executor.generate(prompt.token_ids, None, 4, None)
    end = plan.reuse_end
    assert (generation.computed.keys - dense.computed.keys[:, :, end:]).abs().max() <= 1e-4
    assert (generation.computed.values - dense.computed.values[:, :, end:]).abs().max() <= 1e-4
    assert generation.reply_ids == dense.reply_ids
    assert torch.equal(torch.tensor(generation.recomputed), torch.arange(plan.exact_length, end))
