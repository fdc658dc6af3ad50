"""Automatic detection of shared segments by exact token runs (no engine needed), and its
rate on the demo pipeline run for real."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.integrations.vllm.planning.run_index import RunIndex
from kvcomm.integrations.vllm.wire.params import SpanAnnotation
from kvcomm.reuse.pipeline import Slot, load_demo_pipeline
from kvcomm.reuse.runner import run_row

DEMO_FIGURES = (13, 34)
"""(found as whole runs, found whole or by interior) of the 36 slot contents, with SmolLM2's
real greedy replies (fp32, CPU). The README's detection paragraph must state these figures."""


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.lists(st.integers(100, 120), min_size=8, max_size=20), min_size=1, max_size=4),
    fillers=st.lists(st.lists(st.integers(0, 99), max_size=10), min_size=5, max_size=5),
)
def test_runs_are_found_where_they_were_placed(runs, fillers):
    # Distinct texts: each run opens with its own token (identical runs placed back to back,
    # e.g. 25 copies of one token, have no unique tiling to recover).
    runs = [[1000 + k] + run for k, run in enumerate(runs)]
    index = RunIndex(min_length=8)
    for k, run in enumerate(runs):
        index.add(run, f"s{k}")
    prompt, expected = list(fillers[0]), []
    for k, run in enumerate(runs):
        start = len(prompt)
        prompt += run
        expected.append((start, start + len(run)))
        prompt += fillers[k + 1]
    found = index.find(prompt)
    # runs are adjacent only through fillers; a longer run may swallow a neighbour's prefix
    # when a filler is empty, so check coverage: every token of a placed run is in a span.
    covered = {p for s in found for p in range(s.start, s.end)}
    assert all(p in covered for start, end in expected for p in range(start, end))
    assert all(tuple(prompt[s.start : s.end]) in {tuple(r) for r in runs} for s in found)
    assert all(a.end <= b.start for a, b in zip(found, found[1:]))


def test_longest_run_wins_and_short_runs_are_ignored():
    index = RunIndex(min_length=3)
    index.add([1, 2, 3], "a")
    index.add([1, 2, 3, 4, 5], "b")
    index.add([7, 8], "c")  # too short: never indexed
    assert index.find([0, 1, 2, 3, 4, 5, 7, 8, 1, 2, 3]) == (SpanAnnotation(1, 6, "b"), SpanAnnotation(8, 11, "a"))
    assert len(index) == 3  # [1, 2, 3, 4, 5] and its interior [2, 3, 4]; [1, 2, 3]'s interior is too short


@pytest.mark.slow
def test_detection_rate_on_whole_text_tokenized_demo_prompts(smol_executor):
    """An OpenAI client sends whole rendered text, tokenized in one go by the server. On the
    demo pipeline run for real (SmolLM2's greedy dense replies, its tokenizer and chat
    template), the server has indexed each task (as an annotated span, tokenized alone) and
    each reply (its generated token ids); count how many slot contents detection finds in the
    whole-text prompts, whole and by interior (first and last token dropped): the two figures
    the README states for the demo pipeline."""
    executor = smol_executor
    spec = load_demo_pipeline()
    exact = found = total = 0
    for row in range(len(spec.inputs)):
        calls = {c.agent: c for c in run_row(spec, row, executor, None)}  # dense: the replies the agents gave
        runs = {"task": tuple(executor.encode(spec.inputs[row]["task"]))}
        runs.update({name: tuple(int(t) for t in c.reply_ids if t != executor.tokenizer.eos_token_id) for name, c in calls.items()})
        texts = {"task": spec.inputs[row]["task"], **{name: c.reply for name, c in calls.items()}}
        index = RunIndex()
        for name, run in runs.items():
            index.add(run, name)
        for agent in spec.agents:
            parts = executor.render(agent.system, agent.parts)
            ids = executor.encode("".join(texts[p.name] if isinstance(p, Slot) else p for p in parts))
            spans = {tuple(ids[s.start : s.end]) for s in index.find(ids)}
            for part in parts:
                if isinstance(part, Slot):
                    run = runs[part.name]
                    assert len(run) >= index.min_length, (part.name, run)  # indexed: long enough
                    total += 1
                    exact += run in spans
                    found += run in spans or run[1:-1] in spans
    print(f"\nauto-detection on real demo replies: exact runs {exact}/{total}, with interiors {found}/{total}")
    assert total == 36
    assert (exact, found) == DEMO_FIGURES


def _adversarial_index(runs: int, **options) -> RunIndex:
    """``runs`` distinct runs of 64 tokens that all open with the same 9 tokens and differ later
    (the old index kept them in one list per first token and compared each at every position)."""
    index = RunIndex(**options)
    for r in range(runs):
        index.add([1] * 9 + [2 + (r >> s) % 7 for s in range(0, 55)], f"slot{r % 5}")
    return index


def test_detection_work_does_not_grow_with_the_stored_runs():
    """find runs inside the engine step: its work (k-grams hashed, candidates compared, tokens
    verified) on one prompt is the same with 10 or 4,096 stored runs; at 512 runs the old scan
    took 8 s for one prompt. The index also stays within its token budget."""
    prompt = [1] * 2_000  # built to hit every stored run's opening at every position
    work = {}
    for runs in (10, 512, 4096):
        index = _adversarial_index(runs)
        assert index.find(prompt) == ()
        work[runs] = index.work
        assert index.tokens <= index.max_tokens and len(index) <= index.max_runs
    print(f"\ndetection work on a {len(prompt)}-token prompt by stored runs: {work}")
    assert max(work.values()) <= len(prompt) * (2 + index.min_length + index.bucket)
    assert work[4096] == work[512] <= work[10] + len(prompt) * index.bucket


def test_the_index_is_bounded_in_runs_tokens_and_per_kgram():
    index = RunIndex(min_length=4, max_runs=100, max_tokens=1_000, bucket=3)
    for r in range(50):
        index.add(list(range(r * 100, r * 100 + 60)), "s")  # distinct 60-token runs, interiors 58
    assert index.tokens <= 1_000 and len(index) <= 100
    assert index.find(list(range(4900, 4960))) == (SpanAnnotation(0, 60, "s"),)  # the newest are kept
    for r in range(10):
        index.add([7, 7, 7, 7, r, r, r], "t")
    assert len(index._by_gram[(7, 7, 7, 7)]) == 3
