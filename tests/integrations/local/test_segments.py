"""Per-message chat rendering, tool-call parsing and context handles (AutoGen/AG2 backends)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.local.backend import ChatBackend
from kvcomm.integrations.local.segments import ChatTurn, parse_tool_calls, render_chat, supports_tools
from kvcomm.core.segments import content_id

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You help.' }}"
    "\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

_words = st.text(st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters=" .,?!'"), min_size=1, max_size=40)
_content = _words.filter(lambda s: not s[0].isspace())
_turn = st.tuples(st.sampled_from(["user", "assistant"]), st.sampled_from([None, "planner", "critic"]), _content)


@pytest.fixture(scope="module")
def tokenizer(smol):
    return smol[1]


def _encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _content), turns=st.lists(_turn, min_size=1, max_size=6))
def test_per_message_segments_tokenize_like_the_whole_conversation(tokenizer, system, turns):
    chat = ([ChatTurn("system", system)] if system else []) + [ChatTurn(r, c, s) for r, s, c in turns]
    rendered = render_chat(tokenizer, _encode(tokenizer), chat)
    whole = tokenizer.apply_chat_template(
        [{"role": t.role, "content": t.content} for t in chat], tokenize=False, add_generation_prompt=True,
    )
    assert rendered.note == "" and list(rendered.prompt.token_ids) == _encode(tokenizer)(whole)
    shared = [s for s in rendered.prompt.segments if s.is_shared]
    messages = [t for t in chat if t.role != "system"]
    assert len(shared) == len(messages) == len(rendered.turn_segments)
    spoken: dict[str, int] = {}
    for segment, turn in zip(shared, messages):
        author = turn.source or turn.role
        assert segment.token_ids == tuple(_encode(tokenizer)(turn.content))
        assert segment.shared_id == content_id(segment.token_ids)  # the same text has the same id anywhere
        assert segment.slot == f"{author}#{spoken.get(author, 0)}"
        spoken[author] = spoken.get(author, 0) + 1
    other = render_chat(tokenizer, _encode(tokenizer), [ChatTurn("system", "Another agent.")] + chat[1 if system else 0 :])
    assert other.prompt.template_id != rendered.prompt.template_id or not system


@pytest.mark.slow
def test_trimming_template_and_marker_characters_fall_back_cleanly(tokenizer):
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | trim")
    chat = [ChatTurn("system", "S"), ChatTurn("user", "  padded text  ", "user")]
    rendered = render_chat(trimming, _encode(trimming), chat)
    whole = trimming.apply_chat_template([{"role": t.role, "content": t.content} for t in chat], tokenize=False, add_generation_prompt=True)
    assert rendered.note == "" and list(rendered.prompt.token_ids) == _encode(trimming)(whole)
    assert [s.token_ids for s in rendered.prompt.segments if s.is_shared] == [tuple(_encode(trimming)("padded text"))]
    odd = render_chat(tokenizer, _encode(tokenizer), [ChatTurn("user", "a \ue000 marker", "user")])
    assert "no per-message segments" in odd.note and not any(s.is_shared for s in odd.prompt.segments)
    with pytest.raises(ValueError, match="at least one message"):
        render_chat(tokenizer, _encode(tokenizer), [])


@pytest.mark.slow
def test_tool_template_renders_tools_calls_and_results(tiny_executor):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core import FunctionCall
    from autogen_core.models import AssistantMessage, FunctionExecutionResult, FunctionExecutionResultMessage, UserMessage
    from autogen_core.tools import FunctionTool

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    tools_tokenizer = copy.deepcopy(tiny_executor.tokenizer)
    tools_tokenizer.chat_template = TOOL_TEMPLATE
    assert supports_tools(tools_tokenizer) and not supports_tools(tiny_executor.tokenizer)
    executor = TransformersExecutor(tiny_executor.model, tools_tokenizer)
    client = KvcommChatCompletionClient(ChatBackend(executor, ReuseEngine(executor.rotary), max_new_tokens=4))

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    tool = FunctionTool(add, description="Add two numbers.")
    assert client.model_info["function_calling"] is True
    AssistantAgent("calc", client, tools=[add])  # accepted: the template renders tools
    messages = [
        UserMessage(content="What is 2 + 3?", source="user"),
        AssistantMessage(content=[FunctionCall(id="c1", name="add", arguments='{"a": 2, "b": 3}')], source="calc"),
        FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="5", name="add", call_id="c1")]),
    ]
    result = asyncio.run(client.create(messages, tools=[tool]))
    assert result.usage.completion_tokens == 4 and result.finish_reason in ("length", "stop", "function_calls")
    from kvcomm.integrations.autogen.client import to_turns, tool_schemas

    rendered = render_chat(tools_tokenizer, executor.encode, to_turns(messages), tool_schemas([tool]))
    text = executor.decode(rendered.prompt.token_ids)
    assert '"name": "add"' in text and '"arguments": {"a": 2, "b": 3}' in text and "<tool_response>\n5\n</tool_response>" in text
    assert {s.slot for s in rendered.prompt.segments if s.is_shared} == {"user#0", "add#0"}


def test_parse_tool_calls():
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call> done'
    calls, rest = parse_tool_calls(text)
    assert calls == [{"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}] and rest == "Let me add.  done"
    broken = "<tool_call>{not json}</tool_call> <tool_call>[1]</tool_call>"
    assert parse_tool_calls(broken) == ([], broken)


@pytest.mark.slow
def test_context_handles_retain_release_evict_fall_back_to_text(tiny_executor):
    from autogen_core.models import SystemMessage, UserMessage

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    backend = ChatBackend(tiny_executor, ReuseEngine(tiny_executor.rotary), max_new_tokens=3, base_bytes=0)
    client = KvcommChatCompletionClient(backend)
    document = "The Seine flows through Paris into the English Channel."
    handle = client.retain_context(document)
    again = client.retain_context(document)
    assert handle == again and backend.contexts.retained() == {handle.context_id: 2}
    ids = tuple(tiny_executor.encode(document))
    assert handle.context_id == content_id(ids) and handle.token_count == len(ids)
    from kvcomm.core.segments import Segment

    expected = tiny_executor.base_kv(Segment(ids, slot="_"))
    held = backend.engine._bases[handle.context_id][0]
    assert torch.allclose(held.keys, expected.keys) and torch.allclose(held.values, expected.values)

    messages = [SystemMessage(content="You read."), UserMessage(content=document, source="user")]
    args = {"context_ids": [handle.context_id, "no-such-id"]}
    asyncio.run(client.create(messages, extra_create_args=args))
    # retained, but the plan stops at the new system message before the document: not a hit
    assert client.last_call.provenance.reuse_end == 0 and "has no base yet" in client.last_call.provenance.note
    assert client.last_call.contexts == {handle.context_id: "unused", "no-such-id": "absent"}
    asyncio.run(client.create(messages, extra_create_args=args))  # the same prompt again: its exact prefix
    assert client.last_call.slots["user#0"][0] > 0
    assert client.last_call.contexts == {handle.context_id: "hit", "no-such-id": "absent"}
    assert backend.engine.has_base(handle.context_id)  # retained: the zero byte bound does not drop it

    backend.engine.drop_base(handle.context_id)
    assert backend.contexts.state(handle.context_id) == "live"  # its anchor holds the one base of the content
    for pool in backend.engine.pools.values():  # what a tenant byte cap does once the anchors go too
        while pool.evict() is not None:
            pass
    assert backend.contexts.state(handle.context_id) == "evicted"
    messages[0] = SystemMessage(content="You summarize.")  # behind a new prefix the document needs its base
    asyncio.run(client.create(messages, extra_create_args=args))
    assert client.last_call.contexts[handle.context_id] == "fallback"
    assert backend.contexts.state(handle.context_id) == "live"  # recomputed from the text

    assert client.release_context(handle) and client.release_context(handle.context_id)
    assert not client.release_context(handle)  # not retained any more: no error, nothing changes
    assert backend.contexts.state(handle.context_id) == "released"
    assert backend.engine.stored_base(handle.context_id) is None or any(  # only an anchor may still hold it
        pool.get(handle.context_id) is not None for pool in backend.engine.pools.values())
    result = asyncio.run(client.create(messages, extra_create_args=args))
    assert client.last_call.contexts[handle.context_id] == "fallback" and result.usage.completion_tokens == 3
    assert backend.contexts.unretained_bytes == 0
    with pytest.raises(ValueError, match="empty text"):
        client.retain_context("")
