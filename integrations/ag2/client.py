"""An AG2 ``ModelClient`` served by kvcomm in process (AG2 0.x ``register_model_client``).

    config_list = [{"model": "kvcomm", "model_client_cls": "KvcommAG2Client"}]
    agent = ConversableAgent("writer", system_message=..., llm_config={"config_list": config_list})
    agent.register_model_client(KvcommAG2Client, backend=backend)

Register the same ``ChatBackend`` with every agent so they share one executor and one reuse
engine, each with its name (``agent_name=``) so the call log says which agent called: AG2
does not pass the agent to a model client. Reuse statistics: ``response.kvcomm`` (a
``ChatCall``) on each response, and ``backend.calls`` / ``backend.summary()``. Per-call
options in the config entry or the ``create`` params: ``max_tokens`` (the reply budget;
``max_new_tokens`` is a deprecated alias), ``context_ids``. AG2's own response cache
(``cache_seed``) is separate: keep it None to measure kvcomm.

Remote flavour (against ``kvcomm serve``): a ``base_url`` in the config entry, e.g.
``{"model": "kvcomm", "model_client_cls": "KvcommAG2Client", "base_url": "http://host:8000"}``
(optional ``api_key``, ``kvcomm_tenant``, ``kvcomm_tokenizer``, ``kvcomm_session``: the key a
router routes the team's calls by, ``remote.affinity``; the served model is checked), or
``backend=RemoteChatBackend(url, session=...)`` shared by every agent.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from kvcomm.integrations.local.backend import ChatBackend, ChatCall, reply_budget
from kvcomm.integrations.local.segments import ChatTurn

_ids = itertools.count()


@dataclass
class AG2Message:
    """An OpenAI-style assistant message (what AG2 reads from ``choices[i].message``)."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[dict[str, Any]] | None = None
    function_call: None = None

    def model_dump(self) -> dict[str, Any]:
        out: dict[str, Any] = {"content": self.content, "role": self.role}
        if self.tool_calls:
            out["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return out


@dataclass
class AG2Choice:
    message: AG2Message
    finish_reason: str
    index: int = 0


@dataclass
class AG2Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class AG2Response:
    """``ModelClientResponseProtocol``: ``choices``, ``model``; plus usage, cost and ``kvcomm``
    (where the prompt's KV came from)."""

    id: str
    model: str
    choices: list[AG2Choice]
    usage: AG2Usage
    kvcomm: ChatCall
    cost: float = 0.0
    created: int = field(default_factory=lambda: int(time.time()))


class KvcommAG2Client:
    """config: the config-list entry AG2 passes in. backend: the shared ``ChatBackend`` or
    ``RemoteChatBackend`` (default: a new one, remote when ``config["base_url"]`` is set,
    else on the embedded model; reuse on unless ``config["kvcomm_reuse"]`` is False).
    agent_name: the agent this client serves (``ChatCall.agent``), e.g.
    ``agent.register_model_client(KvcommAG2Client, backend=backend, agent_name=agent.name)``;
    None: the author of the conversation's last assistant message, if named."""

    def __init__(self, config: dict[str, Any], backend: ChatBackend | None = None, agent_name: str | None = None, **_: Any):
        self.config = dict(config)
        self.agent_name = agent_name
        reuse = bool(self.config.get("kvcomm_reuse", True))
        if backend is None and self.config.get("base_url"):
            from kvcomm.integrations.remote.backend import RemoteChatBackend

            backend = RemoteChatBackend(
                str(self.config["base_url"]), reuse=reuse, api_key=self.config.get("api_key"),
                tenant=str(self.config.get("kvcomm_tenant", "default")), tokenizer=self.config.get("kvcomm_tokenizer"),
                session=self.config.get("kvcomm_session"),
            )
        if backend is None:
            backend = ChatBackend.embedded(reuse=reuse)
        self.backend = backend
        self.model = str(self.config.get("model") or backend.model_name)

    def create(self, params: dict[str, Any]) -> AG2Response:
        if params.get("stream"):
            raise ValueError("streaming is not supported by the kvcomm AG2 client; set stream to False")
        messages = params.get("messages")
        if not messages:
            raise ValueError("the kvcomm AG2 client needs params['messages'] (a non-empty list of message dicts)")
        tools = params.get("tools") or None
        if params.get("functions"):
            raise ValueError("legacy `functions` are not supported; register tools (`tools`) instead")
        budget = reply_budget(params, "create params")
        if budget is None:
            budget = reply_budget(self.config, "the config entry")
        reply = self.backend.complete(
            to_turns(messages), tools=tools, max_new_tokens=budget,
            context_ids=tuple(params.get("context_ids", self.config.get("context_ids", ()))), agent=self.agent_name,
        )
        tool_calls = [
            {"id": f"call_{next(_ids)}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in reply.tool_calls
        ]
        message = AG2Message(reply.text if reply.text or not tool_calls else None, tool_calls=tool_calls or None)
        finish = "tool_calls" if tool_calls else reply.call.finish_reason
        usage = AG2Usage(reply.call.prompt_tokens, reply.call.completion_tokens)
        return AG2Response(f"kvcomm-{next(_ids)}", self.model, [AG2Choice(message, finish)], usage, reply.call)

    def retain_context(self, text: str, **options: Any):
        """Keep ``text``'s KV for messages that carry exactly this text (in process, or on the
        server for a remote backend, where ``ttl_s=`` is accepted); name the handle's
        ``context_id`` in ``params["context_ids"]`` (or the config entry's)."""
        return self.backend.retain(text, **options)

    def release_context(self, handle: Any) -> bool:
        return self.backend.release(handle)

    def message_retrieval(self, response: AG2Response) -> list[str] | list[dict[str, Any]]:
        """Text of each choice, or the message dict where it carries tool calls."""
        return [c.message.model_dump() if c.message.tool_calls else (c.message.content or "") for c in response.choices]

    def cost(self, response: AG2Response) -> float:
        return 0.0  # a local model: no per-token price

    @staticmethod
    def get_usage(response: AG2Response) -> dict[str, Any]:
        return {
            "prompt_tokens": response.usage.prompt_tokens, "completion_tokens": response.usage.completion_tokens,
            "total_tokens": response.usage.total_tokens, "cost": response.cost, "model": response.model,
        }


def to_turns(messages: list[dict[str, Any]]) -> list[ChatTurn]:
    """OpenAI-style message dicts (as AG2 sends them) -> chat turns."""
    turns = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool", "function"):
            raise ValueError(f"message {i} has role {role!r}; expected system, user, assistant or tool")
        content = message.get("content")
        if isinstance(content, list):  # multimodal parts: keep the text ones
            if any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in content):
                raise ValueError(f"message {i} has non-text content; this model reads text only")
            content = "\n".join(p["text"] if isinstance(p, dict) else str(p) for p in content)
        elif content is not None and not isinstance(content, str):
            content = json.dumps(content)
        calls = tuple(message.get("tool_calls") or ())
        turns.append(ChatTurn(
            "tool" if role == "function" else role, content or "", message.get("name"), tool_calls=calls,
            tool_call_id=message.get("tool_call_id"),
        ))
    return turns
