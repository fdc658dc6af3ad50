"""The reuse engine against dense prefill of real models."""

from __future__ import annotations

import pytest
import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.runner import run_agent, run_row
from kvcomm.core.segments import Prompt
from support.two_agent_case import PIPELINE, agent_prompt
from support.evidence import earn


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
    through the prefix store, or (a store with no room, so no exact prefix can hit) its
    realigned base, which first_use took from this very context in the first run (the second
    run reuses it and computes nothing a pool could record: no anchors, no estimate)."""
    spec = parse_pipeline(PIPELINE)
    executor = smol_executor
    engine = ReuseEngine(executor.rotary, ReuseConfig() if exact_prefix else ReuseConfig(prefix_store_bytes=0))
    prompt = _prompt(executor, spec, 1, {"doc": spec.inputs[0]["doc"], "reader": "A river flows through Paris."})
    dense, _ = run_agent(executor, None, prompt, 12)
    for _ in range(2):
        run_agent(executor, engine, prompt, 12)  # records bases, then anchors, fixed bases, prefix
    plan = engine.plan(prompt, executor.base_kv)
    kv = engine.materialize(plan)
    assert plan.reuse_end == len(prompt) - 1  # everything but the last token is reused
    if exact_prefix:
        assert plan.exact_length == len(prompt) - 1
    else:
        assert plan.estimated_tokens > 0 and plan.provenance().realigned_tokens == plan.estimated_tokens
        assert all(p.match is None for p in plan.pieces) and len(engine.pool("doc")) == 0
    full = executor.generate(prompt.token_ids, None, 1, None).computed
    assert (kv.keys - full.keys[:, :, : kv.length]).abs().max() <= 1e-4
    assert (kv.values - full.values[:, :, : kv.length]).abs().max() <= 1e-4
    assert executor.generate(prompt.token_ids, kv, 12, None).reply_ids == dense.reply_ids


@pytest.mark.slow
def test_cold_slots_realign_and_calibration_calls_make_their_anchors(tiny_executor):
    """The estimate-or-realign rule on a real pipeline: each row's reader computes its new doc
    (first_use: its base), every asker after its first call serves that doc realigned (its
    slot holds no anchor and no evidence) and computes nothing of it, so no anchor is made (the asker's first call, which
    reused nothing, computed its doc: that one is); calibration calls of the asker make one per
    row, each also a measured pair once the pool can estimate."""
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    provenance = [[c.provenance for c in run_row(spec, row, tiny_executor, engine)] for row in range(4)]
    readers, askers = [p[0] for p in provenance], [p[1] for p in provenance]
    assert all(p.fallback and "new content" in p.note for p in readers[1:])
    assert askers[0].fallback and "has no base yet" in askers[0].note  # the asker's own template text: its first call
    assert all(not p.fallback and 0 < p.realigned_tokens == p.estimated_tokens for p in askers[1:])
    assert len(engine.pool("doc")) == 1  # the asker's first call, which reused nothing; the rest computed no doc
    for p in (c for row in provenance for c in row):
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens
        assert p.computed_tokens >= 1  # the last prompt token is always recomputed
    for row in range(3):
        _, calibrated = run_agent(tiny_executor, engine, _prompt(tiny_executor, spec, 1, {"doc": spec.inputs[row]["doc"], "reader": "A summary."}), 4,
                                  calibrate=True)
        assert calibrated.estimated_tokens == 0
    assert len(engine.pool("doc")) == 3
    evidence = engine.pool("doc").evidence[(("asker", "doc"), "shared")]
    assert evidence.pairs == 1  # the third met two anchors: the rule's first measured pair


@pytest.mark.slow
def test_segment_longer_than_every_anchor_reuses_its_covered_part(tiny_executor):
    """With min_coverage 0 (the mechanism alone; the default sends a mostly uncovered segment dense).
    The asker's anchors come from calibration calls on two rows, its slot's evidence is given
    (``support.evidence``: the mechanism, not the rule); the reader's prefill gives the long doc
    its base."""
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, min_coverage=0.0)))
    for row in range(2):
        run_row(spec, row, tiny_executor, engine)
        asker = _prompt(tiny_executor, spec, 1, {"doc": spec.inputs[row]["doc"], "reader": "A summary."})
        run_agent(tiny_executor, engine, asker, 4, calibrate=True)
    earn(engine.pool("doc"), ("asker", "doc"))
    longest = max(a.length for a in engine.pool("doc").anchors)
    long_doc = " ".join(r["doc"] for r in spec.inputs)
    run_agent(tiny_executor, engine, _prompt(tiny_executor, spec, 0, {"doc": long_doc}), 4)
    prompt = _prompt(tiny_executor, spec, 1, {"doc": long_doc, "reader": "A summary."})
    plan = engine.plan(prompt, tiny_executor.base_kv)
    shared = next(i for i, s in enumerate(prompt.segments) if s.is_shared)
    assert len(prompt.segments[shared]) > longest
    covered, tail = plan.pieces[plan.pieces.index(next(p for p in plan.pieces if p.segment_index == shared)):][:2]
    assert covered.match is not None and covered.base.length == longest  # the covered part is estimated
    assert (tail.segment_index, tail.match, tail.start) == (shared, None, prompt.starts[shared] + longest)  # the rest realigned
    assert tail.end == prompt.end(shared) and plan.reuse_end >= prompt.end(shared)
    p = plan.provenance()  # the covered part counts as estimated, the rest as realigned, in counts and words
    assert p.realigned_tokens >= tail.end - tail.start and p.estimated_tokens - p.realigned_tokens >= longest
    assert f"estimated {p.estimated_tokens - p.realigned_tokens:,}, realigned {p.realigned_tokens:,})" in p.reason
    generation = tiny_executor.generate(prompt.token_ids, engine.materialize(plan), 4, None)
    engine.learn(plan, generation.computed)
    assert len(engine.pool("doc")) == 2  # a partially estimated sample does not become an anchor


def _synthetic_engine(tau: float = 0.7, anchors: int = 3):
    """A real engine on synthetic KV, no model: ``anchors`` anchors of a 40-token ``task`` segment
    between fixed segments, and a prefix store with no room (no exact prefix beyond the
    template's lead). Returns (engine, rotary, prompt(i), rand(tokens) -> KV)."""
    from kvcomm.core.kv import KV
    from kvcomm.reuse.plan import ReusePlan
    from kvcomm.core.rope import Rotary
    from kvcomm.core.segments import Segment

    layers, heads, dim, t = 5, 2, 16, 40
    rotary = Rotary(1.0 / (1e4 ** (torch.arange(0, dim, 2).float() / dim)), head_dim=dim)
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: KV(torch.randn(layers, heads, n, dim, generator=gen), torch.randn(layers, heads, n, dim, generator=gen))  # noqa: E731
    prompt = lambda i: Prompt("agent", (Segment(tuple(range(1, 8))), Segment(tuple(range(100 + i, 100 + i + t)), slot="task", shared_id=f"s{i}"),  # noqa: E731
                                        Segment(tuple(range(20, 26))), Segment((30,))))
    pool_config = PoolConfig(gamma=1.0, temperature=tau)
    engine = ReuseEngine(rotary, ReuseConfig(pool=pool_config, prefix_store_bytes=0))
    for i in range(anchors):
        p = prompt(i)
        engine.register_base(p.segments[1], rand(t))
        engine.learn(ReusePlan(p, learn=[1]), rand(len(p)))
    earn(engine.pool("task"), ("agent", "task"))  # random deviations never beat realignment on their own
    return engine, rotary, prompt, rand


@pytest.mark.parametrize("blocks", [False, True])
def test_materialize_equals_realigned_base_plus_plainly_weighted_deviations(blocks, monkeypatch):
    """The optimized path (distances computed at admission, accumulation in layer blocks, values
    accumulated in place) against the formula written out plainly: full-size differences,
    softmax(-d / tau) weights, realigned sum. Synthetic KV on a real engine, no model.
    ``blocks``: one layer per block (one intra-op thread), else whole tensors. Key deviations
    are weighted by the base-value distances, as value deviations are."""
    import kvcomm.core.blocks as core_blocks
    from kvcomm.core.kv import KV, place

    tau = 0.7
    if blocks:
        monkeypatch.setattr(core_blocks, "BLOCK_BYTES", 1)
    engine, rotary, prompt, rand = _synthetic_engine(tau)
    p = prompt(9)
    base = rand(len(p.segments[1]))
    engine.register_base(p.segments[1], base)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if blocks else threads)  # blocks are used on one intra-op thread only
    try:
        plan = engine.plan(p)
        kv = engine.materialize(plan)
    finally:
        torch.set_num_threads(threads)
    piece = plan.pieces[0]
    assert piece.following_base is not None and plan.reuse_end == len(p) - 1

    anchors = piece.match.anchors
    layers, heads, _, dim = base.keys.shape
    devs = [a.deviations[piece.match.slot] for a in anchors]
    dv = [a.base.values - base.values for a in anchors]
    per_token = layers * heads * dim
    wk = wv = torch.softmax(-torch.stack([d.abs().sum((0, 1, 3)) / per_token for d in dv]) / tau, 0)  # [A, t]
    # following: per-token RMS of the base-value difference (L2 over the t tokens / sqrt(t))
    fk = fv = torch.softmax(-torch.stack([d.square().mean(2).sqrt() for d in dv]) / tau, 0)  # [A, L, H, D]
    # deviations are stored from their first_layer on: no deviation below it
    full = lambda t, d: torch.cat([t.new_zeros((d.first_layer, *t.shape[1:])), t])  # noqa: E731
    shared = KV(base.keys + sum(w[None, None, :, None] * full(d.shared.keys, d) for w, d in zip(wk, devs)),
                base.values + sum(w[None, None, :, None] * full(d.shared.values, d) for w, d in zip(wv, devs)))
    fixed = piece.following_base
    following = KV(fixed.keys + sum(w[:, :, None, :] * full(d.following.keys, d)[:, :, : fixed.length] for w, d in zip(fk, devs)),
                   fixed.values + sum(w[:, :, None, :] * full(d.following.values, d)[:, :, : fixed.length] for w, d in zip(fv, devs)))
    expected = KV.cat([place(shared, rotary, piece.start), place(following, rotary, piece.following_start)])
    got = kv.span(piece.start, piece.following_start + fixed.length)
    assert (got.keys - expected.keys).abs().max() <= 1e-5
    assert (got.values - expected.values).abs().max() <= 1e-5


