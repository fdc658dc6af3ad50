"""Preambles: an agent's unseen system prompt is computed, the shared content after it served
(issue 40). Checked against a dense prefill of the same prompt on a tiny random model."""

from __future__ import annotations

import torch

from kvcomm.core.kv import KV
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.runner import run_agent
from kvcomm.reuse.strategies.realign import PREAMBLE_MIN_REUSE
from support.two_agent_case import PIPELINE, agent_prompt

SPEC = parse_pipeline(PIPELINE)
DOC = "The river Seine flows through Paris and into the English Channel. " * 6


def doc_index(prompt) -> int:
    return next(i for i, s in enumerate(prompt.segments) if s.slot == "doc")


def _engine(executor, **config) -> ReuseEngine:
    return ReuseEngine(executor.rotary, ReuseConfig(**config))


def test_a_new_agent_computes_its_system_prompt_and_serves_the_document_behind_it(tiny_executor):
    engine = _engine(tiny_executor)
    run_agent(tiny_executor, engine, agent_prompt(tiny_executor, SPEC.agents[0], {"doc": DOC}), 4)
    prompt = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": DOC, "reader": "A river."})
    doc = next(i for i, s in enumerate(prompt.segments) if s.slot == "doc")

    plan = engine.plan(prompt, computes_preambles=True)
    assert plan.exact_length == 0 and plan.preamble_length == prompt.starts[doc] > 0
    assert plan.pieces[0].segment_index == doc and plan.pieces[0].match is None  # cold slot: realigned base
    assert plan.decisions[doc].candidates.cold
    assert plan.reuse_end >= prompt.end(doc)
    p = plan.provenance()
    assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens
    assert p.preamble_tokens == prompt.starts[doc] and p.reused_shared_tokens >= len(prompt.segments[doc])
    assert p.reuse_end == plan.reuse_end
    # no anchor estimated anything: every reused token is the realigned base, and the words say so
    assert p.realigned_tokens == p.estimated_tokens > 0
    assert p.reason.startswith(f"reused {p.estimated_tokens:,} of {p.prompt_tokens:,} tokens (realigned {p.estimated_tokens:,});")

    without = engine.plan(prompt)  # an executor that cannot compute preambles: reuse stops at the new text
    assert without.pieces == [] and without.preamble_length == 0 and "has no base yet" in without.note


def test_generating_with_a_preamble_equals_dense_when_the_pieces_hold_dense_kv(tiny_executor):
    prompt = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": DOC, "reader": "A river."})
    ids, n = prompt.token_ids, len(prompt)
    dense = tiny_executor.generate(ids, None, 6, keep_logprobs=True)
    start, end, reused = 3, prompt.starts[1] + 5, n - 4
    truth = dense.computed.span(0, reused)
    prefix = KV(truth.keys.clone(), truth.values.clone())
    prefix.keys[:, :, start:end] = torch.randn_like(prefix.keys[:, :, start:end])  # the preamble's slots hold garbage
    prefix.values[:, :, start:end] = 7.0

    got = tiny_executor.generate(ids, prefix, 6, keep_logprobs=True, preamble=(start, end))
    torch.testing.assert_close(got.preamble.keys, truth.keys[:, :, start:end], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.preamble.values, truth.values[:, :, start:end], rtol=1e-4, atol=1e-4)
    assert got.reply_ids == dense.reply_ids
    torch.testing.assert_close(got.prompt_logprobs, dense.prompt_logprobs[reused:], rtol=1e-4, atol=1e-4)


def test_the_preamble_is_learned_so_the_agents_next_call_starts_from_it_exactly(tiny_executor):
    engine = _engine(tiny_executor)
    run_agent(tiny_executor, engine, agent_prompt(tiny_executor, SPEC.agents[0], {"doc": DOC}), 4)
    prompt = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": DOC, "reader": "A river."})
    _, first = run_agent(tiny_executor, engine, prompt, 4)
    assert first.preamble_tokens > 0 and first.reused

    other = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": "Bananas are yellow.", "reader": "Fruit."})
    plan = engine.plan(other, computes_preambles=True)
    assert plan.exact_length == first.preamble_tokens  # the system prompt and template text
    assert engine.prefix_store.longest(other)[0] == first.preamble_tokens  # also past a template's first segment
    assert all(engine.fixed_base(prompt, i) is not None for i in range(len(prompt.segments))
               if prompt.starts[i] < first.preamble_tokens)


