"""What the engine learns and what it serves from it (issue 14): one base per content,
deviations applied to the base they were measured against, fixed bases keyed to their
deviations, no learning from prompts past the exact RoPE length or from approximate context,
admission of mostly uncovered segments, following-segment weights and layer 0.

Synthetic KV (no model) unless a test needs a forward pass; then a tiny random model. Most
engines here get a prefix store with no room (``NO_PREFIX``), so no exact prefix can hit and
what a plan serves comes from bases and anchors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.pool import AnchorPool
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.scopes import SCOPES
from kvcomm.core.kv import KV, place
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment, content_id
from support.evidence import earn

LAYERS, HEADS, DIM = 3, 2, 8
NO_PREFIX = 0
"""``ReuseConfig.prefix_store_bytes`` of a store that holds nothing."""


def _rotary() -> Rotary:
    return Rotary(1.0 / (1e4 ** (torch.arange(0, DIM, 2).float() / DIM)), head_dim=DIM)


def _rand(gen: torch.Generator, n: int) -> KV:
    return KV(torch.randn(LAYERS, HEADS, n, DIM, generator=gen), torch.randn(LAYERS, HEADS, n, DIM, generator=gen))


def _prompt(shared: tuple[int, ...], shared_id: str = "doc-1", lead: int = 5, tail: int = 4, template: str = "agent") -> Prompt:
    """lead fixed segment, the shared segment in slot "doc", a fixed segment after it, one last token."""
    return Prompt(template, (
        Segment(tuple(range(1, 1 + lead))), Segment(shared, slot="doc", shared_id=shared_id),
        Segment(tuple(range(40, 40 + tail))), Segment((99,)),
    ))


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# -- defect 1: one base per content; an identical match reproduces the recorded real KV -----


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), length=st.integers(1, 24), rebases=st.integers(0, 3),
       drop=st.booleans(), gamma=st.sampled_from([0.0, 0.3, 1.0]))
def test_identical_match_reproduces_the_recorded_real_kv(seed, length, rebases, drop, gamma):
    """Law: once a segment was densely prefilled in a slot and recorded, serving the same
    prompt again gives back the real KV of everything it reuses (up to fp32 rounding), however
    often the content's base was registered again (a reply regenerated, a base dropped and
    recomputed) in between."""
    gen = torch.Generator().manual_seed(seed)
    rotary = _rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=gamma), prefix_store_bytes=NO_PREFIX))
    prompt = _prompt(tuple(range(200, 200 + length)))
    plan = engine.plan(prompt, lambda s: _rand(gen, len(s)))
    assert plan.learn == [1] and plan.reuse_end == 0
    real = place(_rand(gen, len(prompt)), rotary, 0)
    _layer0_from_base(real, engine.stored_base("doc-1"), prompt.starts[1], rotary)
    engine.learn(plan, real)
    for _ in range(rebases):
        if drop:
            engine.drop_base("doc-1")
        engine.register_base(prompt.segments[1], _rand(gen, length))
    again = engine.plan(prompt, lambda s: _rand(gen, len(s)))
    assert again.pieces and again.pieces[0].match.identical
    assert again.reuse_end == len(prompt) - 1  # lead exact, doc and the fixed segment after it estimated
    served = engine.materialize(again)
    assert _max_error(served.keys, real.keys[:, :, : again.reuse_end]) < 1e-5
    assert _max_error(served.values, real.values[:, :, : again.reuse_end]) < 1e-6


def _layer0_from_base(real: KV, base: KV, start: int, rotary: Rotary) -> None:
    """As in a model: layer 0 of a segment's real KV is its realigned base (no context mixed in yet)."""
    placed = place(base, rotary, start)
    real.keys[0, :, start : start + base.length] = placed.keys[0]
    real.values[0, :, start : start + base.length] = placed.values[0]


def test_a_second_base_for_held_content_is_ignored():
    gen = torch.Generator().manual_seed(0)
    engine = ReuseEngine(_rotary())
    segment = Segment(tuple(range(10)), slot="doc", shared_id="doc-1")
    first, second = _rand(gen, 10), _rand(gen, 10)
    assert engine.register_base(segment, first) is first
    assert engine.register_base(segment, second) is first
    assert engine.stored_base("doc-1") is first


