"""The AutoGen (autogen-agentchat / autogen-core 0.7) backend, with the real packages."""

from __future__ import annotations

import asyncio

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core import CancellationToken
from autogen_core.models import AssistantMessage, SystemMessage, UserMessage

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
from kvcomm.integrations.local.backend import ChatBackend
from support.chat_streaming import assert_concurrent_calls_equal_sequential, collect_stream

WRITER, REVIEWER = "You answer briefly.", "You review the answer in one sentence."
TASKS = ["Name a fruit.", "Which planet is the largest one?", "Give me a short word for happy.", "Name a capital city in Europe."]


def _team(client: KvcommChatCompletionClient) -> RoundRobinGroupChat:
    writer = AssistantAgent("writer", client, system_message=WRITER)
    reviewer = AssistantAgent("reviewer", client, system_message=REVIEWER)
    return RoundRobinGroupChat([writer, reviewer], max_turns=2)


def _reuse_backend(executor, max_new_tokens: int = 12, scope: str = ReuseConfig.scope) -> ChatBackend:
    # gamma 1: any two compatible anchors are close enough, so reuse starts after two samples
    config = ReuseConfig(pool=PoolConfig(gamma=1.0), base_source="standalone", scope=scope)
    return ChatBackend(executor, ReuseEngine(executor.rotary, config), max_new_tokens)


@pytest.mark.slow
def test_round_robin_reviewer_reuses_writers_reply(tiny_executor):
    # scope all: the writer's reply is served from its decode KV to its only reader; under the
    # default (all-reader-replies) its first reader computes it
    client = KvcommChatCompletionClient(_reuse_backend(tiny_executor, scope="all"))
    replies = []
    for task in TASKS:
        result = asyncio.run(_team(client).run(task=task))
        assert [m.source for m in result.messages] == ["user", "writer", "reviewer"]
        replies.append(result.messages[1].content)
    calls = client.call_log
    assert len(calls) == 2 * len(TASKS)
    # the log says which participant called, the first time each speaks too (no earlier reply to read it from)
    assert [c.agent for c in calls] == ["writer", "reviewer"] * len(TASKS)
    assert len(set(replies[:3])) >= 2, "the warm-up rows must give the pool two distinct writer replies"
    reviewer = calls[-1]
    assert reviewer.template_id != calls[-2].template_id  # two agents, told apart by their system messages
    reused, length = reviewer.slots["writer#0"]
    assert reused > 0 and length > 0, reviewer
    # a reply's KV becomes a base only when its whole context was computed or exact
    assert not any(c.reply_registered for c in calls if c.provenance.estimated_tokens > 0)
    assert any(c.reply_registered for c in calls)
    # a reply cut by max_tokens is a base too (the remote clients match it: tests/integrations/remote)
    assert any(c.reply_registered and c.finish_reason == "length" for c in calls)
    assert reviewer.provenance.estimated_tokens > 0 and not reviewer.provenance.fallback
    for call in calls:
        p = call.provenance
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens and p.computed_tokens >= 1
    summary = client.summary()
    assert summary["calls"] == len(calls) and summary["estimated_tokens"] > 0
    usage = client.total_usage()
    assert usage.prompt_tokens == sum(c.prompt_tokens for c in calls)
    assert usage.completion_tokens == sum(c.completion_tokens for c in calls)


@pytest.mark.slow
def test_dense_client_replies_equal_the_model_called_directly(tiny_executor):
    """Dense mode is the model itself: each agent's reply equals a plain greedy generation on
    the chat template's own tokenization of what that agent saw."""
    executor = tiny_executor
    client = KvcommChatCompletionClient(ChatBackend(executor, None, max_new_tokens=12))
    result = asyncio.run(_team(client).run(task=TASKS[0]))
    task, written, reviewed = (m.content for m in result.messages)
    seen = {
        written: [("system", WRITER), ("user", task)],
        reviewed: [("system", REVIEWER), ("user", task), ("user", written)],
    }
    for reply, messages in seen.items():
        ids = executor.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True,
        )
        direct = executor.generate(executor.encode(ids), None, 12)
        assert executor.decode(direct.reply_ids) == reply
    assert all(c.provenance.computed_tokens == c.prompt_tokens for c in client.call_log)


