"""Automatic detection of shared segments by exact token runs (no engine needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.integrations.vllm_detect import RunIndex
from kvcomm.integrations.vllm_params import SpanAnnotation
from kvcomm.pipeline import Slot, load_demo_pipeline


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


REPLIES = {
    "analyst": "The baker makes 12 muffins in the morning and 8 in the afternoon, 20 in total, and sells 15.",
    "planner": "1. Add the muffins: 12 + 8 = 20.\n2. Subtract the sold muffins: 20 - 15 = 5.",
    "critic": "The steps are correct; there is no mistake.",
}


def test_detection_rate_on_whole_text_tokenized_demo_prompts(smol):
    """An OpenAI client sends whole rendered text, tokenized in one go by the server: count
    how many of the slot contents (seen before, tokenized alone) detection finds in it, all
    but at most their edge tokens."""
    from kvcomm.integrations.transformers_executor import TransformersExecutor

    _, tokenizer = smol
    executor = TransformersExecutor.__new__(TransformersExecutor)
    executor.tokenizer = tokenizer
    spec = load_demo_pipeline()
    found = total = 0
    for row in spec.inputs:
        contents = {"task": row["task"], **REPLIES}
        index = RunIndex()
        for name, text in contents.items():
            index.add(executor.encode(text), name)
        for agent in spec.agents:
            parts = executor.render(agent.system, agent.parts)
            text = "".join(contents[p.name] if isinstance(p, Slot) else p for p in parts)
            ids = executor.encode(text)
            spans = {tuple(ids[s.start : s.end]) for s in index.find(ids)}
            for part in parts:
                if isinstance(part, Slot):
                    run = tuple(executor.encode(contents[part.name]))
                    total += 1
                    found += run in spans or run[1:-1] in spans
    rate = found / total
    print(f"\nauto-detection found {found}/{total} slot contents ({rate:.0%}) in whole-text tokenized prompts")
    assert rate >= 0.9