def test_an_anchor_keeps_its_base_when_the_engine_drops_it():
    """The content's base lives on with its anchor; plans use it rather than computing another."""
    gen = torch.Generator().manual_seed(1)
    engine = ReuseEngine(_rotary(), ReuseConfig(prefix_store_bytes=NO_PREFIX))
    prompt = _prompt(tuple(range(200, 212)))
    plan = engine.plan(prompt, lambda s: _rand(gen, len(s)))
    engine.learn(plan, place(_rand(gen, len(prompt)), engine.rotary, 0))
    anchor = engine.pool("doc").get("doc-1")
    assert engine.stored_base("doc-1") is anchor.base  # the anchor took the engine's base, no copy
    assert engine.drop_base("doc-1")
    assert engine.has_base("doc-1") and engine.stored_base("doc-1") is anchor.base

    def provider(_segment):
        raise AssertionError("the anchor's base is held: nothing to compute")

    engine.plan(prompt, provider)


def test_record_refuses_a_deviation_measured_against_another_base():
    gen = torch.Generator().manual_seed(2)
    pool = AnchorPool(PoolConfig())
    base = _rand(gen, 6)
    embedding = np.ones(4, dtype=np.float32)
    pool.record(("t", "doc"), "doc-1", base, embedding, Deviation(_rand(gen, 6), None))
    pool.record(("t2", "doc"), "doc-1", base.clone(), embedding, Deviation(_rand(gen, 6), None))  # equal values: fine
    with pytest.raises(ValueError, match="another base"):
        pool.record(("t3", "doc"), "doc-1", _rand(gen, 6), embedding, Deviation(_rand(gen, 6), None))
    assert set(pool.get("doc-1").deviations) == {("t", "doc"), ("t2", "doc")}


# -- defect 4: a following deviation is applied only to the fixed base it was measured against


def test_following_deviation_is_not_applied_to_a_relearned_fixed_base():
    """A tenant shrink drops fixed bases before anchors; the next dense prefill relearns them
    from another context. The anchor's following deviation was measured against the old
    base, so the following segment is no longer estimated from it (only lengths agreed): it
    is served as the relearned base realigned."""
    from kvcomm.services.tenants import TenantEngine

    gen = torch.Generator().manual_seed(4)
    rotary = _rotary()
    engine = TenantEngine(rotary, ReuseConfig(prefix_store_bytes=NO_PREFIX))
    first = _prompt(tuple(range(200, 212)), "doc-1")
    plan = engine.plan(first, lambda s: _rand(gen, len(s)))
    real = place(_rand(gen, len(first)), rotary, 0)
    _layer0_from_base(real, engine.stored_base("doc-1"), first.starts[1], rotary)
    engine.learn(plan, real)
    assert engine.plan(first).reuse_end == len(first) - 1  # the following segment is estimated
    memory = engine.memory()
    engine.shrink(memory.total - memory.fixed_bases)
    assert not engine._fixed_bases and len(engine.pool("doc")) == 1
    other = _prompt(tuple(range(300, 312)), "doc-2")
    plan = engine.plan(other, lambda s: _rand(gen, len(s)))
    assert plan.reuse_end == 0
    lead = first.starts[1]  # the lead has no preceding context: its KV is the same in both prompts
    engine.learn(plan, KV.cat([real.span(0, lead), place(_rand(gen, len(other) - lead), rotary, lead)]))
    again = engine.plan(first)
    assert again.pieces[0].match.identical and again.pieces[0].following_base is None
    served = engine.materialize(again)
    end = first.end(1)
    assert _max_error(served.keys[:, :, :end], real.keys[:, :, :end]) < 1e-5
    assert _max_error(served.values[:, :, :end], real.values[:, :, :end]) < 1e-6
    relearned = engine._fixed_bases[(first.template_id, content_id(first.segments[2].token_ids))]
    fixed = again.pieces[1]
    assert (fixed.segment_index, fixed.match) == (2, None) and torch.equal(fixed.base.keys, relearned.keys)
    expected = place(relearned, rotary, first.starts[2])
    assert torch.equal(served.keys[:, :, end : fixed.end], expected.keys)
    assert torch.equal(served.values[:, :, end : fixed.end], expected.values)