@pytest.mark.slow
def test_stream_chunks_add_up_and_cancellation_stops_decoding(tiny_executor):
    client = KvcommChatCompletionClient(_reuse_backend(tiny_executor, 10))
    messages = [SystemMessage(content=WRITER), UserMessage(content=TASKS[0], source="user")]

    def stream(token=None, cancel_after=None):
        return collect_stream(client, messages, token, cancel_after)

    chunks, result = asyncio.run(stream())
    assert "".join(chunks) == result.content and len(chunks) > 1
    assert result.usage.completion_tokens == 10 and result.finish_reason == "length"
    created = asyncio.run(client.create(messages))
    assert created.content == result.content

    before = len(client.call_log)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stream(CancellationToken(), cancel_after=1))
    # wait for the worker thread: the backend logs the stopped call, then serves the next one
    again = asyncio.run(client.create(messages))
    assert again.content == result.content
    stopped = client.call_log[before]
    assert stopped.finish_reason == "cancelled" and stopped.completion_tokens < 10
    token = CancellationToken()
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(client.create(messages, cancellation_token=token))


@pytest.mark.slow
def test_interface_counts_tools_and_bad_input(tiny_executor):
    client = KvcommChatCompletionClient(ChatBackend(tiny_executor, None))
    messages = [
        SystemMessage(content=WRITER), UserMessage(content=TASKS[1], source="user"),
        AssistantMessage(content="Jupiter.", source="writer"),
    ]
    expected = tiny_executor.tokenizer.apply_chat_template(
        [{"role": "system", "content": WRITER}, {"role": "user", "content": TASKS[1]}, {"role": "assistant", "content": "Jupiter."}],
        tokenize=False, add_generation_prompt=True,
    )
    assert client.count_tokens(messages) == len(tiny_executor.encode(expected))
    assert client.remaining_tokens(messages) == 2048 - client.count_tokens(messages)
    info = client.model_info
    assert info["function_calling"] is False and info["vision"] is False  # SmolLM2's template has no tools

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    with pytest.raises(ValueError, match="function calling"):
        AssistantAgent("calc", client, tools=[add])
    from autogen_core.tools import FunctionTool

    with pytest.raises(ValueError, match="no tool support"):
        asyncio.run(client.create(messages, tools=[FunctionTool(add, description="Add.")]))
    with pytest.raises(ValueError, match="json_output"):
        asyncio.run(client.create(messages, json_output=True))
    with pytest.raises(ValueError, match="unknown extra_create_args"):
        asyncio.run(client.create(messages, extra_create_args={"temperature": 0.5}))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        asyncio.run(client.create(messages, extra_create_args={"max_tokens": 5000}))
    assert len(client.call_log) == 0  # refused calls leave no trace
    asyncio.run(client.close())
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(client.create(messages))


@pytest.mark.slow
def test_reply_budget_is_max_tokens_and_max_new_tokens_a_deprecated_alias(tiny_executor):
    client = KvcommChatCompletionClient(ChatBackend(tiny_executor, None, max_new_tokens=12))
    messages = [SystemMessage(content=WRITER), UserMessage(content=TASKS[0], source="user")]
    assert asyncio.run(client.create(messages, extra_create_args={"max_tokens": 3})).usage.completion_tokens == 3
    with pytest.warns(DeprecationWarning, match="max_new_tokens is a deprecated alias of max_tokens"):
        result = asyncio.run(client.create(messages, extra_create_args={"max_new_tokens": 2}))
    assert result.usage.completion_tokens == 2
    with pytest.raises(ValueError, match="max_tokens=3 and max_new_tokens=2"):
        asyncio.run(client.create(messages, extra_create_args={"max_tokens": 3, "max_new_tokens": 2}))


