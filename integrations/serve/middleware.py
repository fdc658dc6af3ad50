"""ASGI middleware of ``kvcomm serve``: API keys on every route, tenants per API key and cache
salts, by checking the bearer key and rewriting the JSON body of every ``POST`` before vLLM
parses it (vLLM's documented ``--middleware`` extension point; vLLM itself is not patched).
It is the outermost layer: it sees every request before vLLM's own middleware and routes.

Every route of the served app falls in one of three kinds (``route_kind``; the whole table,
read from the app's routes, is logged once at start-up):

- **generation** (``GENERATION_PATHS``, ``POST``): bodies that may opt into kvcomm
  (``kv_transfer_params.kvcomm``) and carry vLLM's ``cache_salt``. The tenant and the salt
  are decided here, never taken from the client (below).
- **plain** (every other ``POST``, whatever vLLM adds in a later version): no kvcomm opt-in
  (``kv_transfer_params.kvcomm`` is removed) and a client ``cache_salt`` is replaced by the
  salt plain requests of that caller get.
- **read-only** (``GET``, ``HEAD``, ``OPTIONS`` ...): passed on as they are.

API keys (``KVCOMM_API_KEY_DIGESTS``: SHA-256 digests of the keys vLLM was given, never the
keys): when set, every request except ``OPTIONS`` and the health probes ``PUBLIC_PATHS`` needs
one of them as its bearer key, or gets 401. vLLM's own check covers only paths under ``/v1``,
``/v2``, ``/inference`` and ``/cohere``; this one also covers ``/metrics``, ``/invocations``,
``/generative_scoring``, ``/tokenize`` and the rest.

Tenants and salts on generation routes:

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

Either way blocks holding approximate KV (written only for opted-in, server-salted requests)
are never an exact prefix hit for a plain request. A ``kvcomm.handle`` (in-process orders
only) is refused over HTTP with status 400.

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
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcomm.integrations.serve.contexts import ContextError, ContextRoutes
from kvcomm.integrations.serve.heads import HeadRequests
from kvcomm.integrations.serve.internal import kvcomm_of
from kvcomm.integrations.serve.shadows import ShadowRequests
from kvcomm.integrations.vllm.params import KvcommParamsError, check_sizes, shown  # noqa: F401 (shown: re-exported)

KEY_DIGESTS_ENV = "KVCOMM_TENANT_KEY_DIGESTS"
"""Comma-separated SHA-256 hex digests of the API keys that are tenants (set by ``kvcomm serve``)."""
API_KEY_DIGESTS_ENV = "KVCOMM_API_KEY_DIGESTS"
"""Comma-separated SHA-256 hex digests of every API key the server accepts (set by ``kvcomm serve``)."""

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate",
                    "/v1/messages", "/cohere/v2/chat", "/invocations", "/generative_scoring")
"""POST routes whose bodies may opt into kvcomm: their tenant and salt are decided here."""
REWRITTEN_PATHS = GENERATION_PATHS  # the name earlier versions exported
PUBLIC_PATHS = ("/health", "/ping")
"""Health probes: answered without a key (they carry no request data)."""
def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def tenant_of(key: str) -> str:
    """The tenant id of an API key: a hash, so the key itself never reaches the engine or logs."""
    return "key-" + hashlib.sha256(b"kvcomm-tenant\0" + key.encode("utf-8")).hexdigest()[:32]


def salt_of(tenant: str, reuse: bool) -> str:
    """vLLM ``cache_salt`` for a tenant's requests (``reuse``: requests that opted into kvcomm)."""
    digest = hashlib.sha256(b"kvcomm-salt\0" + tenant.encode("utf-8")).hexdigest()[:32]
    return f"kvcomm-{digest}" + ("-reuse" if reuse else "")


def client_salt(salt: str) -> str:
    """A plain request's own ``cache_salt`` as vLLM gets it: the same client salt maps to the same
    value (clients keep their own cache partitions), and never to a ``salt_of`` value."""
    return "client-" + hashlib.sha256(b"kvcomm-client-salt\0" + salt.encode("utf-8")).hexdigest()[:32]


def route_kind(method: str, path: str) -> str:
    """"public", "generation", "plain" or "read-only" for a request (see the module docstring)."""
    if path in PUBLIC_PATHS:
        return "public"
    if method != "POST":
        return "read-only"
    return "generation" if path in GENERATION_PATHS else "plain"


def route_table(app: Any) -> dict[str, str]:
    """``"METHOD path"`` -> ``route_kind`` for every route of a Starlette/FastAPI ``app`` (mounted
    apps such as ``/metrics`` as ``"* path"``: every method)."""
    table = {}
    for route in getattr(app, "routes", ()):
        path = getattr(route, "path", None)
        if path is None:
            continue
        methods = getattr(route, "methods", None)
        if methods is None:  # a Mount or a websocket route: any method
            table[f"* {path}"] = "public" if path in PUBLIC_PATHS else "plain"
            continue
        for method in sorted(methods):
            table[f"{method} {path}"] = route_kind(method, path)
    return table