# -- defect 3: nothing is learned from, or served to, prompts past the exact RoPE length -----


@pytest.fixture(scope="module")
def dynamic_executor(smol):
    """A 2-layer random Llama with dynamic NTK RoPE whose frequencies grow past 64 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers.executor import TransformersExecutor

    _, tokenizer = smol
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    return TransformersExecutor(LlamaForCausalLM(config).eval(), tokenizer)


def _token_prompt(doc_tokens: int, doc_start: int = 1000, shared_id: str | None = None) -> Prompt:
    doc = tuple(range(doc_start, doc_start + doc_tokens))
    return Prompt("agent", (Segment(tuple(range(500, 510))), Segment(doc, slot="doc", shared_id=shared_id),
                            Segment(tuple(range(600, 605))), Segment((700,))))


def test_dynamic_ntk_prompt_past_the_exact_length_teaches_nothing(dynamic_executor):
    from kvcomm.reuse.runner import run_agent

    limit = dynamic_executor.rotary.max_exact_length
    assert limit is not None and limit < 80
    engine = ReuseEngine(dynamic_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    long_prompt = _token_prompt(80)
    assert len(long_prompt) > limit
    for _ in range(2):
        _, provenance = run_agent(dynamic_executor, engine, long_prompt, 3)
        assert provenance.computed_tokens == len(long_prompt)  # nothing served, not even the lead
    assert not engine._bases and not engine._fixed_bases and not engine.pools and engine.prefix_store.nbytes == 0


def test_dynamic_ntk_prompt_past_the_exact_length_gets_no_stored_kv(dynamic_executor):
    """KV learned from short prompts (short frequencies) is not served to a long prompt, whose
    every key dense computes with the grown frequencies: not even the template's lead.
    Standalone bases: three short calibration prompts with three new docs make anchors (first_use
    bases would only take each doc's base; plain calls would serve them realigned, making none)."""
    from kvcomm.reuse.runner import run_agent

    engine = ReuseEngine(dynamic_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), base_source="standalone"))
    for start in (1000, 2000, 3000):
        run_agent(dynamic_executor, engine, _token_prompt(20, start), 1, calibrate=True)
    assert engine._fixed_bases and len(engine.pool("doc")) >= 2
    plan = engine.plan(_token_prompt(80, 1000), dynamic_executor.base_kv)
    assert plan.reuse_end == 0 and plan.exact_length == 0 and "no reuse" in plan.note


# -- defect 5: learning only from KV computed behind exact or computed context ---------------


def _two_slot_prompt(doc: tuple[int, ...], doc_id: str, note: tuple[int, ...], note_id: str, tail: tuple[int, ...],
                     middle: tuple[int, ...] = tuple(range(40, 44))) -> Prompt:
    return Prompt("agent", (
        Segment(tuple(range(1, 6))), Segment(doc, slot="doc", shared_id=doc_id), Segment(middle),
        Segment(note, slot="note", shared_id=note_id), Segment(tail), Segment((99,)),
    ))


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("provider", [True, False], ids=["standalone", "first_use"])
def test_nothing_is_learned_from_kv_computed_behind_estimates(provider, scope):
    """Invariant 4 of docs/anchor-pool.md, with its one exception by scope: where
    ``bases_after_estimates`` is set (``all-reader-replies``), new content's first-use base is
    taken behind estimates; nothing else is."""
    gen = torch.Generator().manual_seed(5)
    rotary = _rotary()
    provide = (lambda s: _rand(gen, len(s))) if provider else None
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), scope=scope, prefix_store_bytes=NO_PREFIX))
    doc = tuple(range(200, 212))
    first = _two_slot_prompt(doc, "doc-1", tuple(range(300, 306)), "note-1", (50, 51))
    engine.register_base(first.segments[1], _rand(gen, len(doc)))
    plan = engine.plan(first, provide)
    engine.learn(plan, place(_rand(gen, len(first)), rotary, 0))
    assert len(engine.pool("doc")) == 1
    # the same doc (an identical match: estimated), then a new fixed segment (no base: reuse
    # ends there), so the new content and the new fixed segments after it are computed behind
    # the estimate
    second = _two_slot_prompt(doc, "doc-1", tuple(range(400, 406)), "note-2", (60, 61, 62), middle=(70, 71, 72, 73))
    plan = engine.plan(second, provide)
    assert plan.estimated_tokens > 0 and plan.reuse_end == second.starts[2]
    assert plan.learn == ([3] if provider else [])  # with a base, the pool (one anchor) would take note-2 densely
    fixed_before = set(engine._fixed_bases)
    engine.learn(plan, place(_rand(gen, len(second) - plan.reuse_end), rotary, plan.reuse_end))
    assert set(engine._fixed_bases) == fixed_before  # the new middle and tail are not learned
    assert engine.pool("note").get("note-2") is None
    assert engine.prefix_store.nbytes == 0
    if not provider:  # no first-use base either, but where the scope takes it behind estimates
        assert engine.has_base("note-2") is SCOPES[scope].bases_after_estimates


