"""ASGI middleware of ``kvcomm serve``: API keys on every route, body bounds, tenants per API key
and cache salts, by checking the bearer key and rewriting the JSON body of a request before vLLM
parses it (vLLM's documented ``--middleware`` extension point; vLLM itself is not patched). It
is the outermost layer: it sees every request before vLLM's own middleware and routes.

What it does with a request is decided by the route the request goes to, classified from the
app's own route table at start-up (``serve.routes``; the whole table is logged once): health
probes are open; every other method on every route needs a key when the server has keys;
bodies of every route but the read-only ones are read once, bounded (``serve.bodies``: size,
nesting depth, number sizes; 400 or 413 before vLLM sees them) and rewritten by kind.

API keys (``KVCOMM_API_KEY_DIGESTS``: SHA-256 digests of the keys vLLM was given, never the
keys; `kvcomm serve` reads them with vLLM's own argument parser, and at start-up the middleware
checks they are the keys vLLM's app was given): when set, every request except the health
probes and CORS preflights answered by vLLM's CORS middleware needs one of them as its bearer
key, or gets 401. vLLM's own check covers only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; this one covers every route, ``/metrics`` under every method included.

Tenants and salts on generation routes (bodies that may opt into kvcomm):

- **Tenants per key** (``KVCOMM_TENANT_KEY_DIGESTS``): the request belongs to the tenant
  ``tenant_of(key)`` (a salted hash of its key). An opted-in request's
  ``kv_transfer_params.kvcomm.tenant`` is overwritten with it; ``cache_salt`` is overwritten
  with the tenant's salt (``-reuse`` for opted-in requests), so vLLM's prefix cache is never
  shared across tenants (a shared cache answers faster for content another tenant sent: a
  timing side channel).
- **One tenant for all** (no keys, or ``--no-tenant-per-key``): the body's ``kvcomm.tenant``
  names a partition of the reuse state (default ``"default"``); an opted-in request's
  ``cache_salt`` is always the server's ``salt_of(tenant, True)``, whatever the client sent,
  and a plain request's own ``cache_salt`` is mapped into a separate namespace
  (``client_salt``), so no salt a client picks equals a reuse salt.

Salted routes (a body with ``cache_salt`` but no kvcomm opt-in, e.g. ``/v1/chat/completions/batch``)
get the tenant's plain salt on every request; on every other route a client's
``kv_transfer_params.kvcomm`` is removed and a client ``cache_salt`` replaced as on plain requests.
Either way blocks holding approximate KV (written only for opted-in, server-salted requests)
are never an exact prefix hit for a plain request. ``kv_transfer_params.kvcomm_server`` (what
only kvcomm itself sets: the roles, tickets and context directives of its own requests, an
in-process order's handle; ``vllm.wire.params``) is removed whole from every body on every route.

TTFT (``serve.ttft``): completion responses are timed from the request's arrival here to their
first token, planning and preambles included (``kvcomm_time_to_first_token_seconds``).

Retained contexts (``serve.contexts``): the routes under ``/v1/kvcomm/contexts`` are answered
here, after the key check, for the tenant decided as above; a generation request naming a
context (``segments[i].context``) is checked (404 for an id its tenant does not have) and its
response reports each context's outcome.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcomm.integrations.serve.bodies import MAX_BODY_BYTES, NOT_JSON, BodyError, read_body
from kvcomm.integrations.serve.contexts import ContextError, ContextRoutes
from kvcomm.integrations.serve.salts import client_salt, salt_of
from kvcomm.integrations.serve.preambles import PreambleRequests
from kvcomm.integrations.serve.served_request import ServedRequest
from kvcomm.integrations.serve.internal import kvcomm_of
from kvcomm.integrations.serve.routes import RouteTable
from kvcomm.integrations.serve.vllm_args import accepted_keys
from kvcomm.integrations.serve.twins import TwinRequests
from kvcomm.integrations.serve import ttft
from kvcomm.integrations.vllm.wire.params import SERVER_KEY, KvcommParamsError, parse_params, shown  # noqa: F401 (shown: re-exported)

KEY_DIGESTS_ENV = "KVCOMM_TENANT_KEY_DIGESTS"
"""Comma-separated SHA-256 hex digests of the API keys that are tenants (set by ``kvcomm serve``)."""
API_KEY_DIGESTS_ENV = "KVCOMM_API_KEY_DIGESTS"
"""Comma-separated SHA-256 hex digests of every API key the server accepts (set by ``kvcomm serve``)."""

def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def tenant_of(key: str) -> str:
    """The tenant id of an API key: a hash, so the key itself never reaches the engine or logs."""
    return "key-" + hashlib.sha256(b"kvcomm-tenant\0" + key.encode("utf-8")).hexdigest()[:32]


def _options(body: dict) -> tuple[dict | None, Any]:
    params = body.get("kv_transfer_params")
    return (params if isinstance(params, dict) else None), (params.get("kvcomm") if isinstance(params, dict) else None)


def rewrite(body: Any, key: str | None, digests: frozenset[str], kind: str = "generation") -> Any:
    """The request body as vLLM should see it (see the module docstring). ``key``: the
    request's bearer key; ``digests``: the tenant keys' digests (empty: one tenant for all);
    ``kind``: the route's kind (``serve.routes``: ``generation``, ``salted``, or any other for a
    body with neither). ``kvcomm_server`` is dropped whatever the kind (the options themselves:
    ``check_options``). Bodies that are not JSON objects pass unchanged (vLLM reports them)."""
    if not isinstance(body, dict):
        return body
    params, options = _options(body)
    if params is not None:
        params.pop(SERVER_KEY, None)
    tenant = tenant_of(key) if digests and key is not None and key_digest(key) in digests else None
    if kind != "generation":
        if params is not None:
            params.pop("kvcomm", None)
        if tenant is not None and (kind == "salted" or "cache_salt" in body):
            body["cache_salt"] = salt_of(tenant, False)
        elif isinstance(body.get("cache_salt"), str):
            body["cache_salt"] = client_salt(body["cache_salt"])
        return body
    opted_in = params is not None and "kvcomm" in params
    if tenant is not None:
        if isinstance(options, dict):
            options["tenant"] = tenant
        body["cache_salt"] = salt_of(tenant, opted_in)
    elif digests:
        return body  # tenants per key, and no valid key: refused before this (401)
    elif opted_in:
        named = options.get("tenant", "default") if isinstance(options, dict) else "default"
        body["cache_salt"] = salt_of(named if isinstance(named, str) else "default", True)
    elif isinstance(body.get("cache_salt"), str):
        body["cache_salt"] = client_salt(body["cache_salt"])
    return body


def check_options(body: dict) -> None:
    """``params.parse_params`` of a generation request's kvcomm options without the prompt's
    length (a span's end is checked after vLLM tokenizes), on the body as vLLM will see it
    (rewritten, a named context's key taken out by ``serve.contexts``): ``KvcommParamsError``,
    a ValueError, is a 400."""
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and "kvcomm" in params:
        parse_params(params, None)


def _bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value if scheme.lower() == "bearer" and value else None


def _digests(name: str) -> frozenset[str]:
    return frozenset(d for d in os.environ.get(name, "").split(",") if d)


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _preflight(headers: Headers) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``."""
    return "origin" in headers and "access-control-request-method" in headers


class KeyMismatch(RuntimeError):
    """The keys kvcomm checks are not the keys vLLM's app was given (refused at start-up)."""


def app_keys(app: Any) -> list[str] | None:
    """The API keys vLLM's app accepts, from the arguments it was started with; None for an app
    that is not vLLM's."""
    args = getattr(getattr(app, "state", None), "args", None)
    return accepted_keys(args) if args is not None and hasattr(args, "api_key") else None


class KvcommTenantMiddleware:
    """Pure ASGI middleware: the key check, body bounds and ``rewrite`` for every request (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.digests = _digests(KEY_DIGESTS_ENV)
        self.api_digests = _digests(API_KEY_DIGESTS_ENV) | self.digests
        self.routes: RouteTable | None = None
        self.contexts = ContextRoutes(app)
        self.preambles = PreambleRequests(app)
        self.twins = TwinRequests(app)

    def _table(self, scope: Scope) -> RouteTable | None:
        """The served app's route table, read at its start-up (the lifespan) or first request;
        logged once. Refuses to start when vLLM's app accepts other keys than kvcomm checks."""
        if self.routes is None and "app" in scope:
            keys = app_keys(scope["app"])
            if keys is not None and frozenset(map(key_digest, keys)) != self.api_digests:
                raise KeyMismatch(f"vLLM's app accepts {len(keys)} API key(s) and kvcomm checks {len(self.api_digests)} "
                                  "other ones: start the server with `kvcomm serve`, which reads the keys with vLLM's "
                                  "own argument parser")
            self.routes = RouteTable(scope["app"])
            # printed, as `kvcomm serve` prints its command line: vLLM's logging setup leaves
            # other packages' loggers without a handler in the API server
            print(f"kvcomm: {self.routes.summary()}; "
                  f"{'every route but the health probes needs a key' if self.api_digests else 'no API keys: open'}",
                  file=sys.stderr, flush=True)
        return self.routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()  # kvcomm's TTFT runs from here (serve.ttft)
        table = self._table(scope)
        if scope["type"] not in ("http", "websocket") or table is None:
            await self.app(scope, receive, send)
            return
        route = table.find(scope)
        headers = Headers(scope=scope)
        key = _bearer(headers)
        keyless_preflight = route.method == "OPTIONS" and table.cors and _preflight(headers)
        if self.api_digests and route.needs_key and not keyless_preflight and (
                key is None or key_digest(key) not in self.api_digests):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        contexts = scope["type"] == "http" and ContextRoutes.owns(route.path)
        if scope["type"] != "http" or keyless_preflight or not (route.rewrites or contexts):
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away before sending its body
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > MAX_BODY_BYTES:
                await _error(413, f"the request body has more than {MAX_BODY_BYTES} bytes")(scope, receive, send)
                return
        raw = b"".join(chunks)
        served: ServedRequest | None = None
        try:
            body = read_body(raw)
        except BodyError as error:
            await _error(error.status, str(error))(scope, receive, send)
            return
        if contexts:
            tenant = tenant_of(key) if self.digests and key is not None and key_digest(key) in self.digests else None
            await self.contexts.handle(scope, receive, send, tenant, body if route.method == "POST" and body is not NOT_JSON else None)
            return
        if isinstance(body, dict):
            try:
                body = rewrite(body, key, self.digests, route.kind)
                uses = []
                if route.kind == "generation":
                    uses = await self.contexts.annotate(scope, body)
                    check_options(body)
            except ContextError as error:
                await _error(error.status, str(error), type(error).__name__)(scope, receive, send)
                return
            except ValueError as error:
                await _error(400, str(error))(scope, receive, send)
                return
            if uses:
                send = self.contexts.reporting(send, uses)
            if route.kind == "generation" and ttft.observed(route.path):
                send = ttft.FirstToken(send, arrived, route.path, isinstance(kvcomm_of(body), dict))
            if route.kind == "generation" and route.path == "/v1/completions":
                served = ServedRequest(scope, body, self.preambles, self.twins)
                await served.prepare()
            raw = json.dumps(body).encode("utf-8")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        scope = {**scope, "headers": headers}
        receive = _replay([{"type": "http.request", "body": raw, "more_body": False}], receive)
        if served is None:
            await self.app(scope, receive, send)
            return
        await served.serve(self.app, scope, receive, send)
        served.measure()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that yields ``messages`` first, then defers to the original (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