def _options(body: dict) -> tuple[dict | None, Any]:
    params = body.get("kv_transfer_params")
    return (params if isinstance(params, dict) else None), (params.get("kvcomm") if isinstance(params, dict) else None)


def rewrite(body: Any, key: str | None, digests: frozenset[str], kind: str = "generation") -> Any:
    """The request body as vLLM should see it (see the module docstring). ``key``: the
    request's bearer key; ``digests``: the tenant keys' digests (empty: one tenant for all);
    ``kind``: the route's ``route_kind``. Raises ValueError for a ``kvcomm.handle`` sent over
    HTTP and for options over ``params.check_sizes``'s bounds. Bodies that are not JSON objects pass unchanged (vLLM reports them)."""
    if not isinstance(body, dict):
        return body
    params, options = _options(body)
    tenant = tenant_of(key) if digests and key is not None and key_digest(key) in digests else None
    if kind != "generation":
        if params is not None:
            params.pop("kvcomm", None)
        if "cache_salt" in body:
            if tenant is not None:
                body["cache_salt"] = salt_of(tenant, False)
            elif isinstance(body["cache_salt"], str):
                body["cache_salt"] = client_salt(body["cache_salt"])
        return body
    opted_in = params is not None and "kvcomm" in params
    if isinstance(options, dict) and "handle" in options:
        raise ValueError("kv_transfer_params.kvcomm.handle is for in-process callers only; remove it over HTTP")
    if isinstance(options, dict) and {"ticket", "computes_head", "shadow"} & set(options):
        raise ValueError("kv_transfer_params.kvcomm.ticket, computes_head and shadow are set by the server (computed "
                         "heads, the quality guard); remove them")
    check_sizes(options)  # KvcommParamsError is a ValueError: a 400
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


def _bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value if scheme.lower() == "bearer" and value else None


def _digests(name: str) -> frozenset[str]:
    return frozenset(d for d in os.environ.get(name, "").split(",") if d)


class KvcommTenantMiddleware:
    """Pure ASGI middleware: the key check and ``rewrite`` for every request (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.digests = _digests(KEY_DIGESTS_ENV)
        self.api_digests = _digests(API_KEY_DIGESTS_ENV) | self.digests
        self.routes: dict[str, str] | None = None
        self.contexts = ContextRoutes(app)
        self.heads = HeadRequests(app)
        self.shadows = ShadowRequests(app)

    def _note_routes(self, scope: Scope) -> None:
        """Once: the served app's routes by kind, in the log."""
        if self.routes is not None or "app" not in scope:
            return
        self.routes = route_table(scope["app"])
        kinds = {kind: sorted(r for r, k in self.routes.items() if k == kind)
                 for kind in ("generation", "plain", "read-only", "public")}
        # printed, as `kvcomm serve` prints its command line: vLLM's logging setup leaves
        # other packages' loggers without a handler in the API server
        print(f"kvcomm: {len(self.routes)} routes; generation (tenant and salt set by kvcomm): "
              f"{', '.join(kinds['generation'])}; plain (no kvcomm opt-in, no client salt): {', '.join(kinds['plain'])}; "
              f"read-only: {len(kinds['read-only'])}; {'no key needed' if self.api_digests else 'health probes'}: "
              f"{', '.join(kinds['public'])}", file=sys.stderr, flush=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._note_routes(scope)
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        method = scope.get("method", "GET") if scope["type"] == "http" else "GET"
        kind = route_kind(method, path)
        key = _bearer(Headers(scope=scope))
        if self.api_digests and method != "OPTIONS" and kind != "public" and (key is None or key_digest(key) not in self.api_digests):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        contexts = scope["type"] == "http" and ContextRoutes.owns(path)
        if scope["type"] != "http" or (method != "POST" and not contexts):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away before sending its body
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        shadow = None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None  # not JSON: vLLM answers it as usual
        if contexts:
            tenant = tenant_of(key) if self.digests and key is not None and key_digest(key) in self.digests else None
            await self.contexts.handle(scope, receive, send, tenant, body if method == "POST" else None)
            return
        if isinstance(body, dict):
            try:
                body = rewrite(body, key, self.digests, "generation" if kind == "generation" else "plain")
                uses = await self.contexts.annotate(scope, body) if kind == "generation" else []
            except ContextError as error:
                await JSONResponse({"error": {"message": str(error), "type": type(error).__name__, "code": error.status}},
                                   error.status)(scope, receive, send)
                return
            except ValueError as error:
                response = JSONResponse({"error": {"message": str(error), "type": "BadRequestError", "code": 400}}, 400)
                await response(scope, receive, send)
                return
            if uses:
                send = self.contexts.reporting(send, uses)
            if kind == "generation" and path == "/v1/completions":
                shadow = await self.heads.before(scope, body)
            raw = json.dumps(body).encode("utf-8")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        scope = {**scope, "headers": headers}
        status = []

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive),
                       send if shadow is None else sent)
        if shadow is not None and status == [200]:  # the quality guard sampled its plan: measure it, the response gone
            self.shadows.after(scope, body, shadow, salt_of(kvcomm_of(body).get("tenant", "default"), False))


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that yields ``messages`` first, then defers to the original (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