@pytest.mark.slow
def test_calls_name_their_agent_outside_a_team_too(tiny_executor):
    """Outside a team no runtime says who calls: ``for_agent`` gives each agent a client on the
    shared backend under its name; an unnamed client falls back to the last reply's author."""
    client = KvcommChatCompletionClient(ChatBackend(tiny_executor, None, max_new_tokens=3))
    critic = client.for_agent("critic")
    assert critic.backend is client.backend
    asyncio.run(AssistantAgent("critic", critic, system_message=REVIEWER).run(task=TASKS[0]))
    asyncio.run(AssistantAgent("anonymous", client, system_message=WRITER).run(task=TASKS[0]))
    messages = [SystemMessage(content=WRITER), UserMessage(content=TASKS[1], source="user"),
                AssistantMessage(content="Jupiter.", source="writer"), UserMessage(content="Why?", source="user")]
    asyncio.run(client.create(messages))
    assert [c.agent for c in client.call_log] == ["critic", None, "writer"]


@pytest.mark.slow
def test_selector_group_chat_runs_on_one_shared_client(tiny_executor):
    """The selector's own calls go through the same client: its prompt (the transcript) is
    one user message, with no system message. The random model names no agent, so AutoGen
    falls back to the first participant; then only the other one may speak (no model call)."""
    from autogen_agentchat.teams import SelectorGroupChat

    client = KvcommChatCompletionClient(_reuse_backend(tiny_executor, 6))
    writer = AssistantAgent("writer", client, system_message=WRITER)
    reviewer = AssistantAgent("reviewer", client, system_message=REVIEWER)
    team = SelectorGroupChat([writer, reviewer], client, max_turns=2, max_selector_attempts=1)
    result = asyncio.run(team.run(task=TASKS[0]))
    assert [m.source for m in result.messages] == ["user", "writer", "reviewer"]
    selector, written, reviewed = client.call_log
    assert (selector.agent, written.agent, reviewed.agent) == ("SelectorGroupChatManager", "writer", "reviewer")
    assert selector.template_id == "chat:default" and set(selector.slots) == {"user#0"}
    # three different templates: the selector's, the writer's and the reviewer's system messages
    assert len({selector.template_id, written.template_id, reviewed.template_id}) == 3
    assert set(reviewed.slots) == {"user#0", "writer#0"} and reviewed.slots["writer#0"][1] == written.completion_tokens


@pytest.mark.slow
def test_concurrent_calls_are_serialized_and_equal_sequential_ones(tiny_executor):
    client = KvcommChatCompletionClient(ChatBackend(tiny_executor, None, max_new_tokens=6))
    conversations = [[SystemMessage(content=s), UserMessage(content=t, source="user")] for s, t in zip((WRITER, REVIEWER), TASKS)]
    assert_concurrent_calls_equal_sequential(client, conversations)


def test_a_guarded_team_is_measured_and_exported(tiny_executor):
    """A quality guard on the shared backend measures every call that estimated KV (fraction 1),
    never acts at a huge budget (same replies as unguarded), and its numbers reach Prometheus."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvcomm.integrations.local.guard_metrics import export
    from kvcomm.services.quality_guard import GuardConfig, QualityGuard

    guard = QualityGuard(GuardConfig(fraction=1.0, budget=1e9, min_samples=1))
    runs = {}
    for name, backend_guard in (("plain", None), ("guarded", guard)):
        backend = _reuse_backend(tiny_executor)
        backend.guard = backend_guard
        client = KvcommChatCompletionClient(backend)
        runs[name] = [asyncio.run(_team(client).run(task=task)).messages[-1].content for task in TASKS]
        calls = client.call_log
    assert runs["guarded"] == runs["plain"]
    estimated = [c for c in calls if c.provenance.estimated_tokens > 0]
    assert estimated and guard.metrics()["measured"] == len(estimated)
    registry = CollectorRegistry()
    export(guard, "team", registry)
    assert "kvcomm_guard_measured_total{tenant=" in generate_latest(registry).decode()
