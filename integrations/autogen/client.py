"""An autogen-core ``ChatCompletionClient`` served by kvcomm in process (AutoGen 0.7).

Give every agent of a team the same client: they then share one executor and one reuse
engine, and each agent reuses the KV of what the others wrote from its first call on (that
call computes the agent's new system message first and serves the shared messages after it:
docs/autogen.md, warm-up; see ``local.backend``).

    client = KvcommChatCompletionClient()            # embedded SmolLM2, with reuse
    dense = KvcommChatCompletionClient(reuse=False)  # the same model, dense prefill
    remote = KvcommChatCompletionClient.remote("http://localhost:8000")  # against `kvcomm serve`
    team = RoundRobinGroupChat([AssistantAgent("a", client, ...), ...])

AutoGen's ``RequestUsage`` has no cached-token field, so reuse statistics sit next to it:
``client.last_call`` / ``client.call_log`` (``ChatCall``: exact / estimated / computed prompt
tokens, TTFT, wall time, ``reason`` in words), and ``client.summary()`` (summed TTFT and wall
time, per agent and in all; ``summary(baseline=dense)`` against another client).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncGenerator, Literal, Mapping, Optional, Sequence, Union

from autogen_core import CancellationToken, FunctionCall, Image
from autogen_core.models import (
    AssistantMessage, ChatCompletionClient, CreateResult, FunctionExecutionResultMessage, LLMMessage, ModelCapabilities,
    ModelFamily, ModelInfo, RequestUsage, SystemMessage, UserMessage,
)
from autogen_core.tools import Tool, ToolSchema
from pydantic import BaseModel

from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.handles import ContextHandle
from kvcomm.integrations.local.backend import Cancelled, ChatBackend, ChatCall, ChatReply, reply_budget
from kvcomm.integrations.local.segments import ChatTurn

if TYPE_CHECKING:
    from kvcomm.integrations.remote.backend import RemoteChatBackend

_KNOWN_ARGS = {"max_tokens", "max_new_tokens", "context_ids"}


class KvcommChatCompletionClient(ChatCompletionClient):
    """backend: a ``ChatBackend`` to share (e.g. with an AG2 client, or a reuse and a dense
    client side by side), or a ``RemoteChatBackend`` (see ``remote``); by default one is
    built on the embedded model with ``reuse`` and ``config``. max_tokens: default reply
    budget of a new backend (the same name in ``remote`` and in ``extra_create_args``).
    agent_name: the agent this client serves (``ChatCall.agent``); None: inside an AutoGen
    team, the participant that is calling (read from autogen-core's message-handler
    context), else the author of the conversation's last assistant message.

    ``extra_create_args``: ``max_tokens`` (reply budget; ``max_new_tokens`` is a deprecated
    alias), ``context_ids`` (handles this call expects to hit; reported in
    ``ChatCall.contexts``). Anything else is an error.
    """

    component_type = "model"

    def __init__(
        self, backend: "ChatBackend | RemoteChatBackend | None" = None, *, reuse: bool = True, config: ReuseConfig | None = None,
        max_tokens: int = 128, agent_name: str | None = None,
    ):
        self.backend = backend if backend is not None else ChatBackend.embedded(reuse, config, max_new_tokens=max_tokens)
        self.agent_name = agent_name
        self._total = RequestUsage(0, 0)
        self._actual = RequestUsage(0, 0)
        self._closed = False

    @classmethod
    def remote(cls, base_url: str, *, max_tokens: int | None = None, agent_name: str | None = None, **options: Any) -> "KvcommChatCompletionClient":
        """A client of ``kvcomm serve`` at ``base_url``. max_tokens: default reply budget (128;
        ``max_new_tokens`` is a deprecated alias); ``options`` go to ``RemoteChatBackend``
        (``tokenizer``, ``model``, ``reuse``, ``tenant``, ``api_key``, ``session``: the key a router
        routes the team's calls by, the same for every agent of a team; ``remote.affinity``)."""
        from kvcomm.integrations.remote.backend import RemoteChatBackend

        budget = reply_budget({"max_tokens": max_tokens, "max_new_tokens": options.pop("max_new_tokens", None)},
                              "KvcommChatCompletionClient.remote")
        if budget is not None:
            options["max_new_tokens"] = budget
        return cls(RemoteChatBackend(base_url, **options), agent_name=agent_name)

    def for_agent(self, agent_name: str) -> "KvcommChatCompletionClient":
        """A client on the same backend (one engine, one call log) whose calls are logged as
        ``agent_name``'s: give one to each agent where no team tells the agents apart."""
        return type(self)(self.backend, agent_name=agent_name)

    # -- reuse statistics and handles --------------------------------------------------------

    @property
    def call_log(self) -> list[ChatCall]:
        """A snapshot of the recent calls through this client's backend, oldest first (a
        shared backend shares its log; ``ChatBackend(max_log=...)`` bounds it)."""
        return list(self.backend.calls)

    @property
    def last_call(self) -> ChatCall | None:
        return self.backend.last

    def summary(self, baseline: Any = None) -> dict[str, Any]:
        """Tokens by source, summed TTFT and wall time, per agent and in all
        (``kvcomm.integrations.local.summary``); ``baseline``: the same team run by another
        client (e.g. ``reuse=False``), or its summary, for the ratios against it."""
        return self.backend.summary(baseline)

    def retain_context(self, text: str, **options: Any) -> ContextHandle:
        """Prefill ``text`` now and keep its KV for messages that carry exactly this text (in
        process, or on the server for a remote backend, where ``ttl_s=`` is accepted)."""
        return self.backend.retain(text, **options)

    def release_context(self, handle: ContextHandle | str) -> bool:
        return self.backend.release(handle)

    # -- ChatCompletionClient --------------------------------------------------------------

    async def create(
        self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto", json_output: Optional[bool | type[BaseModel]] = None,
        extra_create_args: Mapping[str, Any] = {}, cancellation_token: Optional[CancellationToken] = None,
    ) -> CreateResult:
        result = None
        async for item in self._run(messages, tools, tool_choice, json_output, extra_create_args, cancellation_token, None):
            result = item
        assert isinstance(result, CreateResult)
        return result

    async def create_stream(
        self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto", json_output: Optional[bool | type[BaseModel]] = None,
        extra_create_args: Mapping[str, Any] = {}, cancellation_token: Optional[CancellationToken] = None,
    ) -> AsyncGenerator[Union[str, CreateResult], None]:
        """Text chunks as tokens are decoded, then the ``CreateResult``."""
        async for item in self._run(messages, tools, tool_choice, json_output, extra_create_args, cancellation_token, asyncio.Queue()):
            yield item

    async def _run(self, messages, tools, tool_choice, json_output, extra, token, queue: asyncio.Queue | None):
        if self._closed:
            raise RuntimeError("this client is closed; create a new KvcommChatCompletionClient")
        if json_output:
            raise ValueError("json_output / structured output is not supported by the kvcomm client (greedy text only)")
        unknown = set(extra) - _KNOWN_ARGS
        if unknown:
            raise ValueError(f"unknown extra_create_args {sorted(unknown)}; supported: {sorted(_KNOWN_ARGS)}")
        turns = to_turns(messages)
        schemas = [] if tool_choice == "none" else tool_schemas(tools)
        budget = reply_budget(extra, "extra_create_args")
        agent = self.agent_name or _team_participant()
        if token is not None and token.is_cancelled():
            raise asyncio.CancelledError("cancelled before the call started")
        context_ids = tuple(extra.get("context_ids", ()))
        if getattr(self.backend, "remote", False):
            on_text = queue.put_nowait if queue is not None else None
            # a task of this loop: cancelling it closes the HTTP request, and the server aborts
            work = asyncio.ensure_future(self.backend.acomplete(
                turns, tools=schemas or None, max_new_tokens=budget, on_text=on_text, context_ids=context_ids, agent=agent,
            ))
        else:
            work = self._in_process(turns, schemas, budget, context_ids, token, queue, agent)
        if token is not None:
            token.link_future(work)  # the await ends at once; decoding stops at the next token
        if queue is not None:
            while not work.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, work}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
        try:
            reply: ChatReply = await work
        except Cancelled as error:
            raise asyncio.CancelledError(str(error)) from None
        yield self._result(reply)

    def _in_process(self, turns, schemas, budget, context_ids, token, queue: asyncio.Queue | None, agent: str | None) -> asyncio.Future:
        """The in-process backend's call in a worker thread; tokens go to ``queue`` as text."""
        loop = asyncio.get_running_loop()
        decoder = _Chunker(self.backend.executor)

        def on_token(t: int) -> bool | None:
            if queue is not None:
                chunk = decoder.push(t)
                if chunk and not loop.is_closed():
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
            return False if token is not None and token.is_cancelled() else None

        return loop.run_in_executor(
            None, lambda: self.backend.complete(
                turns, tools=schemas or None, max_new_tokens=budget, on_token=on_token, context_ids=context_ids, agent=agent,
            ),
        )

    def _result(self, reply: ChatReply) -> CreateResult:
        usage = RequestUsage(reply.call.prompt_tokens, reply.call.completion_tokens)
        self._total = RequestUsage(self._total.prompt_tokens + usage.prompt_tokens, self._total.completion_tokens + usage.completion_tokens)
        self._actual = RequestUsage(self._actual.prompt_tokens + usage.prompt_tokens, self._actual.completion_tokens + usage.completion_tokens)
        content: str | list[FunctionCall] = reply.text
        thought = None
        if reply.tool_calls:
            content = [FunctionCall(id=f"call_{len(self.call_log)}_{i}", name=c["name"], arguments=c["arguments"]) for i, c in enumerate(reply.tool_calls)]
            thought = reply.text or None
        finish = "unknown" if reply.call.finish_reason == "cancelled" else reply.call.finish_reason
        return CreateResult(finish_reason=finish, content=content, usage=usage, cached=False, thought=thought)

    async def close(self) -> None:
        self._closed = True

    def actual_usage(self) -> RequestUsage:
        return self._actual

    def total_usage(self) -> RequestUsage:
        return self._total

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        return self.backend.count_tokens(to_turns(messages), tool_schemas(tools) or None)

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        return self.backend.max_context - self.count_tokens(messages, tools=tools)

    @property
    def capabilities(self) -> ModelCapabilities:  # type: ignore[override]
        info = self.model_info
        return ModelCapabilities(vision=False, function_calling=info["function_calling"], json_output=False)  # type: ignore[typeddict-item]

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            vision=False, function_calling=self.backend.supports_tools, json_output=False, family=ModelFamily.UNKNOWN,
            structured_output=False, multiple_system_messages=True,
        )


def _team_participant() -> str | None:
    """The name of the AutoGen team participant whose message handler is running this call, or
    None outside an agent runtime. A team registers participant ``name`` as agent type
    ``f"{name}_{team_id}"`` with key ``team_id`` (autogen-agentchat 0.7); another runtime's
    agent type is returned as it is."""
    from autogen_core import MessageHandlerContext

    try:
        agent_id = MessageHandlerContext.agent_id()
    except (RuntimeError, LookupError):
        return None
    suffix = f"_{agent_id.key}"
    if agent_id.type.endswith(suffix) and len(agent_id.type) > len(suffix):
        return agent_id.type[: -len(suffix)]
    return agent_id.type


def to_turns(messages: Sequence[LLMMessage]) -> list[ChatTurn]:
    """AutoGen messages -> chat turns (a function-result message gives one "tool" turn per result)."""
    turns: list[ChatTurn] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            turns.append(ChatTurn("system", message.content))
        elif isinstance(message, UserMessage):
            turns.append(ChatTurn("user", _text(message.content), message.source))
        elif isinstance(message, AssistantMessage):
            if isinstance(message.content, str):
                turns.append(ChatTurn("assistant", message.content, message.source))
            else:
                calls = tuple(
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in message.content
                )
                turns.append(ChatTurn("assistant", message.thought or "", message.source, tool_calls=calls))
        elif isinstance(message, FunctionExecutionResultMessage):
            turns.extend(ChatTurn("tool", r.content, r.name, tool_call_id=r.call_id) for r in message.content)
        else:
            raise TypeError(f"unsupported message type {type(message).__name__}")
    return turns


def tool_schemas(tools: Sequence[Tool | ToolSchema]) -> list[dict]:
    """Tools as OpenAI-style function schemas, which chat templates take."""
    schemas = []
    for tool in tools:
        schema = tool.schema if hasattr(tool, "schema") else tool
        schemas.append({"type": "function", "function": json.loads(json.dumps(dict(schema)))})
    return schemas


def _text(content: str | list[str | Image]) -> str:
    if isinstance(content, str):
        return content
    if any(isinstance(part, Image) for part in content):
        raise ValueError("this model has no vision: remove images from the messages (model_info['vision'] is False)")
    return "\n".join(content)


class _Chunker:
    """Incremental detokenization: emits the new text once it decodes cleanly (no partial
    UTF-8 sequence at the end)."""

    def __init__(self, executor):
        self.executor = executor
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.executor.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        chunk, self.sent = text[self.sent :], len(text)
        return chunk
