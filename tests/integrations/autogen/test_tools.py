"""AutoGen tool calls through the kvcomm client: a model that answers with a Hermes-style
``<tool_call>`` block gives AutoGen ``FunctionCall`` objects, which ``AssistantAgent`` runs;
images are refused (no vision); ``actual_usage`` / ``total_usage`` add up the calls.

The model is a tiny random Llama trained here, in a few seconds, to answer one prompt with
one tool call (greedy decoding then reproduces it): a real model and a real forward pass,
so the reply goes through the same decode, parse and AutoGen conversion as any model's.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent, ToolCallSummaryMessage
from autogen_core import FunctionCall
from autogen_core.models import RequestUsage, SystemMessage, UserMessage
from autogen_core.tools import FunctionTool

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.autogen.client import KvcommChatCompletionClient, to_turns, tool_schemas
from kvcomm.integrations.local.backend import ChatBackend
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from ..local.test_segments import TOOL_TEMPLATE

SYSTEM = "You are a calculator. Use the tools."
TASK = "What is 2 + 3?"
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _train_to_answer(executor, prompt: list[int], reply: list[int], steps: int = 400) -> None:
    """Teacher-force ``reply`` (then end of turn) after ``prompt`` until greedy decoding
    reproduces it; raises AssertionError if it does not within ``steps``."""
    model = executor.model
    target = reply + [executor.tokenizer.eos_token_id]
    ids = torch.tensor([prompt + target[:-1]])
    labels = torch.tensor(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 :]
        logits = model.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 24 and bool((logits.argmax(-1) == labels).all()):
            break
    model.eval()
    with torch.no_grad():
        assert executor.generate(prompt, None, len(target) + 2).reply_ids == tuple(reply), "the tiny model did not learn the reply"


@pytest.fixture(scope="module")
def tool_executor(smol):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers.executor import TransformersExecutor

    tokenizer = copy.deepcopy(smol[1])
    tokenizer.chat_template = TOOL_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    executor = TransformersExecutor(LlamaForCausalLM(config).eval(), tokenizer)
    backend = ChatBackend(executor, None)
    # what AssistantAgent sends: its system message, the task, and the tool built from `add`
    messages = [SystemMessage(content=SYSTEM), UserMessage(content=TASK, source="user")]
    tools = tool_schemas([FunctionTool(add, description=add.__doc__)])
    prompt = backend.render(to_turns(messages), tools).prompt
    _train_to_answer(executor, list(prompt.token_ids), list(executor.encode(CALL_TEXT)))
    return executor, len(prompt)


def test_a_tool_call_reply_comes_back_as_function_calls_that_the_agent_runs(tool_executor):
    executor, prompt_tokens = tool_executor
    backend = ChatBackend(executor, ReuseEngine(executor.rotary), max_new_tokens=48)
    client = KvcommChatCompletionClient(backend)
    assert client.model_info["function_calling"] is True
    agent = AssistantAgent("calc", client, tools=[add], system_message=SYSTEM)
    result = asyncio.run(agent.run(task=TASK))
    kinds = [type(m) for m in result.messages[1:]]
    assert kinds == [ToolCallRequestEvent, ToolCallExecutionEvent, ToolCallSummaryMessage], result.messages
    (call,) = result.messages[1].content
    assert isinstance(call, FunctionCall) and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    (executed,) = result.messages[2].content
    assert executed.content == "5" and executed.call_id == call.id and not executed.is_error
    assert result.messages[3].content == "5"
    (logged,) = client.call_log
    assert logged.finish_reason == "function_calls" and logged.prompt_tokens == prompt_tokens

    # the same call made directly: a CreateResult whose content is the FunctionCall list
    created = asyncio.run(client.create(
        [SystemMessage(content=SYSTEM), UserMessage(content=TASK, source="user")],
        tools=[FunctionTool(add, description=add.__doc__)],
    ))
    assert created.finish_reason == "function_calls" and created.thought is None
    assert [(c.name, json.loads(c.arguments)) for c in created.content] == [("add", {"a": 2, "b": 3})]
    assert created.content[0].id != call.id  # ids are per call
    # with tool_choice "none" the tools are not offered and the reply stays text
    plain = asyncio.run(client.create(
        [SystemMessage(content=SYSTEM), UserMessage(content=TASK, source="user")],
        tools=[FunctionTool(add, description=add.__doc__)], tool_choice="none",
    ))
    assert isinstance(plain.content, str) and plain.finish_reason in ("stop", "length")


def test_images_are_refused_and_usage_adds_up(tiny_executor):
    from PIL import Image as PILImage
    from autogen_core import Image

    backend = ChatBackend(tiny_executor, ReuseEngine(tiny_executor.rotary), max_new_tokens=3)
    client, other = KvcommChatCompletionClient(backend), KvcommChatCompletionClient(backend)
    assert client.model_info["vision"] is False and client.capabilities["vision"] is False
    picture = Image.from_pil(PILImage.new("RGB", (8, 8), "red"))
    with pytest.raises(ValueError, match="no vision: remove images"):
        asyncio.run(client.create([UserMessage(content=["What is in this picture?", picture], source="user")]))
    assert client.actual_usage() == RequestUsage(0, 0) and len(backend.calls) == 0

    conversations = [
        [SystemMessage(content="You answer briefly."), UserMessage(content=task, source="user")]
        for task in ("Name a fruit.", "Name a colour.", "Name a planet.")
    ]
    results = [asyncio.run(client.create(messages)) for messages in conversations]
    asyncio.run(other.create(conversations[0]))
    # text parts without images are joined, and counted like any other prompt
    asyncio.run(client.create([UserMessage(content=["Name a city.", "Just one."], source="user")]))
    mine = [c for i, c in enumerate(backend.calls) if i != 3]
    expected = RequestUsage(sum(c.prompt_tokens for c in mine), sum(c.completion_tokens for c in mine))
    assert client.actual_usage() == expected == client.total_usage()
    assert expected.completion_tokens == 3 * 4 and all(r.usage.completion_tokens == 3 for r in results)
    assert other.actual_usage() == RequestUsage(backend.calls[3].prompt_tokens, 3)  # per client, not per backend
