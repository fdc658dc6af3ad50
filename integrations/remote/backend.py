"""The remote chat backend: the AutoGen and AG2 clients against ``kvcomm serve`` over HTTP.

Same contract as the in-process ``ChatBackend`` (``complete``, ``calls``, ``summary``,
``count_tokens``, ...), but the model, the reuse engine and the anchor pools live in the
server. The conversation is rendered here, per message, with the model's tokenizer and chat
template (``local.segments``, the in-process rendering); the request is a greedy
``/v1/completions`` call whose prompt is those token ids, with every shared message annotated
as a span in ``kv_transfer_params["kvcomm"]`` (``remote.wire``). The server plans, reuses and
learns; its response says where the prompt's KV came from, logged as a ``ChatCall``.

    backend = RemoteChatBackend("http://localhost:8000")    # checks the server's model
    client = KvcommChatCompletionClient(backend)             # or KvcommChatCompletionClient.remote(url)

At construction the backend checks that the local tokenizer is the server's: the model's
``max_model_len`` from ``/v1/models``, and the server's own tokenization (``/tokenize``) of a
probe conversation with its chat template, against the local rendering.

Context handles work as in process, through the server's context API (``serve.contexts``):
``retain(text, ttl_s=None)`` has the server keep the text's KV and returns a ``ContextHandle``
whose ``context_id`` is the server's id (``ctx-...``: any client of the same tenant may name
it, in this process or another); ``complete(..., context_ids=[...])`` marks the message that
carries each named context, and ``ChatCall.contexts`` reports "hit", "unused", "fallback"
(released, expired or restarted, or an id the server does not know for this tenant: served
from the text) or "absent" (no message carries it);
``release`` lets the server drop the KV; ``context`` reads the server's record.

Behind a router (several replicas, ``vllm-router --policy consistent_hash``): every request
carries ``X-Session-ID: session`` (``remote.affinity``; default one key per tenant), so a team's
calls land on one replica; a call whose connection failed is sent once more with the same key.
A completion naming a context the replica does not know (the team was re-homed after a replica
died) is sent again without the name and served from its text, reported "fallback".

Not here: the per-source split of a *streamed* call (vLLM streams no ``kv_transfer_params``:
a streamed call's provenance counts every prompt token as computed and its note says so, and
its contexts are "retained" or "fallback" from the response header; ``create`` has the split).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from kvcomm.integrations.local.backend import ChatCall, ChatReply, calling_agent, slot_reuse
from kvcomm.integrations.local.summary import summarize
from kvcomm.reuse.handles import ContextHandle
from kvcomm.integrations.local.segments import ChatPrompt, ChatTurn, parse_tool_calls, render_chat, supports_tools
from kvcomm.integrations.remote import affinity, wire

log = logging.getLogger(__name__)

PROBE = (
    ChatTurn("system", "You check tokenizers."),
    ChatTurn("user", "Héllo, wörld! 12345 + 0.5 = ?\n\tTabs, ünïcode ✓ and emoji 🙂.", "user"),
    ChatTurn("assistant", "Fine: 12345.5", "helper"),
)


CONTEXTS = "/v1/kvcomm/contexts"


class RemoteError(RuntimeError):
    """The server could not be reached, answered with an error, or serves another model."""


class RemoteChatBackend:
    """base_url: the server (``http://host:port``, with or without ``/v1``). tokenizer: a
    local folder or a loaded tokenizer (default: the embedded model's). model: the served
    model id (default: the server's only model). reuse: annotate requests (False: plain
    dense requests, no kvcomm options). tenant: the server's reuse engine (anchors, bases,
    exact prefixes) and ``cache_salt`` for annotated requests; a server with API keys
    decides the tenant by the key instead. max_new_tokens: default reply budget. api_key:
    sent as a bearer token. timeout: seconds per HTTP request. verify: run the tokenizer check.
    session: the key a router routes the calls by (``X-Session-ID``; ``remote.affinity``): give
    every client of a team the same one; default one per tenant (``affinity.default_session``).
    """

    remote = True

    def __init__(
        self, base_url: str, *, tokenizer: Any = None, model: str | None = None, reuse: bool = True,
        tenant: str = "default", max_new_tokens: int = 128, api_key: str | None = None, timeout: float = 600.0,
        max_log: int = 10_000, verify: bool = True, session: str | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if not tenant or len(tenant) > 100 or any(c in tenant for c in "@/\\\0"):
            raise ValueError(f"tenant must be a non-empty name of at most 100 characters without @ / \\ or NUL (got {tenant!r})")
        self.base_url = _root(base_url)
        self.reuse = reuse
        self.tenant = tenant
        self.max_new_tokens = max_new_tokens
        self.calls: deque[ChatCall] = deque(maxlen=max_log)
        self.session = affinity.check_session(affinity.default_session(tenant, api_key) if session is None else session)
        self._headers = {affinity.SESSION_HEADER: self.session}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.retries = 0
        """Calls sent a second time after a connection error (``affinity.retryable``)."""
        self._timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout)
        self._content_ids: dict[str, str] = {}  # context id -> content id (the hash of its token ids)
        self.tokenizer = _load_tokenizer(tokenizer)
        self.model_name, self.max_context = self._served_model(model)
        if verify:
            self.check_tokenizer()

    # -- the server ------------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any]:
        return _json(self._send(lambda: self._http.get(path)), path)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self._send(lambda: self._http.post(path, json=body)), path)

    def _send(self, request: Callable[[], httpx.Response]) -> httpx.Response:
        """``request()``'s response, sent once more after a connection failure (``affinity.retryable``)."""
        for attempt in (1, 2):
            try:
                response = request()
            except httpx.HTTPError as error:
                if attempt == 1 and affinity.retryable(error):
                    self._note_retry(str(error) or type(error).__name__)
                    time.sleep(affinity.RETRY_DELAY_S)
                    continue
                raise RemoteError(f"cannot reach the kvcomm server at {self.base_url} ({error}); is `kvcomm serve` running?") from error
            if attempt == 1 and affinity.retryable(status=response.status_code, body=_peek(response)):
                self._note_retry(f"HTTP {response.status_code}")
                time.sleep(affinity.RETRY_DELAY_S)
                continue
            return response
        raise AssertionError("unreachable")

    def _note_retry(self, why: str) -> None:
        self.retries += 1
        log.warning("the call to %s failed (%s); sending it once more with session key %r", self.base_url, why, self.session)

    def _served_model(self, model: str | None) -> tuple[str, int]:
        served = {m["id"]: m for m in self._get("/v1/models").get("data", [])}
        if not served:
            raise RemoteError(f"{self.base_url}/v1/models lists no model")
        if model is None:
            if len(served) > 1:
                raise RemoteError(f"the server serves {sorted(served)}; pass model= to choose one")
            model = next(iter(served))
        if model not in served:
            raise RemoteError(f"the server does not serve {model!r}; it serves {sorted(served)}")
        return model, int(served[model].get("max_model_len") or 2048)

    def check_tokenizer(self) -> None:
        """Raise ``RemoteError`` unless the server tokenizes the probe conversation (its chat
        template, its tokenizer) to exactly the ids the local rendering gives."""
        local = list(self.render(PROBE).prompt.token_ids)
        messages = [{"role": t.role, "content": t.content} for t in PROBE]
        response = self._send(lambda: self._http.post("/tokenize", json={
            "model": self.model_name, "messages": messages, "add_generation_prompt": True, "add_special_tokens": False}))
        if response.status_code == 401 and "Authorization" in self._headers:
            # vllm-router (0.1.17) forwards /tokenize without the caller's key; its chat route
            # forwards it, and a one-token chat completion reports its prompt's token ids.
            answer = self._post("/v1/chat/completions", {"model": self.model_name, "messages": messages, "max_tokens": 1,
                                                         "temperature": 0.0, "return_token_ids": True})
            remote = answer.get("prompt_token_ids")
        else:
            remote = _json(response, "/tokenize").get("tokens")
        if remote != local:
            first = next((i for i, (a, b) in enumerate(zip(local, remote or [])) if a != b), min(len(local), len(remote or [])))
            raise RemoteError(
                f"the local tokenizer does not match the server's model {self.model_name!r}: the probe conversation "
                f"tokenizes to {len(local)} ids here and {len(remote or [])} on the server (first difference at {first}); "
                "pass tokenizer= the served model's folder"
            )

    def close(self) -> None:
        self._http.close()

    # -- prompts ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def supports_tools(self) -> bool:
        return supports_tools(self.tokenizer)

    @property
    def last(self) -> ChatCall | None:
        return self.calls[-1] if self.calls else None

    def render(self, turns: Sequence[ChatTurn], tools: Sequence[dict] | None = None) -> ChatPrompt:
        return render_chat(self.tokenizer, self.encode, turns, tools)

    def count_tokens(self, turns: Sequence[ChatTurn], tools: Sequence[dict] | None = None) -> int:
        return len(self.render(turns, tools).prompt)

    def retain(self, text: str | ChatReply, ttl_s: float | None = None) -> ContextHandle:
        """Have the server keep ``text``'s KV (as a message's content) until ``release`` or
        ``ttl_s`` seconds; ``RemoteError`` when the server refuses it (over the tenant's byte cap).
        A ``ChatReply`` is retained by its token ids (a finished request's reply: under
        ``--reuse-scope all`` the server already holds its KV and only pins it)."""
        if isinstance(text, ChatReply):
            body: dict[str, Any] = {"token_ids": list(text.reply_ids), "tenant": self.tenant}
        elif not self.encode(text):
            raise ValueError("cannot retain empty text: it has no tokens")
        else:
            body = {"text": text, "tenant": self.tenant}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        record = self._post(CONTEXTS, body)
        self._content_ids[record["id"]] = record["content_id"]
        return ContextHandle(record["id"], int(record["tokens"]))

    def release(self, handle: ContextHandle | str) -> bool:
        """Let the server drop the context's KV; False (nothing changed) for an id this tenant
        does not have, or one already evicted."""
        context_id = handle.context_id if isinstance(handle, ContextHandle) else str(handle)
        response = self._send(lambda: self._http.post(f"{CONTEXTS}/{context_id}/release", json={"tenant": self.tenant}))
        if response.status_code == 404:
            return False
        return bool(_json(response, f"{CONTEXTS}/{context_id}/release").get("released"))

    def context(self, handle: ContextHandle | str) -> dict[str, Any]:
        """The server's record of a context (id, tokens, bytes, state, expires_at, ...)."""
        context_id = handle.context_id if isinstance(handle, ContextHandle) else str(handle)
        return self._get(f"{CONTEXTS}/{context_id}?tenant={self.tenant}")

    def _named(self, chat: ChatPrompt, context_ids: Sequence[str]) -> dict[str, str]:
        """content id -> context id for the named contexts whose content a message of ``chat`` carries."""
        present = set(chat.shared_ids)
        named = {}
        for context_id in context_ids:
            if context_id not in self._content_ids:
                response = self._send(lambda: self._http.get(f"{CONTEXTS}/{context_id}", params={"tenant": self.tenant}))
                if response.status_code == 404:
                    # a server restarted without --state-dir, or another tenant's id: the text is sent anyway
                    log.warning("the server has no context %r for this tenant; the call is served from the text", context_id)
                    continue
                self._content_ids[context_id] = _json(response, CONTEXTS)["content_id"]
            if self._content_ids[context_id] in present:
                named.setdefault(self._content_ids[context_id], context_id)
        return named

    # -- completion ------------------------------------------------------------------------

    def _prepare(self, turns, tools, max_new_tokens, context_ids, stream: bool) -> tuple[ChatPrompt, dict[str, Any], int]:
        """The rendered chat, the request body and the reply budget. An annotated, unstreamed
        request asks the server for one token more than the budget and the reply is cut back
        to it (``_finish``): the server computes the KV of every token it feeds back, which is
        all but the last it samples, so a reply cut by the budget keeps its KV as a base, as in
        process (where the executor feeds the last token back itself)."""
        budget = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if budget < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {budget})")
        chat = self.render(turns, tools)
        if len(chat.prompt) + budget > self.max_context:
            raise ValueError(
                f"prompt of {len(chat.prompt)} tokens + {budget} new tokens exceeds the server's max_model_len of "
                f"{self.max_context}; shorten the conversation (e.g. a BufferedChatCompletionContext) or max_tokens"
            )
        ask = budget + 1 if self.reuse and not stream and len(chat.prompt) + budget + 1 <= self.max_context else budget
        named = self._named(chat, context_ids) if context_ids else {}
        body = wire.completion_body(self.model_name, chat, ask, reuse=self.reuse, tenant=self.tenant, stream=stream,
                                    contexts=named)
        return chat, body, budget

    def complete(
        self, turns: Sequence[ChatTurn], *, tools: Sequence[dict] | None = None, max_new_tokens: int | None = None,
        on_token: Any = None, context_ids: Sequence[str] = (), agent: str | None = None,
    ) -> ChatReply:
        """One greedy completion of ``turns`` (blocking; ``acomplete`` streams and cancels).
        agent: the calling agent's name (``ChatCall.agent``)."""
        if on_token is not None:
            raise ValueError("token callbacks need the async path: use acomplete(on_text=...) on a remote backend")
        started = time.perf_counter()
        chat, body, budget = self._prepare(turns, tools, max_new_tokens, context_ids, stream=False)
        response = self._send(lambda: self._http.post("/v1/completions", json=body))
        if response.status_code == 404 and _named_contexts(body):
            body = self._forget_contexts(body, response)
            response = self._send(lambda: self._http.post("/v1/completions", json=body))
        data = _json(response, "/v1/completions")
        ttft = wire.end_to_end_ttft(data, time.perf_counter() - started)
        return self._finish(turns, chat, tools, started, data, budget, ttft, agent=agent, context_ids=context_ids)

    async def acomplete(
        self, turns: Sequence[ChatTurn], *, tools: Sequence[dict] | None = None, max_new_tokens: int | None = None,
        on_text: Callable[[str], None] | None = None, context_ids: Sequence[str] = (), agent: str | None = None,
    ) -> ChatReply:
        """One greedy completion; with ``on_text`` the server streams and each text delta is
        passed on as it arrives. Cancelling the awaiting task closes the HTTP connection,
        which makes vLLM abort the request; the call is logged as "cancelled"."""
        started = time.perf_counter()
        chat, body, budget = self._prepare(turns, tools, max_new_tokens, context_ids, stream=on_text is not None)
        streamed = wire.StreamedCompletion()
        try:
            async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
                if on_text is None:
                    response = await self._asend(lambda: http.post("/v1/completions", json=body))
                    if response.status_code == 404 and _named_contexts(body):
                        body = self._forget_contexts(body, response)
                        response = await self._asend(lambda: http.post("/v1/completions", json=body))
                    data = _json(response, "/v1/completions")
                    ttft = wire.end_to_end_ttft(data, time.perf_counter() - started)
                else:
                    for attempt in (1, 2, 3):
                        try:
                            await self._stream(http, body, streamed, on_text)
                            break
                        except _UnknownContext as unknown:
                            body = self._forget_contexts(body, unknown.response)
                        except _StreamNotStarted as failed:
                            if attempt > 1 or not failed.retry:
                                raise RemoteError(f"the stream from {self.base_url} broke ({failed.why})") from failed.__cause__
                            self._note_retry(failed.why)
                            await asyncio.sleep(affinity.RETRY_DELAY_S)
                    data = streamed.response()
                    ttft = None if streamed.first_token_at is None else streamed.first_token_at - started
        except asyncio.CancelledError:
            self._log_cancelled(turns, chat, started, streamed, agent)
            raise
        return self._finish(turns, chat, tools, started, data, budget, ttft, agent=agent, context_ids=context_ids,
                            why_unknown="streamed: vLLM streams no kv_transfer_params (use create for the split)" if on_text else "")

    async def _asend(self, request: Callable[[], Any]) -> httpx.Response:
        """As ``_send``, for ``await request()``."""
        for attempt in (1, 2):
            try:
                response = await request()
            except httpx.HTTPError as error:
                if attempt == 1 and affinity.retryable(error):
                    self._note_retry(str(error) or type(error).__name__)
                    await asyncio.sleep(affinity.RETRY_DELAY_S)
                    continue
                raise RemoteError(f"cannot reach the kvcomm server at {self.base_url} ({error}); is `kvcomm serve` running?") from error
            if attempt == 1 and affinity.retryable(status=response.status_code, body=_peek(response)):
                self._note_retry(f"HTTP {response.status_code}")
                await asyncio.sleep(affinity.RETRY_DELAY_S)
                continue
            return response
        raise AssertionError("unreachable")

    async def _stream(self, http: httpx.AsyncClient, body: dict, streamed: wire.StreamedCompletion, on_text: Callable[[str], None]) -> None:
        """Stream one completion into ``streamed``. Before its first chunk, a connection error or a
        gateway's 502-504 raises ``_StreamNotStarted`` (the caller sends it once more) and a 404
        for a named context ``_UnknownContext``; once text was passed on, a break is a ``RemoteError``."""
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                streamed.contexts = _header_contexts(response.headers.get("x-kvcomm-contexts"))
                if response.status_code != 200:
                    await response.aread()
                    if response.status_code == 404 and _named_contexts(body):
                        raise _UnknownContext(response)
                    if affinity.retryable(status=response.status_code, body=response.text):
                        raise _StreamNotStarted(f"HTTP {response.status_code}", retry=True)
                    _json(response, "/v1/completions")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RemoteError(f"the server failed the streamed completion: {chunk['error']}")
                    text = streamed.add(chunk)
                    if text:
                        on_text(text)
        except httpx.HTTPError as error:
            if not streamed.text:
                raise _StreamNotStarted(str(error) or type(error).__name__, retry=affinity.retryable(error)) from error
            raise RemoteError(f"the stream from {self.base_url} broke ({error})") from error

    def _forget_contexts(self, body: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
        """``body`` without its context names, after the server answered 404 for one: the replica
        does not know it (another replica holds it: the team was re-homed after a failure, or a
        server restarted without ``--state-dir``). The call is served from the text it carries
        and its contexts are reported "fallback"."""
        named = _named_contexts(body)
        log.warning("the server does not know context(s) %s for this tenant (%s); the call is served from the text",
                    ", ".join(sorted(named)), response.text[:200])
        for context_id in named:
            self._content_ids.pop(context_id, None)
        segments = [{k: v for k, v in span.items() if k != "context"} for span in body["kv_transfer_params"]["kvcomm"]["segments"]]
        return {**body, "kv_transfer_params": {"kvcomm": {**body["kv_transfer_params"]["kvcomm"], "segments": segments}}}

    def _finish(
        self, turns, chat: ChatPrompt, tools, started: float, data: dict[str, Any], budget: int, ttft_s: float | None, *,
        agent: str | None = None, why_unknown: str = "", context_ids: Sequence[str] = (),
    ) -> ChatReply:
        """The call's ``ChatCall`` and reply from the server's response. ttft_s: the call's
        end-to-end TTFT, from ``started`` (``wire.end_to_end_ttft``, or a stream's first token)."""
        choice = (data.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            raise RemoteError(f"the server's completion has no choices: {str(data)[:300]}")
        usage = data.get("usage") or {}
        summary = wire.kvcomm_summary(data)
        if summary is not None and "error" in summary:
            log.warning("kvcomm serve rejected this request's kvcomm options: %s", summary["error"])
        provenance = wire.provenance(
            chat, int(usage.get("prompt_tokens", len(chat.prompt))), summary, self.reuse,
            cached_tokens=wire.cached_tokens(usage), ttft_s=ttft_s, why_unknown=why_unknown,
        )
        reply_ids = list(choice.get("token_ids") or [])
        stopped = choice.get("finish_reason") == "stop"
        if reply_ids and stopped and reply_ids[-1] in self.tokenizer.all_special_ids:
            reply_ids.pop()
        text = str(choice.get("text") or "")
        # The server feeds back every token but the last it samples: a stop token, or the one
        # token asked beyond the budget (``_prepare``), cut here. Either way the KV of every
        # kept token exists, and the server keeps it as the reply's base.
        fed = stopped
        if len(reply_ids) > budget:
            reply_ids, fed = reply_ids[:budget], True
            text = self.decode(reply_ids)
        completion_tokens = min(int(usage.get("completion_tokens", len(reply_ids))), budget)
        tool_calls, text_out = parse_tool_calls(text) if tools else ([], text)
        reason = str(choice.get("finish_reason") or "stop")
        if len(reply_ids) >= budget:
            reason = "length"  # as in process: the budget was reached
        if tool_calls:
            reason = "function_calls"
        # The server keeps the reply's decode KV as its base when its plan says so (reply_base:
        # the scope and an unestimated prompt, as in process); a reader reuses it when the text
        # re-tokenizes to the same ids.
        registered = bool(self.reuse and summary and "error" not in summary and summary.get("reply_base") is True
                          and fed and reply_ids and self.encode(self.decode(reply_ids)) == reply_ids)
        call = ChatCall(
            chat.prompt.template_id, calling_agent(turns, agent), provenance, completion_tokens, reason, registered,
            time.perf_counter() - started, self._context_report(chat, context_ids, summary, data.get("contexts")),
            chat.note, slot_reuse(chat, provenance),
        )
        self.calls.append(call)
        return ChatReply(text_out, tuple(reply_ids), call, tool_calls)

    def _context_report(self, chat: ChatPrompt, context_ids: Sequence[str], summary: dict | None,
                        streamed: dict[str, str] | None) -> dict[str, str]:
        """``ChatCall.contexts``: the server's outcome per named context ("hit", "unused",
        "fallback"; a streamed call: "retained" or "fallback"), "absent" where no message carries it."""
        present = set(chat.shared_ids)
        served = (summary or {}).get("contexts") or {}
        report = {}
        for context_id in context_ids:
            if context_id not in self._content_ids:
                report[context_id] = "fallback"  # unknown to the server (``_named``)
            elif self._content_ids[context_id] not in present:
                report[context_id] = "absent"
            elif context_id in served:
                report[context_id] = served[context_id]["outcome"]
            elif streamed and context_id in streamed:
                report[context_id] = "retained" if streamed[context_id] == "live" else "fallback"
            else:
                report[context_id] = "fallback"  # the server did not plan it (dense client, rejected options)
        return report

    def _log_cancelled(self, turns, chat: ChatPrompt, started: float, streamed: wire.StreamedCompletion, agent: str | None) -> None:
        provenance = wire.provenance(chat, len(chat.prompt), None, self.reuse, why_unknown="cancelled: the server aborted the request")
        self.calls.append(ChatCall(
            chat.prompt.template_id, calling_agent(turns, agent), provenance, len(streamed.token_ids), "cancelled", False,
            time.perf_counter() - started, {}, chat.note, slot_reuse(chat, provenance),
        ))

    def summary(self, baseline: Any = None) -> dict[str, Any]:
        """As ``ChatBackend.summary`` (``local.summary.summarize``)."""
        return summarize(list(self.calls), baseline)


class _UnknownContext(Exception):
    """A streamed completion answered 404 for a context it names."""

    def __init__(self, response: httpx.Response):
        super().__init__(response.text[:200])
        self.response = response


class _StreamNotStarted(Exception):
    """A streamed completion failed before its first chunk; ``retry``: the failure is a connection error."""

    def __init__(self, why: str, retry: bool):
        super().__init__(why)
        self.why, self.retry = why, retry


def _peek(response: httpx.Response) -> str:
    """The start of an error response's body ("" for a 200 or a streamed body not read)."""
    if response.status_code == 200:
        return ""
    try:
        return response.text[:500]
    except httpx.ResponseNotRead:
        return ""


def _named_contexts(body: dict[str, Any]) -> list[str]:
    """The context ids a completion body names on its segments."""
    params = (body.get("kv_transfer_params") or {}).get("kvcomm") or {}
    return [span["context"] for span in params.get("segments") or [] if span.get("context")]


def _header_contexts(value: str | None) -> dict[str, str] | None:
    try:
        parsed = json.loads(value) if value else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https:// (got {base_url!r}), e.g. http://localhost:8000")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _json(response: httpx.Response, path: str) -> dict[str, Any]:
    if response.status_code == 401:
        behind = (" (behind vllm-router 0.1.17 the context API gets no key: its proxy forwards no Authorization header "
                  "there; see docs/serving.md, replicas)") if path.startswith(CONTEXTS) else ""
        raise RemoteError(f"{path} answered HTTP 401 (unauthorized): pass api_key= one of the server's --api-key keys{behind}")
    if response.status_code != 200:
        raise RemoteError(f"{path} answered HTTP {response.status_code}: {response.text[:500]}")
    try:
        return response.json()
    except ValueError as error:
        raise RemoteError(f"{path} answered something that is not JSON: {response.text[:200]!r}") from error


def _load_tokenizer(tokenizer: Any):
    """A loaded tokenizer as is; a folder (or None: the embedded model's) loaded offline."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None if tokenizer is None else str(tokenizer))), local_files_only=True)
