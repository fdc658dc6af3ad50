"""Reuse in a team's first task (issue 40): three AutoGen agents with system messages of their
own read one design note; the agents after the first compute their unseen system prompt and
take the note from stored KV. SmolLM2 in process, kvcomm's defaults, against the same team
without reuse."""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.teams import RoundRobinGroupChat

from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
from kvcomm.integrations.local.backend import ChatBackend
from kvcomm.integrations.transformers.executor import TransformersExecutor
from kvcomm.reuse.engine import ReuseEngine

AGENTS = {
    "summarizer": "You are a technical writer. Summarize design notes for busy engineers.",
    "critic": "You are a critical reviewer. Point out the weakest part of a design and why it matters.",
    "editor": "You are the editor. Decide whether the note is ready and say APPROVE when it is.",
}
MAX_TOKENS = 24


def _note() -> str:
    spec = json.loads(resources.files("kvcomm.data").joinpath("review_pipeline.json").read_text())
    return spec["inputs"][0]["document"]


def _run(client: KvcommChatCompletionClient, task: str) -> list[str]:
    agents = [AssistantAgent(name, client, system_message=system) for name, system in AGENTS.items()]
    stop = MaxMessageTermination(4) | TextMentionTermination("APPROVE")
    result = asyncio.run(RoundRobinGroupChat(agents, termination_condition=stop).run(task=task))
    return [m.content for m in result.messages[1:]]


@pytest.mark.slow
def test_a_team_reuses_the_shared_note_in_its_first_task(smol):
    model, tokenizer = smol
    reuse = KvcommChatCompletionClient(ChatBackend(
        (executor := TransformersExecutor(model, tokenizer)), ReuseEngine(executor.rotary), MAX_TOKENS))
    dense = KvcommChatCompletionClient(ChatBackend(TransformersExecutor(model, tokenizer, dense_only=True), None, MAX_TOKENS))
    task = f"Review this design note.\n\n{_note()}"
    replies = {"dense": _run(dense, task), "reuse": _run(reuse, task)}

    calls = reuse.call_log
    print(f"\n{'call':>4} {'agent':10} {'prompt':>6} {'exact':>5} {'served':>6} {'preamble':>8} {'computed':>8} "
          f"{'ttft dense':>10} {'ttft reuse':>10} reply")
    for i, (call, twin) in enumerate(zip(calls, dense.call_log)):
        p = call.provenance
        same = "same" if i < len(replies["dense"]) and replies["dense"][i] == replies["reuse"][i] else "differs"
        print(f"{i:>4} {call.agent or '?':10} {p.prompt_tokens:>6} {p.exact_tokens:>5} {p.estimated_tokens:>6} "
              f"{p.preamble_tokens:>8} {p.computed_tokens:>8} {twin.provenance.ttft_s * 1e3:>8.0f}ms "
              f"{p.ttft_s * 1e3:>8.0f}ms {same if p.reused else '(computed)'}")
    prompt = sum(c.provenance.prompt_tokens for c in calls)
    served = sum(c.provenance.exact_tokens + c.provenance.estimated_tokens for c in calls)
    reused = [i for i, c in enumerate(calls) if c.provenance.reused]
    equal = sum(replies["dense"][i] == replies["reuse"][i] for i in reused if i < len(replies["dense"]))
    ttft = {mode: sum(c.provenance.ttft_s for c in client.call_log) for mode, client in (("dense", dense), ("reuse", reuse))}
    print(f"first task: {served} of {prompt} prompt tokens reused ({served / prompt:.0%}), "
          f"{sum(c.provenance.estimated_tokens for c in calls)} beyond the exact prefix; replies of the "
          f"{len(reused)} reusing calls equal to dense's: {equal}; total TTFT dense {ttft['dense']:.2f} s, "
          f"reuse {ttft['reuse']:.2f} s")

    assert [c.agent for c in calls][:3] == list(AGENTS)
    assert served / prompt >= 0.35
    assert sum(c.provenance.estimated_tokens for c in calls) > 0
    assert calls[0].provenance.estimated_tokens == 0  # nothing was known before the first call
    for call in calls[1:]:  # each later agent computes its own system prompt, then reads the note from stored KV
        p = call.provenance
        assert p.preamble_tokens > 0 and p.estimated_tokens > 0, p
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens
