"""Side-by-side runs on one vLLM engine (`kvcomm run`): neither system is served prefix-cache
blocks the other computed, each keeps vLLM's prefix caching among its own calls, and each
system's cached tokens reach the per-call records and the summary.

vLLM's own count of cached prompt tokens is read twice: through a spy on ``VllmExecutor._run``
(what vLLM reported for each request, whatever the records say) and from the records."""

from __future__ import annotations

import pytest

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.pipeline import parse_pipeline

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful reader of field notes written by a team of surveyors. Read every line, keep the "
          "numbers exactly as written, never guess a value the notes do not give, and answer in plain words.")
NOTES = [
    "Plot A: 14 oak trees, 3 birch trees, a stream on the north side, soil damp, two fox dens near the fence. "
    "Plot B: 9 pine trees, dry soil, one old well, no animals seen.",
    "Plot C: 21 beech trees, a pond of about 40 metres, frogs and herons, soil wet. Plot D: 5 maple trees, "
    "a stone wall on the east side, rabbit holes along the wall.",
]
SPEC = parse_pipeline({
    "agents": [
        {"name": "reader", "system": SYSTEM, "template": "Notes: {notes}\nList the trees in one line."},
        {"name": "writer", "system": "You write short titles.", "template": "Notes: {notes}\nTrees: {reader}\nGive a title."},
    ],
    "inputs": [{"notes": text} for text in NOTES],
    "max_new_tokens": 4,
})


def _spy(monkeypatch) -> list[tuple[tuple[int, ...], int, int]]:
    """Every request ``VllmExecutor`` sends from now on: (prompt ids, injected tokens, vLLM's
    cached prompt tokens), in order."""
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

    seen = []
    run = VllmExecutor._run

    def spied(self, token_ids, order, *args, **kwargs):
        out = run(self, token_ids, order, *args, **kwargs)
        seen.append((tuple(token_ids), 0 if order.inject is None else order.inject.length, out[1]))
        return out

    monkeypatch.setattr(VllmExecutor, "_run", spied)
    return seen


def test_a_kvcomm_call_is_not_served_the_blocks_its_dense_twin_computed(vllm_llm, vllm_executor, monkeypatch):
    from kvcomm.cli import run_side_by_side
    from kvcomm.eval.report import compare, format_table, summarize

    vllm_llm.reset_prefix_cache()
    seen = _spy(monkeypatch)
    dense, reuse, _ = run_side_by_side(SPEC, vllm_executor, ReuseConfig(pool=PoolConfig(gamma=1.0)), progress=False)

    # Row 0's first agent: the same prompt on both systems, dense first; kvcomm has nothing to
    # inject yet (an empty engine), so it must compute the prompt as its dense twin did.
    twin = reuse[0].provenance
    assert reuse[0].prompt_ids == dense[0].prompt_ids and len(dense[0].prompt_ids) > 64
    assert twin.exact_tokens + twin.estimated_tokens == 0
    requests = [cached for ids, injected, cached in seen if ids == dense[0].prompt_ids and injected == 0]
    assert len(requests) == 2  # the dense call, then its kvcomm twin
    assert requests == [0, 0], f"vLLM served the kvcomm call {requests[1]} prompt tokens its dense twin computed"
    assert twin.cached_tokens == 0 and dense[0].provenance.cached_tokens == 0

    # Dense keeps vLLM's prefix caching among its own calls: row 1's reader shares the system
    # prompt (more than one 32-token block) with row 0's.
    assert dense[2].agent == "reader" and dense[2].provenance.cached_tokens >= 32

    # What vLLM reported reaches the records: dense calls' cached tokens are vLLM's count; a
    # kvcomm call's is vLLM's count minus the tokens kvcomm injected (what the connector served).
    counts = {(ids, injected): cached for ids, injected, cached in seen}
    for call in dense:
        assert call.provenance.cached_tokens == counts[(call.prompt_ids, 0)]
    for call in reuse:
        injected = call.provenance.exact_tokens + call.provenance.estimated_tokens
        assert call.provenance.cached_tokens == counts[(call.prompt_ids, injected)] - injected
        assert 0 <= call.provenance.cached_tokens <= call.provenance.computed_tokens

    calls = compare(dense, reuse)
    assert [c.dense_cached_tokens for c in calls] == [d.provenance.cached_tokens for d in dense]
    assert [c.reuse_cached_tokens for c in calls] == [r.provenance.cached_tokens for r in reuse]
    assert [c.dense_prompt_tokens for c in calls] == [len(d.prompt_ids) for d in dense]
    s = summarize(calls)
    assert s["dense_cached_tokens"] == sum(d.provenance.cached_tokens for d in dense) >= 32
    assert s["reuse_cached_tokens"] == sum(r.provenance.cached_tokens for r in reuse)
    assert s["dense_prompt_tokens"] == sum(len(d.prompt_ids) for d in dense)
    table = format_table(calls)
    assert f"dense {s['dense_cached_tokens']} of its {s['dense_prompt_tokens']} prompt tokens" in table
    assert f"reuse {s['reuse_cached_tokens']} of its {s['prompt_tokens']}" in table