def test_a_cold_slot_behind_known_text_is_served_realigned_and_learns_from_a_dense_call(tiny_executor):
    """A cold slot gives up no reuse realignment has: behind known text its document is served
    as its realigned base (not computed to make an anchor); a dense call (a calibration call,
    or the quality guard's twin) is what makes it an anchor."""
    engine = _engine(tiny_executor, prefix_store_bytes=0)  # no exact prefix: every call has text before the doc
    run_agent(tiny_executor, engine, agent_prompt(tiny_executor, SPEC.agents[0], {"doc": DOC}), 4)
    prompt = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": DOC, "reader": "A river."})
    doc = next(i for i, s in enumerate(prompt.segments) if s.slot == "doc")
    _, first = run_agent(tiny_executor, engine, prompt, 4)
    assert first.preamble_tokens > 0  # the agent's first call: new text, cold slot served realigned

    plan = engine.plan(prompt, computes_preambles=True)  # its text is known now: still served realigned
    assert [p.match for p in plan.pieces if p.segment_index == doc] == [None] and doc not in plan.learn
    assert engine.pool("doc").get(prompt.segments[doc].shared_id) is None
    run_agent(tiny_executor, engine, prompt, 4, calibrate=True)
    assert engine.pool("doc").get(prompt.segments[doc].shared_id) is not None


def test_no_preamble_is_planned_before_a_short_shared_segment(tiny_executor):
    engine = _engine(tiny_executor)
    short = "The river Seine flows through Paris."
    run_agent(tiny_executor, engine, agent_prompt(tiny_executor, SPEC.agents[0], {"doc": short}), 4)
    prompt = agent_prompt(tiny_executor, SPEC.agents[1], {"doc": short, "reader": "A river."})
    assert len(next(s for s in prompt.segments if s.slot == "doc")) < PREAMBLE_MIN_REUSE
    plan = engine.plan(prompt, computes_preambles=True)
    assert plan.pieces == [] and plan.preamble_length == 0


def test_a_cold_slot_behind_known_template_text_and_a_new_reply_is_served_realigned(tiny_executor):
    """Only unseen template text makes a call an agent's first, and a cold slot is served
    realigned on any call: behind a reply just written (new content, computed in the preamble) the
    document is served as its realigned base, not computed."""
    spec = parse_pipeline({"agents": [
        {"name": "reader", "system": "You read.", "template": "Text: {doc}\nSummarize it."},
        {"name": "critic", "system": "You criticize.", "template": "Summary: {reader}\nText: {doc}\nCriticize it."},
    ], "inputs": [{"doc": DOC}], "max_new_tokens": 4})
    engine = _engine(tiny_executor)
    run_agent(tiny_executor, engine, agent_prompt(tiny_executor, spec.agents[0], {"doc": DOC}), 4)
    first = agent_prompt(tiny_executor, spec.agents[1], {"doc": DOC, "reader": "A river in France."})
    _, seen = run_agent(tiny_executor, engine, first, 4)
    assert seen.preamble_tokens > 0 and seen.reused  # the critic's first call: its template is new

    reply = next(i for i, s in enumerate(first.segments) if s.slot == "reader")
    assert seen.reused_shared_tokens == len(first.segments[doc_index(first)])  # the new reply in the preamble is computed
    assert first.starts[reply] < seen.preamble_tokens

    later = agent_prompt(tiny_executor, spec.agents[1], {"doc": DOC, "reader": "Paris has a river."})
    doc = next(i for i, s in enumerate(later.segments) if s.slot == "doc")
    plan = engine.plan(later, computes_preambles=True)
    assert plan.preamble_length > 0 and doc not in plan.learn
    assert [p.match for p in plan.pieces if p.segment_index == doc] == [None]