def test_materialized_lends_the_same_memory_request_after_request_and_equals_materialize():
    """``materialized`` writes exactly what ``materialize`` returns, into the workspace's memory,
    which the next request gets again once the block is left; a nested (concurrent) request
    gets other memory."""
    engine, _, prompt, rand = _synthetic_engine()
    plans = []
    for i in (9, 10, 11):
        p = prompt(i)
        engine.register_base(p.segments[1], rand(len(p.segments[1])))
        plans.append(engine.plan(p))
    assert all(plan.pieces[0].match is not None for plan in plans)
    fresh = [engine.materialize(plan) for plan in plans]
    addresses = []
    for plan, expected in zip(plans[:2], fresh):
        with engine.materialized(plan) as lent:
            assert torch.equal(lent.keys, expected.keys) and torch.equal(lent.values, expected.values)
            addresses.append(lent.keys.data_ptr())
            with engine.materialized(plans[2]) as nested:
                assert nested.keys.data_ptr() != lent.keys.data_ptr()
                assert torch.equal(nested.keys, fresh[2].keys) and torch.equal(nested.values, fresh[2].values)
    assert addresses[0] == addresses[1]
    assert 0 < engine.workspace.idle_bytes <= engine.config.workspace_bytes
    with engine.materialized(ReusePlan(prompt(12))) as nothing:
        assert nothing is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kvcomm", "realign"])