def test_executors_under_different_salts_share_no_blocks_and_keep_their_own(vllm_executor):
    """``with_salt``: the same engine, another prefix-cache namespace for requests that inject
    nothing; ``Generation.cached_tokens`` is vLLM's hit beyond what the call injected."""
    from kvcomm.reuse.executor import namespaced

    text = SYSTEM + " Notes: " + NOTES[0]
    ids = vllm_executor.encode(vllm_executor.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))
    assert len(ids) > 96
    a, b = namespaced(vllm_executor, "test-a"), namespaced(vllm_executor, "test-b")
    assert a.llm is b.llm is vllm_executor.llm and a.channel is vllm_executor.channel and a.salt != b.salt
    first = a.generate(ids, None, 2)
    assert first.cached_tokens == 0
    assert b.generate(ids, None, 2).cached_tokens == 0  # another namespace: a's blocks are not served
    again = a.generate(ids, None, 2)
    assert again.cached_tokens >= 64 and again.reply_ids == first.reply_ids  # its own blocks are
    injected = a.generate(ids, first.computed.span(0, 40), 2)  # a salt of its own: vLLM serves it nothing more
    assert injected.cached_tokens == 0 and injected.reply_ids == first.reply_ids


class _Workload:
    name = "notes"
    pipeline = SPEC

    def score(self, row, reply):
        return 0.0


def test_eval_runs_are_not_served_each_others_blocks_and_report_their_own(vllm_llm, vllm_executor, monkeypatch):
    """`kvcomm eval --backend vllm`: dense runs first, then each reuse run on the same rows in
    the same order; a run's first call injects nothing and must not be served the blocks the
    warm-up or the dense run computed for the same prompt. Each run keeps its own prefix caching."""
    from kvcomm.eval.evaluate import EvalSettings, evaluate
    from kvcomm.eval.outputs import format_table
    from kvcomm.eval.summary import aggregate
    from kvcomm.core.segments import Segment
    from kvcomm.reuse.runner import build_prompt

    vllm_llm.reset_prefix_cache()
    seen = _spy(monkeypatch)
    settings = EvalSettings(modes=("dense", "exact"), noise=False, timing_pass=False)
    result = evaluate(_Workload(), vllm_executor, settings, progress=False, kl=False)
    dense = result.runs[0]
    row = dense.calls[0].input_index  # the first row in the seed's order, the same in every run
    segment = Segment(tuple(vllm_executor.encode(NOTES[row])), slot="_")
    prompt = tuple(build_prompt(vllm_executor, SPEC.agents[0], {"notes": segment}).token_ids)
    requests = [cached for ids, injected, cached in seen if ids == prompt and injected == 0]
    assert len(requests) == (3 if row == 0 else 2)  # the warm-up (row 0), the dense run, the exact run
    assert requests == [0] * len(requests), f"vLLM served these calls of one prompt {requests} cached tokens"
    for run in result.runs:
        first = run.calls[0]
        assert first.exact_tokens + first.estimated_tokens == 0 and first.cached_tokens == 0, run.run.label
        for call in run.calls:
            assert 0 <= call.cached_tokens <= call.computed_tokens
    assert dense.run.mode == "dense" and sum(c.cached_tokens for c in dense.calls) >= 32  # its own prefix caching
    rows = {r["mode"]: r for r in aggregate(result) if r["seed"] == "pooled"}
    for mode, run in zip(("dense", "exact"), result.runs):
        assert rows[mode]["cached_tokens"] == sum(c.cached_tokens for c in run.calls)
        assert rows[mode]["cached_token_rate"] == rows[mode]["cached_tokens"] / rows[mode]["prompt_tokens"]
    assert "prefix hit" in format_table(result)
