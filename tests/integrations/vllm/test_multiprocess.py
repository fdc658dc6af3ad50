"""The plugin under vLLM's default multiprocess engine (worker in a process of its own, no
environment variable): annotated requests are planned in the worker, with metadata only
between scheduler and worker, and give the same decisions, cached tokens and replies as the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Each mode runs in a subprocess of its own (``support/pipeline_run.py``): the demo pipeline's
rows 0-2, an exact repeat of the first prompt and a request that does not opt in."""

from __future__ import annotations

import pytest

from support.pipeline_run import run_in_subprocess

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {mode: run_in_subprocess(mode) for mode in ("mp", "inproc")}


def test_the_default_engine_runs_the_worker_in_another_process(runs):
    assert runs["mp"]["env"] is None and runs["mp"]["backend"] == "mp" and runs["mp"]["client"] == "SyncMPClient"
    assert runs["inproc"]["backend"] == "uni" and runs["inproc"]["client"] == "InprocClient"


def test_annotated_requests_learn_and_reuse_under_multiprocessing(runs):
    run = runs["mp"]
    summaries = [call["kvcomm"] for call in run["calls"]]
    for call, summary in zip(run["calls"], summaries):
        assert summary is not None and "error" not in summary, summary
        assert summary["exact_tokens"] + summary["estimated_tokens"] + summary["computed_tokens"] == call["prompt_tokens"]
        assert call["cached"] >= summary["exact_tokens"] + summary["estimated_tokens"]  # the worker wrote what was claimed
    assert sum(s["exact_tokens"] for s in summaries) > 0 and sum(s["estimated_tokens"] for s in summaries) > 0
    repeat, plain = run["repeat"], run["plain"]
    assert repeat["kvcomm"]["exact_tokens"] == repeat["prompt_tokens"] - 1 == repeat["cached"]
    # Injecting the exact prefix reproduces the dense reply; the plain request is stock vLLM's.
    assert repeat["reply"] == plain["reply"] and plain["kvcomm"] is None and plain["cached"] == 0


def test_multiprocessing_gives_the_in_process_decisions_and_replies(runs):
    mp, inproc = runs["mp"], runs["inproc"]
    assert len(mp["calls"]) == len(inproc["calls"]) > 0
    for name in ("calls", "repeat", "plain"):
        assert mp[name] == inproc[name], name
