"""ASGI middleware of ``kvcomm serve``: tenants per API key and cache salts, by rewriting the
JSON body of generation requests before vLLM parses it (vLLM's documented ``--middleware``
extension point; vLLM itself is not patched).

For ``POST`` requests to ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and
``/inference/v1/generate`` (the generation endpoints with ``cache_salt`` and
``kv_transfer_params`` body fields):

- **Tenants on** (the server was given API keys; ``KVCOMM_TENANT_KEY_DIGESTS`` holds their
  SHA-256 digests, never the keys): a request whose bearer key is one of them belongs to the
  tenant ``tenant_of(key)`` (a salted hash). Its body's ``cache_salt`` is overwritten with the
  tenant's own salt, so vLLM's exact prefix cache is never shared across tenants (a shared
  cache answers faster for content another tenant sent: a timing side channel), and, if it
  opted into kvcomm, ``kv_transfer_params.kvcomm.tenant`` is overwritten with the tenant, so
  it gets its own anchor pools, base KV and exact prefix store. Whatever the client put in
  those fields is ignored. Requests with a missing or unknown key are left alone (vLLM's own
  authentication answers 401).
- **Tenants off**: an opted-in request without ``cache_salt`` gets the salt of its tenant
  (``kv_transfer_params.kvcomm.tenant``, default ``"default"``), so approximate KV is never
  served as an exact prefix hit to a request that did not opt in; other requests are untouched.

Opted-in requests get a salt distinct from the same tenant's other requests (suffix
``-reuse``): blocks holding approximate KV stay among requests that asked for reuse.
A ``kvcomm.handle`` (in-process orders only) is refused over HTTP with status 400.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KEY_DIGESTS_ENV = "KVCOMM_TENANT_KEY_DIGESTS"
"""Comma-separated SHA-256 hex digests of the API keys that are tenants (set by ``kvcomm serve``)."""

REWRITTEN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def tenant_of(key: str) -> str:
    """The tenant id of an API key: a hash, so the key itself never reaches the engine or logs."""
    return "key-" + hashlib.sha256(b"kvcomm-tenant\0" + key.encode("utf-8")).hexdigest()[:32]


def salt_of(tenant: str, reuse: bool) -> str:
    """vLLM ``cache_salt`` for a tenant's requests (``reuse``: requests that opted into kvcomm)."""
    digest = hashlib.sha256(b"kvcomm-salt\0" + tenant.encode("utf-8")).hexdigest()[:32]
    return f"kvcomm-{digest}" + ("-reuse" if reuse else "")


def rewrite(body: Any, key: str | None, digests: frozenset[str]) -> Any:
    """The request body as vLLM should see it (see the module docstring). Raises ValueError
    for a ``kvcomm.handle`` sent over HTTP. Bodies that are not JSON objects pass unchanged
    (vLLM reports them)."""
    if not isinstance(body, dict):
        return body
    params = body.get("kv_transfer_params")
    options = params.get("kvcomm") if isinstance(params, dict) else None
    opted_in = isinstance(params, dict) and "kvcomm" in params
    if isinstance(options, dict) and "handle" in options:
        raise ValueError("kv_transfer_params.kvcomm.handle is for in-process callers only; remove it over HTTP")
    if digests:
        if key is None or key_digest(key) not in digests:
            return body
        tenant = tenant_of(key)
        if isinstance(options, dict):
            options["tenant"] = tenant
        body["cache_salt"] = salt_of(tenant, opted_in)
    elif opted_in and body.get("cache_salt") is None:
        tenant = options.get("tenant", "default") if isinstance(options, dict) else "default"
        body["cache_salt"] = salt_of(str(tenant), True)
    return body


def _bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value if scheme.lower() == "bearer" and value else None


class KvcommTenantMiddleware:
    """Pure ASGI middleware applying ``rewrite`` to generation requests' JSON bodies."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        raw = os.environ.get(KEY_DIGESTS_ENV, "")
        self.digests = frozenset(d for d in raw.split(",") if d)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else ""
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in REWRITTEN_PATHS:
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
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # not JSON: vLLM answers it as usual
        if body is not None:
            try:
                body = rewrite(body, _bearer(Headers(scope=scope)), self.digests)
            except ValueError as error:
                response = JSONResponse({"error": {"message": str(error), "type": "BadRequestError", "code": 400}}, 400)
                await response(scope, receive, send)
                return
            raw = json.dumps(body).encode("utf-8")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        scope = {**scope, "headers": headers}
        await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that yields ``messages`` first, then defers to the original (disconnects)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