def test_first_use_bases_come_from_the_first_prefill_with_no_extra_forward(tiny_executor, monkeypatch, mode):
    """base_source "first_use": new content is computed in the request that first sees it and
    its KV there, de-rotated, becomes its base; the executor is never asked for a standalone
    prefill; later requests reuse the content from that base."""
    from kvcomm.core.kv import to_position_free

    def no_standalone_prefill(segment):
        raise AssertionError("base_source first_use must not run a standalone prefill")

    monkeypatch.setattr(tiny_executor, "base_kv", no_standalone_prefill)
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), base_source="first_use", mode=mode))
    reader = _prompt(tiny_executor, spec, 0, spec.inputs[0])
    doc = next(i for i, s in enumerate(reader.segments) if s.is_shared)
    plan = engine.plan(reader)
    assert plan.new_bases == [doc] and plan.reuse_end <= reader.starts[doc]
    dense = tiny_executor.generate(reader.token_ids, None, 1, None).computed
    calls = [[c.provenance for c in run_row(spec, row, tiny_executor, engine)] for row in range(4)]
    start = reader.starts[doc]
    expected = to_position_free(dense.span(start, reader.end(doc)), tiny_executor.rotary, start)
    base = engine.stored_base(reader.segments[doc].shared_id)
    assert (base.keys - expected.keys).abs().max() <= 1e-5 and (base.values - expected.values).abs().max() <= 1e-5
    readers, askers = [row[0] for row in calls], [row[1] for row in calls]
    assert all(p.estimated_tokens == 0 for p in readers)  # the reader is always first to see its doc
    reused_doc = [p.reused_shared_tokens > 0 for p in askers]
    # both reuse the doc once the asker's own fixed text has a base: kvcomm reaches what realign
    # reaches (the doc realigned, its slot having earned no estimate)
    assert reused_doc == [False, True, True, True]
    for p in (p for row in calls for p in row):
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens
