"""Reuse in a team's first task through `kvcomm serve` (issue 40): the AutoGen team of
``autogen/test_first_task.py`` (three agents with system messages of their own reading one
design note) as remote clients of vLLM's default multiprocess engine, against the same team in
process on vLLM (``VllmExecutor``, the same model, gamma 1). The server plans ahead and computes
each later agent's unseen system prompt in a preamble request (``serve.preambles``), so every call makes
the in-process call's decisions: the same exact, preamble, estimated and computed token counts.
It lives beside the tests that share the session's in-process engine (``vllm_executor``): in
the serve folder that engine would start before the tests that start engines of their own and
refuse them (one in-process engine at a time)."""

from __future__ import annotations

import pytest

from kvcomm.anchors.config import PoolConfig
from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
from kvcomm.integrations.local.backend import ChatBackend
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine

from ..autogen.test_first_task import AGENTS, MAX_TOKENS, _note, _run

pytestmark = pytest.mark.slow
NOTE_CHARS = 3000
"""The note's first paragraphs, up to this many characters (611 tokens)."""


def _decisions(client: KvcommChatCompletionClient) -> list[tuple]:
    return [(c.agent, c.provenance.prompt_tokens, c.provenance.exact_tokens, c.provenance.preamble_tokens,
             c.provenance.estimated_tokens, c.provenance.computed_tokens) for c in client.call_log]


def test_the_team_through_kvcomm_serve_makes_the_in_process_decisions(kvcomm_server_mp, vllm_executor):
    from conftest import MP_SERVER_KEYS

    note = _note()
    task = f"Review this design note.\n\n{note[: note.rfind(chr(10), 0, NOTE_CHARS)]}"  # the servers' max_model_len is 1,024
    local = KvcommChatCompletionClient(ChatBackend(
        vllm_executor, ReuseEngine(vllm_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0))), MAX_TOKENS))
    remote = KvcommChatCompletionClient.remote(kvcomm_server_mp.base_url, api_key=MP_SERVER_KEYS[3], max_tokens=MAX_TOKENS)
    replies = {"in process": _run(local, task), "kvcomm serve": _run(remote, task)}
    decisions = {"in process": _decisions(local), "kvcomm serve": _decisions(remote)}

    print(f"\n{'call':>4} {'agent':10} {'where':13} {'prompt':>6} {'exact':>5} {'preamble':>8} {'served':>6} {'computed':>8} "
          f"{'ttft':>8} reply")
    for i, calls in enumerate(zip(local.call_log, remote.call_log)):
        for where, call in zip(decisions, calls):
            p, reply = call.provenance, replies[where][i] if i < len(replies[where]) else ""
            print(f"{i:>4} {call.agent or '?':10} {where:13} {p.prompt_tokens:>6} {p.exact_tokens:>5} {p.preamble_tokens:>8} "
                  f"{p.estimated_tokens:>6} {p.computed_tokens:>8} {(p.ttft_s or 0) * 1e3:>6.0f}ms {reply[:40]!r}")
    same = sum(a == b for a, b in zip(*decisions.values()))
    remote_calls = remote.call_log
    served = sum(c.provenance.exact_tokens + c.provenance.estimated_tokens for c in remote_calls)
    prompt = sum(c.provenance.prompt_tokens for c in remote_calls)
    print(f"through kvcomm serve: {served} of {prompt} prompt tokens reused ({served / prompt:.0%}), "
          f"{sum(c.provenance.preamble_tokens for c in remote_calls)} computed in preambles; "
          f"{same} of {len(remote_calls)} calls with the in-process decisions; replies equal: "
          f"{replies['in process'] == replies['kvcomm serve']}")

    assert replies["kvcomm serve"] == replies["in process"]  # the same prompts, so decisions compare
    assert decisions["kvcomm serve"] == decisions["in process"]
    assert [c.agent for c in remote_calls][:3] == list(AGENTS)
    for call in remote_calls[1:3]:  # the later agents compute their system prompt and read the note from stored KV
        assert call.provenance.preamble_tokens > 0 and call.provenance.estimated_tokens > 0, call.provenance