def test_what_a_plan_does_behind_an_estimate_with_a_segment_its_pool_sends_dense():
    """A request that has estimated learns nothing, so a later segment its pool would send
    dense (a new slot) is served realigned, with the fixed segments after it. Before any
    estimate the dense fallback stays: that request teaches the pool."""
    gen = torch.Generator().manual_seed(8)
    rotary = _rotary()
    provide = lambda s: _rand(gen, len(s))  # noqa: E731
    doc = tuple(range(200, 212))
    first = _two_slot_prompt(doc, "doc-1", tuple(range(300, 306)), "note-1", (50, 51))
    second = _two_slot_prompt(doc, "doc-1", tuple(range(400, 406)), "note-2", (50, 51))
    engine = ReuseEngine(rotary, ReuseConfig(prefix_store_bytes=NO_PREFIX))
    plan = engine.plan(first, provide)
    assert (plan.reuse_end, plan.learn) == (0, [1, 3])  # nothing estimated yet: dense, both learned
    engine.learn(plan, place(_rand(gen, len(first)), rotary, 0))
    plan = engine.plan(second, provide)  # doc-1 identical (estimated), then note-2: a pool of one anchor
    lead = len(second.segments[0])  # exact: the template's first segment
    assert plan.pieces[0].match.identical and plan.pieces[0].end == second.starts[3]
    note, tail = plan.pieces[1:]
    assert (note.segment_index, note.match, note.start) == (3, None, second.starts[3])
    assert torch.equal(note.base.keys, engine.stored_base("note-2").keys)
    assert (tail.segment_index, tail.match) == (4, None) and plan.reuse_end == len(second) - 1
    served = engine.materialize(plan)
    expected = place(engine.stored_base("note-2"), rotary, second.starts[3])
    assert torch.equal(served.keys[:, :, second.starts[3] : second.end(3)], expected.keys)
    assert torch.equal(served.values[:, :, second.starts[3] : second.end(3)], expected.values)
    assert plan.learn == [] and not plan.note and plan.exact_length == lead
    assert plan.provenance().estimated_tokens == len(second) - 1 - lead


# -- defect 2: a mostly uncovered segment goes dense and is admitted --------------------------


def _calibrate(engine: ReuseEngine, prompt: Prompt, provide, gen: torch.Generator, rotary: Rotary) -> None:
    """A dense call of ``prompt`` that records its shared segments in their pools (``calibration_plan``)."""
    plan = engine.calibration_plan(prompt, provide)
    engine.learn(plan, place(_rand(gen, len(prompt) - plan.reuse_end), rotary, plan.reuse_end))


