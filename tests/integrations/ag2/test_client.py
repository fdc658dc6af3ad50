"""The AG2 backend (``register_model_client``), with the real ag2 package."""

from __future__ import annotations

import pytest
from autogen import ConversableAgent

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.ag2.client import KvcommAG2Client
from kvcomm.integrations.local.backend import ChatBackend

WRITER, REVIEWER = "You answer briefly.", "You review the answer in one sentence."
TASKS = ["Name a fruit.", "Which planet is the largest one?", "Give me a short word for happy.", "Name a capital city in Europe."]
CONFIG = {"config_list": [{"model": "kvcomm", "model_client_cls": "KvcommAG2Client"}], "cache_seed": None}


def _pair(backend: ChatBackend) -> tuple[ConversableAgent, ConversableAgent]:
    writer = ConversableAgent("writer", system_message=WRITER, llm_config=CONFIG, human_input_mode="NEVER")
    reviewer = ConversableAgent("reviewer", system_message=REVIEWER, llm_config=CONFIG, human_input_mode="NEVER")
    for agent in (writer, reviewer):
        agent.register_model_client(KvcommAG2Client, backend=backend, agent_name=agent.name)
    return writer, reviewer


def _exchange(backend: ChatBackend, task: str) -> list[dict]:
    """writer sends the task; reviewer answers (model call 1); writer answers that (call 2)."""
    writer, reviewer = _pair(backend)
    result = writer.initiate_chat(reviewer, message=task, max_turns=2, silent=True)
    return result.chat_history


@pytest.mark.slow
def test_two_agent_exchange_reuses_the_other_agents_reply(tiny_executor):
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), base_source="standalone"))
    backend = ChatBackend(tiny_executor, engine, max_new_tokens=12)
    histories = [_exchange(backend, task) for task in TASKS]
    assert [m["name"] for m in histories[-1]] == ["writer", "reviewer", "writer", "reviewer"]
    first_replies = {h[1]["content"] for h in histories[:3]}
    assert len(first_replies) >= 2, "the warm-up rows must give the pool two distinct reviewer replies"
    calls = backend.calls
    assert len(calls) == 3 * len(TASKS)
    assert [c.agent for c in calls] == ["reviewer", "writer", "reviewer"] * len(TASKS)  # as registered
    writer_call = calls[-2]  # the writer reads the reviewer's first reply
    reused, length = writer_call.slots["reviewer#0"]
    assert reused > 0 and length > 0, writer_call
    assert writer_call.provenance.estimated_tokens > 0
    for call in calls:
        p = call.provenance
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens and p.computed_tokens >= 1


@pytest.mark.slow
def test_dense_replies_equal_the_model_called_directly(tiny_executor):
    executor = tiny_executor
    backend = ChatBackend(executor, None, max_new_tokens=12)
    task, first, second, third = (m["content"] for m in _exchange(backend, TASKS[1]))
    seen = {
        first: [("system", REVIEWER), ("user", task)],
        second: [("system", WRITER), ("assistant", task), ("user", first)],
        third: [("system", REVIEWER), ("user", task), ("assistant", first), ("user", second)],
    }
    for reply, messages in seen.items():
        text = executor.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True,
        )
        assert executor.decode(executor.generate(executor.encode(text), None, 12).reply_ids) == reply
    assert len(backend.calls) == 3


@pytest.mark.slow
def test_model_client_protocol_and_errors(tiny_executor):
    backend = ChatBackend(tiny_executor, None, max_new_tokens=4)
    client = KvcommAG2Client({"model": "kvcomm-tiny"}, backend=backend)
    response = client.create({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert client.message_retrieval(response) == [response.choices[0].message.content]
    usage = client.get_usage(response)
    assert usage["completion_tokens"] == 3 and usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert usage["model"] == "kvcomm-tiny" and client.cost(response) == 0.0
    assert response.kvcomm is backend.last and response.choices[0].finish_reason == "length"
    with pytest.raises(ValueError, match="no tool support"):
        client.create({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]})
    with pytest.raises(ValueError, match="role 'robot'"):
        client.create({"messages": [{"role": "robot", "content": "Hi"}]})
    with pytest.raises(ValueError, match="non-empty list"):
        client.create({"messages": []})
    with pytest.raises(ValueError, match="streaming"):
        client.create({"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert len(backend.calls) == 1 and backend.last.agent is None  # no agent_name, no earlier reply
    with pytest.warns(DeprecationWarning, match="max_new_tokens is a deprecated alias of max_tokens"):
        response = client.create({"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 2})
    assert response.usage.completion_tokens == 2
    configured = KvcommAG2Client({"model": "kvcomm-tiny", "max_tokens": 1}, backend=backend)
    assert configured.create({"messages": [{"role": "user", "content": "Hi"}]}).usage.completion_tokens == 1
    with pytest.raises(ValueError, match="max_tokens=3 and max_new_tokens=2"):
        client.create({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "max_new_tokens": 2})
