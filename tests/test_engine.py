"""The reuse engine against dense prefill of real models."""

from __future__ import annotations

import pytest
import torch

from kvcomm.anchors.pool import PoolConfig
from kvcomm.engine import ReuseConfig, ReuseEngine
from kvcomm.pipeline import parse_pipeline
from kvcomm.runner import run_agent, run_row
from kvcomm.segments import Prompt
from two_agent_case import PIPELINE, agent_prompt


def _prompt(executor, spec, agent_index: int, row: dict) -> Prompt:
    return agent_prompt(executor, spec.agents[agent_index], row)


@pytest.mark.slow
def test_first_call_falls_back_to_exactly_dense(smol_executor):
    spec = parse_pipeline(PIPELINE)
    prompt = _prompt(smol_executor, spec, 0, spec.inputs[0])
    engine = ReuseEngine(smol_executor.rotary)
    dense, dense_prov = run_agent(smol_executor, None, prompt, 12)
    reuse, prov = run_agent(smol_executor, engine, prompt, 12)
    assert prov.fallback and prov.estimated_tokens == 0 and prov.exact_tokens == 0
    assert reuse.reply_ids == dense.reply_ids
    assert torch.equal(reuse.computed.keys, dense.computed.keys)
    assert torch.equal(reuse.computed.values, dense.computed.values)


@pytest.mark.slow
@pytest.mark.parametrize("exact_prefix", [True, False])
def test_same_context_reproduces_dense_kv_and_tokens(smol_executor, exact_prefix):
    """Behind the same preceding text it was recorded with, a reused segment is exact:
    through the prefix store, or (store off) realigned base + its own recorded deviation."""
    spec = parse_pipeline(PIPELINE)
    executor = smol_executor
    engine = ReuseEngine(executor.rotary, ReuseConfig(exact_prefix=exact_prefix))
    prompt = _prompt(executor, spec, 1, {"doc": spec.inputs[0]["doc"], "reader": "A river flows through Paris."})
    dense, _ = run_agent(executor, None, prompt, 12)
    run_agent(executor, engine, prompt, 12)  # records anchors, fixed bases, prefix
    plan = engine.plan(prompt, executor.base_kv)
    kv = engine.materialize(plan)
    assert plan.reuse_end == len(prompt) - 1  # everything but the last token is reused
    if exact_prefix:
        assert plan.exact_length == len(prompt) - 1
    else:
        assert plan.estimated_tokens > 0 and all(p.match.identical for p in plan.pieces)
    full = executor.generate(prompt.token_ids, None, 1, None).computed
    assert (kv.keys - full.keys[:, :, : kv.length]).abs().max() <= 1e-4
    assert (kv.values - full.values[:, :, : kv.length]).abs().max() <= 1e-4
    assert executor.generate(prompt.token_ids, kv, 12, None).reply_ids == dense.reply_ids


@pytest.mark.slow
def test_estimation_kicks_in_after_two_anchors_and_learns(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    provenance = [[c.provenance for c in run_row(spec, row, tiny_executor, engine)] for row in range(4)]
    first_reader = [p[0] for p in provenance]
    assert first_reader[0].fallback and first_reader[1].fallback  # pools hold <= 1 anchor
    assert first_reader[2].estimated_tokens > 0 and not first_reader[2].fallback
    assert len(engine.pool("doc")) == 2  # the two dense samples became anchors, reused ones did not
    for p in (c for row in provenance for c in row):
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens
        assert p.computed_tokens >= 1  # the last prompt token is always recomputed


@pytest.mark.slow
def test_segment_longer_than_every_anchor_reuses_covered_head(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    for row in spec.inputs[:2]:
        run_agent(tiny_executor, engine, _prompt(tiny_executor, spec, 0, row), 4)
    longest = max(a.length for a in engine.pool("doc").anchors)
    long_doc = " ".join(r["doc"] for r in spec.inputs)
    prompt = _prompt(tiny_executor, spec, 0, {"doc": long_doc})
    plan = engine.plan(prompt, tiny_executor.base_kv)
    shared = next(i for i, s in enumerate(prompt.segments) if s.is_shared)
    assert len(prompt.segments[shared]) > longest
    assert plan.reuse_end == prompt.starts[shared] + longest
    assert "covered" in plan.note
    generation = tiny_executor.generate(prompt.token_ids, engine.materialize(plan), 4, None)
    engine.learn(plan, generation.computed)
    assert len(engine.pool("doc")) == 2  # a partially estimated sample does not become an anchor


@pytest.mark.slow
def test_bfloat16_anchors_halve_pool_bytes_and_still_estimate(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    pools = {}
    for dtype in (None, torch.bfloat16):
        engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), anchor_dtype=dtype))
        for row in range(3):
            run_row(spec, row, tiny_executor, engine)
        prompt = _prompt(tiny_executor, spec, 0, spec.inputs[3])
        kv = engine.materialize(engine.plan(prompt, tiny_executor.base_kv))
        assert kv.keys.dtype == torch.float32  # served in the model's KV dtype
        pools[dtype] = engine.pool("doc")
    assert [a.segment_id for a in pools[None].anchors] == [a.segment_id for a in pools[torch.bfloat16].anchors]
    assert pools[torch.bfloat16].nbytes * 2 == pools[None].nbytes
