"""Every route of the served app, classified from the app itself (``RouteTable``): what kvcomm's
middleware does with a request is decided by what the route's handler declares, never by a list
of paths kept by hand, so a route a later vLLM adds is classified the same way.

Kinds (``Route.kind``), for one method of one route:

- ``public``: the health probes (``HEALTH_PROBES``, any method): no key needed, no body read.
- ``read-only``: ``GET`` and ``HEAD``: no body to rewrite; behind the key.
- ``generation``: a body whose declared model has ``kv_transfer_params`` (it may opt into
  kvcomm), or a body the handler reads raw (``/invocations``, ``/inference/v1/generate``: kvcomm
  cannot see what they forward, so they get the strictest treatment): tenant and ``cache_salt``
  are decided by kvcomm.
- ``salted``: a declared body with ``cache_salt`` but no ``kv_transfer_params``
  (``/v1/chat/completions/batch``, ``/generative_scoring``): with API keys as tenants, every such
  request gets its tenant's plain salt, whether or not the client sent one (vLLM's prefix cache
  is never shared across tenants).
- ``plain``: a declared body with neither (``/tokenize``): nothing to salt; a client's
  ``kv_transfer_params.kvcomm`` is removed all the same.
- ``mount``: a mounted app (``/metrics``: every method answers) or a websocket route: behind the
  key, no body rewrite.
- ``unknown``: no route matches (the app answers 404 or 405): behind the key, body bounded.

Every kind but ``public`` needs a key when the server has keys; a CORS preflight (``OPTIONS``
with ``Origin`` and ``Access-Control-Request-Method``) passes without one only while the app has
Starlette's CORS middleware, which answers it before any route (``RouteTable.cors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.routing import Match

HEALTH_PROBES = ("/health", "/ping")
"""Paths answered without a key, whatever the method: they carry no request data."""
READ_ONLY_METHODS = ("GET", "HEAD")
KINDS = ("public", "read-only", "generation", "salted", "plain", "mount", "unknown")


@dataclass(frozen=True)
class Route:
    """One method of one route: ``kind`` (module docstring) and the body model's name, if any."""

    method: str
    path: str
    kind: str
    body: str | None = None

    @property
    def needs_key(self) -> bool:
        return self.kind != "public"

    @property
    def rewrites(self) -> bool:
        """Whether the middleware reads and rewrites this request's body (bounds apply to every body read)."""
        return self.kind in ("generation", "salted", "plain", "unknown")


def _body_fields(route: Any) -> tuple[str | None, set[str] | None]:
    """(the declared body model's name, its field names) of a FastAPI route; (None, None) when it
    declares none (the handler may read the body raw). Unions: every member's fields."""
    body_field = getattr(route, "body_field", None)
    if body_field is None:
        return None, None
    annotation = body_field.field_info.annotation
    members = getattr(annotation, "__args__", None) or (annotation,)
    fields: set[str] = set()
    for member in members:
        fields |= set(getattr(member, "model_fields", {}))
    return getattr(annotation, "__name__", str(annotation)), fields


def classify(method: str, path: str, route: Any) -> Route:
    """The ``Route`` for ``method`` on the app's ``route`` object (a FastAPI/Starlette route or mount)."""
    if path in HEALTH_PROBES:
        return Route(method, path, "public")
    if getattr(route, "methods", None) is None:
        return Route(method, path, "mount")
    if method in READ_ONLY_METHODS:
        return Route(method, path, "read-only")
    name, fields = _body_fields(route)
    if fields is None or "kv_transfer_params" in fields:
        return Route(method, path, "generation", name)
    return Route(method, path, "salted" if "cache_salt" in fields else "plain", name)


class RouteTable:
    """The served app's routes by method, read once from ``app.routes``; ``find`` matches a
    request's scope the way the app's router will."""

    def __init__(self, app: Any):
        self.app = app
        self._routes = [r for r in getattr(app, "routes", ()) if getattr(r, "path", None) is not None]
        self.cors = any(getattr(m, "cls", None).__name__ == "CORSMiddleware"
                        for m in getattr(app, "user_middleware", ()) if getattr(m, "cls", None) is not None)
        """Whether Starlette's CORS middleware answers preflights before any route (vLLM always adds it)."""

    def rows(self) -> list[Route]:
        """Every method of every route (a mount as method ``*``)."""
        rows = []
        for route in self._routes:
            methods = getattr(route, "methods", None)
            for method in sorted(methods) if methods else ["*"]:
                rows.append(classify(method, route.path, route))
        return rows

    def find(self, scope: dict) -> Route:
        """The ``Route`` a request goes to: the first route that matches it fully, as the app's
        router picks it; ``unknown`` when none does."""
        method = scope.get("method", "GET") if scope["type"] == "http" else "GET"
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        for route in self._routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return classify(method, path if getattr(route, "methods", None) is None else route.path, route)
        return Route(method, path, "public" if path in HEALTH_PROBES else "unknown")

    def summary(self) -> str:
        """One line for the log: how many routes of each kind, and which routes are not read-only."""
        rows = self.rows()
        by_kind = {kind: sorted(f"{r.method} {r.path}" for r in rows if r.kind == kind) for kind in KINDS}
        shown = "; ".join(f"{kind}: {', '.join(by_kind[kind])}" for kind in ("generation", "salted", "plain", "public", "mount")
                          if by_kind[kind])
        return f"{len(rows)} routes; {shown}; read-only: {len(by_kind['read-only'])}"
