"""Automatic detection of shared segments by exact token runs (no engine needed), and its
rate on the demo pipeline run for real."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.integrations.vllm.detect import RunIndex
from kvcomm.integrations.vllm.params import SpanAnnotation
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