def test_mostly_uncovered_segments_are_served_realigned_until_a_dense_call_makes_them_anchors():
    """Two short anchors must not starve admission: a longer segment they barely cover is not
    estimated from them; it is served as its realigned base (what realignment serves) until a
    dense call of it makes it an anchor, which then covers its like."""
    gen = torch.Generator().manual_seed(6)
    rotary = _rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=NO_PREFIX))
    provide = lambda s: _rand(gen, len(s))  # noqa: E731
    for i in range(2):
        _calibrate(engine, _prompt(tuple(range(200 + 20 * i, 210 + 20 * i)), f"short-{i}"), provide, gen, rotary)
    assert [a.length for a in engine.pool("doc").anchors] == [10, 10]
    for i in range(3):
        prompt = _prompt(tuple(range(1000 + 200 * i, 1100 + 200 * i)), f"long-{i}")
        plan = engine.plan(prompt, provide)
        decision = plan.decisions[1]
        if i == 0:  # 10 of 100 tokens covered: refused
            assert decision.match is None
            assert decision.refusal == "anchors cover 10 of 100 tokens, under min_coverage 0.5"
            _calibrate(engine, prompt, provide, gen, rotary)
        else:  # the 100-token anchor now covers it all
            assert decision.match is not None and decision.match.covered == 100
        doc = next(p for p in plan.pieces if p.segment_index == 1)  # no evidence yet: realigned either way
        assert (doc.match, doc.base.length) == (None, 100) and plan.learn == []
    assert sorted(a.length for a in engine.pool("doc").anchors) == [10, 10, 100]


@pytest.mark.parametrize("share, refused", [(0.09, False), (0.11, True)])
def test_min_coverage_is_the_share_of_tokens_anchors_must_cover(share, refused):
    """10 of 100 tokens covered, in a slot whose estimate has earned its place: the covered part
    estimated if min_coverage <= 0.1, else the whole segment served realigned."""
    gen = torch.Generator().manual_seed(7)
    rotary = _rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, min_coverage=share), prefix_store_bytes=NO_PREFIX))
    provide = lambda s: _rand(gen, len(s))  # noqa: E731
    for i in range(2):
        _calibrate(engine, _prompt(tuple(range(200 + 20 * i, 210 + 20 * i)), f"short-{i}"), provide, gen, rotary)
    earn(engine.pool("doc"), ("agent", "doc"))
    plan = engine.plan(_prompt(tuple(range(1000, 1100)), "long"), provide)
    assert plan.learn == [] and plan.estimated_tokens >= 100
    pieces = [p for p in plan.pieces if p.segment_index == 1]
    if refused:
        assert [(p.match, p.base.length) for p in pieces] == [(None, 100)]
    else:  # the covered part estimated, the rest of the segment served realigned
        covered, tail = pieces
        assert covered.match.covered == covered.base.length == 10 and (tail.match, tail.base.length) == (None, 90)


# -- defect 6: following-segment weights normalized by length; layer 0 exact -----------------


def test_following_weights_do_not_turn_one_hot_on_long_segments():
    """Two anchors whose bases differ from the new one's by 0.1 and 0.2 per element: the
    per-channel following weights depend on that per-token RMS, not on the segment's length."""
    from kvcomm.anchors.pool import Match

    pool = AnchorPool(PoolConfig())
    weights = {}
    for length in (4, 400):
        new = KV(torch.zeros(LAYERS, HEADS, length, DIM), torch.zeros(LAYERS, HEADS, length, DIM))
        anchors = []
        for i, offset in enumerate((0.1, 0.2)):
            base = KV(new.keys + offset, new.values + offset)
            pool.record(("t", "doc"), f"a{i}-{length}", base, np.ones(4, dtype=np.float32),
                        Deviation(KV(torch.zeros_like(base.keys), torch.zeros_like(base.values)),
                                  KV(torch.zeros(LAYERS, HEADS, 3, DIM), torch.zeros(LAYERS, HEADS, 3, DIM)), "f"))
            anchors.append(pool.get(f"a{i}-{length}"))
        _, following = pool.estimate_terms(Match(("t", "doc"), tuple(anchors), length), new)
        weights[length] = float(following.weights("values")[0].flatten()[0])
    expected = 1 / (1 + np.exp(-0.1))  # softmax(-[0.1, 0.2]) of the first anchor
    assert abs(weights[4] - expected) < 1e-5 and abs(weights[400] - expected) < 1e-5


