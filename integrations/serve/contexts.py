"""The context API of ``kvcomm serve``: retained contexts (context handles) over HTTP.

Routes (JSON; tenant-scoped like every route: with API keys the tenant is the key's, without
them the ``tenant`` field of the body, or ``?tenant=`` on a GET, default ``"default"``, the
same partition a request's ``kv_transfer_params.kvcomm.tenant`` names):

- ``POST /v1/kvcomm/contexts`` ``{"text": str}`` or ``{"token_ids": [int, ...]}`` (e.g. a finished
  request's reply, whose decode KV the server keeps as its base under ``--reuse-scope all``),
  optional ``"ttl_s"`` (seconds): creates a retained context; the server computes its KV now
  (a one-token request of the context alone) unless it holds its base already.
  Answers its record (below); 409 when retaining it would go over a byte cap.
- ``GET /v1/kvcomm/contexts`` (the tenant's records), ``GET /v1/kvcomm/contexts/{id}``.
- ``POST /v1/kvcomm/contexts/{id}/retain`` optional ``{"ttl_s": s}``: retain again (an evicted
  context's KV is computed again) or set a new TTL (absent: none).
- ``POST /v1/kvcomm/contexts/{id}/release``: the KV is no longer kept; the engine drops its
  base unless an anchor of that content (or another retained context of it) holds it. The
  record comes back with ``"released"``: whether it was retained until now.

A record: ``id``, ``model``, ``model_fingerprint`` (sha256 of the served model's config.json
and dtype), ``adapter`` (always null: kvcomm keeps no KV under a LoRA adapter), ``tokens``,
``bytes`` (KV bytes of the tokens: layers x KV heads x head dim x 2 x dtype bytes), ``state``
(``retained`` / ``evicted``), ``evicted_reason``, ``expires_at`` (Unix seconds or null),
``uses`` (hit / unused / fallback counts). Another tenant's id is answered 404, never 403.

Naming a context in a request: a ``/v1/completions`` request whose prompt is token ids may
add ``"context": "<id>"`` to a segment of ``kv_transfer_params.kvcomm.segments`` whose span
holds the context's tokens (the text is always sent too). The server reuses its KV by content
like any shared segment. The response's ``kv_transfer_params.kvcomm.contexts`` (and, streamed
or not, the ``x-kvcomm-contexts`` header) says per id: ``hit`` (retained, and some of its
tokens were served from stored KV), ``unused`` (retained, the plan stopped before it),
``fallback`` (its KV was released, expired, not kept after a restart, or the request is for
another model: served from the text it carries). ``kvcomm_context_uses_total{outcome}``
counts them; ``kvcomm_context_retains_total{outcome="retained"|"refused"}`` and
``kvcomm_context_evictions_total{reason}`` count the rest.

Memory: the retained contexts' bytes count against ``--max-tenant-bytes`` (and all tenants'
against ``--max-total-bytes``); a retain over a cap is refused and changes nothing
(``kvcomm.services.contexts``). The worker never evicts a retained context's base, and drops it
when it is released or expires (TTLs are checked on every context-related request and by a
timer). With ``--state-dir`` the records survive a restart as ``evicted`` (reason
``"restart"``): requests naming them fall back to their text until they are retained again.

The server pins and drops KV through the engine itself: internal ``/v1/completions`` requests
of one generated token carrying ``kv_transfer_params.kvcomm.contexts`` (a key clients may not
send). Those run as the caller (its bearer key, kept in memory only for TTL expiry).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import Counter
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcomm.core.segments import content_id
from kvcomm.integrations.serve.internal import call_app, kvcomm_error
from kvcomm.integrations.serve.salts import salt_of
from kvcomm.integrations.vllm.wire.params import SERVER_KEY
from kvcomm.services.contexts import EVICTED, Context, ContextError, ContextStore, NotFound

PREFIX = "/v1/kvcomm/contexts"
CONFIG_ENV = "KVCOMM_CONTEXTS_CONFIG"
"""JSON set by ``kvcomm serve``: ``max_tenant_bytes``, ``max_total_bytes``, ``state_dir``, ``dtype``."""
HEADER = "x-kvcomm-contexts"
SLOT = "context"
MAX_TTL_S = 366 * 86400
MAX_TEXT = 1 << 20
"""Characters of a context's text at most (the model's context length bounds its tokens anyway)."""
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}



def _counter(name: str, documentation: str, label: str, values_: tuple[str, ...]) -> Counter:
    """A counter with every label value created now. Under `kvcomm serve` its values live in
    Prometheus's multiprocess folder (``serve.command`` makes that the default value class of
    this process before vLLM starts); a second value class of its own would open this process's
    counter file a second time, and the two writers corrupt it (``/metrics`` then fails)."""
    counter = Counter(name, documentation, [label])
    for value in values_:
        counter.labels(value)
    return counter


_COUNTERS: dict[str, Counter] = {}


def counter(name: str) -> Counter:
    """``"uses"``, ``"retains"`` or ``"evictions"``, created on first use: in the API server,
    after vLLM set up its multiprocess folder (`kvcomm serve` imports this module before)."""
    if not _COUNTERS:
        _COUNTERS.update(
            uses=_counter("kvcomm_context_uses", "Requests naming a retained context, by outcome", "outcome",
                          ("hit", "unused", "fallback")),
            retains=_counter("kvcomm_context_retains", "Context retains, by outcome", "outcome", ("retained", "refused")),
            evictions=_counter("kvcomm_context_evictions", "Contexts whose KV stopped being kept, by reason", "reason",
                               ("released", "expired", "engine")))
    return _COUNTERS[name]


class BadRequest(ContextError):
    status = 400


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ContextCapExceeded"}.get(status, "ServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class ContextRoutes:
    """The routes above and the annotation of requests naming contexts, for the ASGI ``app``
    the tenant middleware wraps (internal requests go to ``app`` directly)."""

    def __init__(self, app: ASGIApp, config: dict | None = None):
        config = json.loads(os.environ.get(CONFIG_ENV, "{}")) if config is None else config
        self.app = app
        state_dir = config.get("state_dir")
        self.store = ContextStore(config.get("max_tenant_bytes"), config.get("max_total_bytes"),
                                  Path(state_dir) / "contexts" if state_dir else None,
                                  legacy=Path(state_dir) / "contexts.json" if state_dir else None)
        self.dtype = str(config.get("dtype") or "float32")
        self._model: dict | None = None
        self._auth: dict[str, list] = {}  # tenant -> its bearer header, for TTL expiry's internal requests
        self._template: Scope | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    @staticmethod
    def owns(path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    # -- routes ----------------------------------------------------------------------------

    async def handle(self, scope: Scope, receive: Receive, send: Send, tenant: str | None, body: Any) -> None:
        """Answer one context route. ``tenant``: the API key's tenant (None: keyless, read from
        the request); ``body``: the parsed JSON body of a POST (None otherwise)."""
        try:
            response = await self._route(scope, tenant, body)
        except ContextError as error:
            response = _error(error.status, str(error))
        await response(scope, receive, send)

    async def _route(self, scope: Scope, tenant: str | None, body: Any) -> JSONResponse:
        method, path = scope.get("method", "GET"), scope["path"].removeprefix(scope.get("root_path", ""))
        if method == "POST" and not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        tenant = tenant or _keyless_tenant(scope, body)
        self._remember(scope, tenant)
        await self._expire()
        parts = path[len(PREFIX):].strip("/").split("/") if path != PREFIX else []
        if not parts:
            if method == "GET":
                return JSONResponse({"object": "list", "data": [c.record() for c in self.store.list(tenant)]})
            if method == "POST":
                return JSONResponse((await self._create(scope, tenant, body)).record())
        elif len(parts) == 1 and method == "GET":
            return JSONResponse(self.store.get(tenant, parts[0]).record())
        elif len(parts) == 2 and method == "POST" and parts[1] in ("retain", "release"):
            self.store.get(tenant, parts[0])  # 404 before anything else
            if parts[1] == "retain":
                context, was_evicted = self._counted_retain(lambda: self.store.retain(tenant, parts[0], _ttl(body)))
                if was_evicted:
                    await self._pin(scope, context)
                self._schedule()
                return JSONResponse(context.record())
            context, released, drop = self.store.evict(tenant, parts[0], "released")
            if released:
                counter("evictions").labels("released").inc()
            if drop:
                await self._unpin(context)
            return JSONResponse({**context.record(), "released": released})
        raise NotFound(f"no route {method} {path}; see `kvcomm serve`'s context API in docs/serving.md")

    async def _create(self, scope: Scope, tenant: str, body: dict) -> Context:
        unknown = set(body) - {"text", "token_ids", "ttl_s", "model", "tenant"}
        if unknown:
            raise BadRequest(f"unknown fields {sorted(unknown)}; give text or token_ids, and optionally ttl_s")
        model = await self._served(scope)
        if body.get("model", model["id"]) != model["id"]:
            raise BadRequest(f"contexts are of the base model {model['id']!r} only: kvcomm keeps no KV under a LoRA "
                             "adapter or for another model")
        ttl = _ttl(body)
        if ("text" in body) == ("token_ids" in body):
            raise BadRequest("give exactly one of text (a string) or token_ids (a list of token ids)")
        if "text" in body:
            text = body["text"]
            if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
                raise BadRequest(f"text must be a non-empty string of at most {MAX_TEXT} characters")
            status, answer = await self._internal(scope, "POST", "/tokenize",
                                                  {"model": model["id"], "prompt": text, "add_special_tokens": False})
            if status != 200:
                raise BadRequest(f"the server could not tokenize the text: {str(answer)[:300]}")
            tokens = answer["tokens"]
        else:
            tokens = body["token_ids"]
            vocab = model["vocab_size"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                       for t in tokens):
                raise BadRequest(f"token_ids must be a list of token ids of the served model (integers 0 to {vocab - 1})")
        if not 0 < len(tokens) < model["max_model_len"]:
            raise BadRequest(f"a context has 1 to {model['max_model_len'] - 1} tokens (the served max_model_len less "
                             f"one); this one has {len(tokens)}")
        context = self._counted_retain(lambda: self.store.create(
            tenant, tuple(tokens), content_id(tokens), model=model["id"], fingerprint=model["fingerprint"], adapter=None,
            nbytes=len(tokens) * model["bytes_per_token"], ttl_s=ttl))
        await self._pin(scope, context)
        self._schedule()
        return context

    @staticmethod
    def _counted_retain(retain):
        try:
            result = retain()
        except ContextError:
            counter("retains").labels("refused").inc()
            raise
        counter("retains").labels("retained").inc()
        return result

    # -- requests naming contexts ----------------------------------------------------------

    async def annotate(self, scope: Scope, body: dict) -> list[tuple[Context, int, int, str]]:
        """For a generation request (already rewritten by the middleware): check and strip every
        ``segments[i].context``; returns (context, start, end, "live" or a fallback reason) per
        named context. Raises ``ContextError`` (404 for an id the tenant does not have)."""
        params = body.get("kv_transfer_params")
        options = params.get("kvcomm") if isinstance(params, dict) else None
        if not isinstance(options, dict):
            return []
        segments = options.get("segments")
        named = [s for s in segments if isinstance(s, dict) and "context" in s] if isinstance(segments, list) else []
        if not named:
            return []
        tenant = options.get("tenant", "default")
        self._remember(scope, tenant if isinstance(tenant, str) else None)
        await self._expire()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise BadRequest("a request naming a context needs a prompt of token ids (/v1/completions, as the remote "
                             "clients send), so the server can check the span holds the context's tokens")
        model = body.get("model")
        uses = []
        for segment in named:
            context = self.store.get(tenant, segment.pop("context"))
            start, end = segment.get("start"), segment.get("end")
            if not (isinstance(start, int) and isinstance(end, int) and tuple(prompt[start:end]) == context.token_ids):
                raise BadRequest(f"the segment naming context {context.id} [{start}, {end}) does not hold its "
                                 f"{len(context.token_ids)} tokens; send the context's tokens in that span")
            if context.state == EVICTED:
                why = context.reason or "evicted"
            elif model is not None and model != context.model:
                why = "another model"
            else:
                why = "live"
            uses.append((context, start, end, why))
        return uses

    def reporting(self, send: Send, uses: list[tuple[Context, int, int, str]]) -> Send:
        """``send`` that adds the named contexts' outcomes to the response (JSON body and header)
        and counts them."""
        header = json.dumps({c.id: ("live" if why == "live" else "fallback") for c, _, _, why in uses}).encode()
        held: list[Message] = []

        async def reported(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (HEADER.encode(), header)]
                content_type = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
                if message.get("status") == 200 and content_type.startswith(b"application/json"):
                    held.append({**message, "headers": headers})
                    return
                for context, _, _, why in uses:
                    if why != "live":
                        self._count(context, "fallback")
                await send({**message, "headers": headers})
                return
            if not held or message["type"] != "http.response.body":
                await send(message)
                return
            held.append(message)
            if message.get("more_body", False):
                return
            raw = b"".join(m.get("body", b"") for m in held[1:])
            raw = self._report(raw, uses)
            start = held[0]
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
            await send({"type": "http.response.body", "body": raw, "more_body": False})

        return reported

    def _report(self, raw: bytes, uses: list[tuple[Context, int, int, str]]) -> bytes:
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        summary = params.get("kvcomm") if isinstance(params, dict) else None
        if not isinstance(summary, dict):
            data.setdefault("kv_transfer_params", {})
            if not isinstance(data["kv_transfer_params"], dict):
                return raw
            summary = data["kv_transfer_params"].setdefault("kvcomm", {})
        reuse_end = int(summary.get("exact_tokens", 0)) + int(summary.get("estimated_tokens", 0))
        report = {}
        for context, start, end, why in uses:
            if why != "live":
                outcome = "fallback"
            else:
                outcome = "hit" if start < reuse_end else "unused"
            self._count(context, outcome)
            report[context.id] = {"outcome": outcome, "state": context.state,
                                  "reason": None if why == "live" else why,
                                  "reused_tokens": max(0, min(reuse_end, end) - start)}
        summary["contexts"] = report
        return json.dumps(data).encode()

    def _count(self, context: Context, outcome: str) -> None:
        counter("uses").labels(outcome).inc()
        self.store.count(context, outcome)

    # -- the engine ------------------------------------------------------------------------

    async def _pin(self, scope: Scope | None, context: Context) -> None:
        """Have the tenant's engine keep the context's base (computing it now if new). If the
        engine cannot, the context is evicted with the reason (requests fall back to text)."""
        tokens = list(context.token_ids)
        status, answer = await self._engine(scope, context, tokens, [{"start": 0, "end": len(tokens), "slot": SLOT}],
                                            {"retain": [context.content_id]})
        error = kvcomm_error(answer)
        if status != 200 or error:
            self.store.evict(context.tenant, context.id, f"the engine could not keep its KV: {error or str(answer)[:300]}")
            counter("evictions").labels("engine").inc()

    async def _unpin(self, context: Context) -> None:
        await self._engine(None, context, list(context.token_ids[:1]), [], {"release": [context.content_id]})

    async def _engine(self, scope, context: Context, prompt: list[int], segments: list, directive: dict):
        """One engine request of the context API; ``directive``: ``{"retain": [id]}`` or ``{"release": [id]}``."""
        body = {"model": context.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "cache_salt": salt_of(context.tenant, True),
                "kv_transfer_params": {"kvcomm": {"tenant": context.tenant, "template": "kvcomm.context",
                                                  "segments": segments}, SERVER_KEY: directive}}
        return await self._internal(scope, "POST", "/v1/completions", body, self._auth.get(context.tenant, []))

    async def _served(self, scope: Scope) -> dict:
        """The served model: id, max_model_len, fingerprint, KV bytes per token."""
        if self._model is None:
            status, models = await self._internal(scope, "GET", "/v1/models", None)
            if status != 200:
                raise ContextError(f"the server could not list its model: {str(models)[:300]}")
            entry = next(m for m in models["data"] if not m.get("parent"))
            raw = (Path(entry["root"]) / "config.json").read_bytes()
            config = json.loads(raw)
            config = config.get("text_config", config)
            heads = config.get("num_key_value_heads") or config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            dtype = self.dtype if self.dtype != "auto" else str(config.get("torch_dtype", "float32"))
            per_token = config["num_hidden_layers"] * heads * head_dim * 2 * _DTYPE_BYTES.get(dtype, 4)
            self._model = {"id": entry["id"], "max_model_len": int(entry.get("max_model_len") or 2048),
                           "fingerprint": "sha256:" + hashlib.sha256(raw + dtype.encode()).hexdigest(),
                           "bytes_per_token": per_token, "vocab_size": int(config.get("vocab_size") or 1 << 31)}
        return self._model

    async def _internal(self, scope: Scope | None, method: str, path: str, body: dict | None,
                        auth: list | None = None) -> tuple[int, Any]:
        """One request to the served app itself (not through the middleware); (status, JSON)."""
        if auth is None and scope is None:
            auth = []  # a timer's request: no caller's key
        return await call_app(self.app, scope or self._template, method, path, body, auth)

    # -- TTL -------------------------------------------------------------------------------

    async def _expire(self) -> None:
        for context, _, drop in self.store.expire():
            counter("evictions").labels("expired").inc()
            if drop:
                await self._unpin(context)

    def _schedule(self) -> None:
        """A timer at the next expiry, so TTLs free memory without further requests."""
        due = self.store.next_expiry()
        if due is None:
            return
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, due - self.store.clock()) + 0.05
        self._timer = loop.call_later(delay, lambda: self._tasks.add(loop.create_task(self._timed())))

    async def _timed(self) -> None:
        self._timer = None
        self._tasks = {t for t in self._tasks if not t.done()}  # the event loop keeps only weak references
        await self._expire()
        self._schedule()

    def _remember(self, scope: Scope, tenant: str | None) -> None:
        if self._template is None:
            self._template = {k: v for k, v in scope.items() if k not in ("headers", "state")}
        auth = [(k, v) for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        if tenant is not None and auth:
            self._auth[tenant] = auth


def _ttl(body: Any) -> float | None:
    ttl = body.get("ttl_s") if isinstance(body, dict) else None
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S}], got {ttl!r}")
    return float(ttl)


def _keyless_tenant(scope: Scope, body: Any) -> str:
    """Without tenant keys: the body's ``tenant`` (POST) or ``?tenant=`` (GET), default "default"."""
    if isinstance(body, dict) and "tenant" in body:
        tenant = body["tenant"]
    else:
        tenant = parse_qs(scope.get("query_string", b"").decode()).get("tenant", ["default"])[0]
    if not isinstance(tenant, str) or not 0 < len(tenant) <= 256:
        raise BadRequest("tenant must be a non-empty string of at most 256 characters")
    return tenant