def test_layer0_deviation_is_not_stored_and_layer0_is_served_as_the_realigned_base():
    """Layer 0's K/V depend only on token and position, so the engine stores deviations from
    layer 1 on; re-serving the recorded segment gives the realigned base at layer 0 (whatever
    rounding the real layer 0 carried) and the real KV everywhere else."""
    gen = torch.Generator().manual_seed(8)
    rotary = _rotary()
    engine = ReuseEngine(rotary, ReuseConfig(prefix_store_bytes=NO_PREFIX))
    prompt = _prompt(tuple(range(200, 210)))
    plan = engine.plan(prompt, lambda s: _rand(gen, len(s)))
    real = place(_rand(gen, len(prompt)), rotary, 0)  # layer 0 not the base: all of it would be "deviation"
    engine.learn(plan, real)
    deviation = engine.pool("doc").get("doc-1").deviations[("agent", "doc")]
    assert deviation.first_layer == 1
    assert deviation.shared.keys.shape[0] == deviation.following.keys.shape[0] == LAYERS - 1
    again = engine.plan(prompt, lambda s: _rand(gen, len(s)))
    assert again.pieces[0].match.identical
    served = engine.materialize(again)
    start, end = prompt.starts[1], prompt.end(1)
    base = place(engine.stored_base("doc-1"), rotary, start)
    assert torch.equal(served.keys[0, :, start:end], base.keys[0]) and torch.equal(served.values[0, :, start:end], base.values[0])
    assert _max_error(served.keys[1:], real.keys[1:, :, : again.reuse_end]) < 1e-5
    assert _max_error(served.values[1:], real.values[1:, :, : again.reuse_end]) < 1e-6


# -- calibration: dense prefills that learn everything ---------------------------------------


@pytest.mark.parametrize("provider", [True, False], ids=["standalone", "first_use"])
def test_calibration_records_every_shared_segment_with_a_base(provider):
    """Plans learn only the segments they compute anyway; calibration plans
    compute everything and record every segment whose content has a base, up to V, and feed
    the shrinkage fit. Content new to the engine becomes a base, not an anchor."""
    gen = torch.Generator().manual_seed(8)
    rotary = _rotary()
    provide = (lambda s: _rand(gen, len(s))) if provider else None
    docs = [(tuple(range(200 + 20 * i, 212 + 20 * i)), f"doc-{i}") for i in range(6)]
    engines = {}
    for calibrate in (False, True):
        engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=4), prefix_store_bytes=NO_PREFIX))
        for doc, doc_id in docs:
            prompt = _prompt(doc, doc_id)
            if not provider:  # the content's first use: here, another agent's prompt
                engine.register_base(prompt.segments[1], _rand(gen, len(doc)))
            plan = engine.calibration_plan(prompt, provide) if calibrate else engine.plan(prompt, provide)
            if calibrate:
                assert (plan.reuse_end, plan.learn, plan.new_bases) == (0, [1], [])
            engine.learn(plan, place(_rand(gen, len(prompt) - plan.reuse_end), rotary, plan.reuse_end))
        engines[calibrate] = engine
    # plans learn only what they compute anyway: the first call (its template text new) its
    # doc; the later ones serve theirs realigned (a cold slot gives up no reuse)
    assert len(engines[False].pool("doc")) == 1
    pool = engines[True].pool("doc")
    assert [a.segment_id for a in pool.anchors] == ["doc-2", "doc-3", "doc-4", "doc-5"] and pool.evictions == 2
    assert pool.problems() == []
    assert pool.fits[(("agent", "doc"), "shared")].pairs == 4  # each doc after the second was an observation


@pytest.mark.parametrize("mode", ["kvcomm", "realign"])
def test_calibration_learns_new_content_as_a_base_and_anchors_only_in_the_anchor_modes(mode):
    gen = torch.Generator().manual_seed(9)
    rotary = _rotary()
    doc = tuple(range(200, 212))
    engine = ReuseEngine(rotary, ReuseConfig(mode=mode, prefix_store_bytes=NO_PREFIX))
    plan = engine.calibration_plan(_prompt(doc, "doc-1"))
    assert (plan.learn, plan.new_bases) == ([], [1])
    engine.learn(plan, place(_rand(gen, len(plan.prompt)), rotary, 0))
    assert engine.has_base("doc-1") and engine._fixed_bases and len(engine.pool("doc")) == 0
    again = engine.calibration_plan(_prompt(doc, "doc-1", tail=6, template="other"))
    assert again.learn == ([1] if mode == "kvcomm" else [])
    engine.learn(again, place(_rand(gen, len(again.prompt)), rotary, 0))
    assert len(engine.pool("doc")) == (1 if mode == "kvcomm" else 0)
