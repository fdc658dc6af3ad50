"""Retained contexts of a server: per tenant, which shared contents' KV is kept and for how long.

A context names one shared content (its token ids; ``content_id`` keys its base KV in the
tenant's reuse engine). While ``retained`` the engine keeps that base through every eviction;
``evicted`` means it no longer does (released, its TTL expired, a retain that could not be
served, or a restart), and a request naming the context is then served from the text it
carries. This store holds the records and the byte accounting only; the server tells the
engine what to pin and drop (``kvcomm.integrations.serve.contexts``).

Byte accounting (``bytes``: the KV of the content's tokens, keys and values, in the served
dtype): a tenant's retained bytes count each retained content once. A retain is refused
(``OverCap``) when it would take the tenant's retained bytes over ``max_tenant_bytes``, or
all tenants' over ``max_total_bytes``; a refused retain changes nothing, so retained KV never
makes the engines evict another tenant's data or another retained context.

Ids are random (``ctx-`` and 32 hex digits): they say nothing about the content or tenant,
and a tenant asking for another tenant's id gets ``NotFound``, as for an id never issued.

Persistence (``path``): the records are written atomically after every change and read back
at start; a context read back is ``evicted`` with reason ``"restart"`` (its KV is not pinned
in the new process): retaining it again recomputes or re-pins its KV. Thread-safe.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

RETAINED, EVICTED = "retained", "evicted"


class ContextError(Exception):
    """A request about a context that cannot be served; ``status``: its HTTP status."""

    status = 400


class NotFound(ContextError):
    status = 404


class OverCap(ContextError):
    status = 409


@dataclass
class Context:
    """One retained (or formerly retained) context of a tenant. ``bytes``: KV bytes of its
    ``token_ids``; ``expires_at``: Unix seconds (None: no TTL); ``reason``: why it is evicted."""

    id: str
    tenant: str
    content_id: str
    token_ids: tuple[int, ...]
    model: str
    fingerprint: str
    adapter: str | None
    bytes: int
    state: str = RETAINED
    reason: str | None = None
    created_at: float = 0.0
    expires_at: float | None = None
    uses: dict = field(default_factory=lambda: {"hit": 0, "unused": 0, "fallback": 0})

    def record(self) -> dict:
        """The public JSON record (no tenant, no token ids; ``content_id``: the hash of its token
        ids, which clients match against the messages they render)."""
        return {"id": self.id, "object": "kvcomm.context", "content_id": self.content_id, "model": self.model, "model_fingerprint": self.fingerprint,
                "adapter": self.adapter, "tokens": len(self.token_ids), "bytes": self.bytes, "state": self.state,
                "evicted_reason": self.reason, "created_at": self.created_at, "expires_at": self.expires_at,
                "uses": dict(self.uses)}


class ContextStore:
    """Contexts by tenant, with the byte caps above (None: no cap) and optional persistence."""

    def __init__(self, max_tenant_bytes: int | None = None, max_total_bytes: int | None = None,
                 path: str | Path | None = None, clock: Callable[[], float] = time.time, max_contexts: int = 10_000):
        self.max_tenant_bytes = max_tenant_bytes
        self.max_total_bytes = max_total_bytes
        self.max_contexts = max_contexts
        """Records kept per tenant; past it, the oldest evicted ones are forgotten (retained ones never)."""
        self.path = Path(path) if path else None
        self.clock = clock
        self._contexts: dict[str, Context] = {}
        self._lock = threading.RLock()
        if self.path is not None and self.path.exists():
            self._load()

    # -- records ---------------------------------------------------------------------------

    def get(self, tenant: str, context_id: str) -> Context:
        """The context ``context_id`` of ``tenant``; ``NotFound`` for any other tenant's id too."""
        with self._lock:
            context = self._contexts.get(context_id) if isinstance(context_id, str) else None
            if context is None or context.tenant != tenant:
                shown = repr(context_id[:80]) + ("..." if len(context_id) > 80 else "") if isinstance(context_id, str) else "of that type"
                raise NotFound(f"no context {shown} (contexts are per tenant; ids come from POST /v1/kvcomm/contexts)")
            return context

    def list(self, tenant: str) -> list[Context]:
        with self._lock:
            return [c for c in self._contexts.values() if c.tenant == tenant]

    def retained_bytes(self, tenant: str | None = None) -> int:
        """Bytes of the distinct contents retained by ``tenant`` (None: by all tenants)."""
        with self._lock:
            held = {(c.tenant, c.content_id): c.bytes for c in self._contexts.values()
                    if c.state == RETAINED and (tenant is None or c.tenant == tenant)}
            return sum(held.values())

    def holds(self, tenant: str, content_id: str, but: str | None = None) -> bool:
        """Whether a retained context of ``tenant`` other than ``but`` keeps ``content_id``."""
        with self._lock:
            return any(c.tenant == tenant and c.content_id == content_id and c.state == RETAINED and c.id != but
                       for c in self._contexts.values())

    # -- changes ---------------------------------------------------------------------------

    def create(self, tenant: str, token_ids: tuple[int, ...], content_id: str, *, model: str, fingerprint: str,
               adapter: str | None, nbytes: int, ttl_s: float | None = None) -> Context:
        """A new retained context (its bytes reserved now); ``OverCap`` and nothing stored when over a cap."""
        with self._lock:
            now = self.clock()
            context = Context("ctx-" + secrets.token_hex(16), tenant, content_id, tuple(token_ids), model, fingerprint,
                              adapter, int(nbytes), RETAINED, None, now, _expiry(now, ttl_s))
            self._check_cap(context)
            self._contexts[context.id] = context
            self._forget_old(tenant)
            self._save()
            return context

    def retain(self, tenant: str, context_id: str, ttl_s: float | None = None) -> tuple[Context, bool]:
        """Retain again (an evicted context) or set a new TTL (None: none). Returns the context
        and whether it was evicted before (its KV must be brought back). ``OverCap``: unchanged."""
        with self._lock:
            context = self.get(tenant, context_id)
            was_evicted = context.state == EVICTED
            if was_evicted:
                self._check_cap(context)
            context.state, context.reason = RETAINED, None
            context.expires_at = _expiry(self.clock(), ttl_s)
            self._save()
            return context, was_evicted

    def evict(self, tenant: str, context_id: str, reason: str) -> tuple[Context, bool, bool]:
        """Mark evicted (``reason``: "released", "expired", ...; an evicted context keeps its
        first reason). Returns the context, whether it was retained, and whether its content's
        KV is now kept by no retained context of the tenant (so the engine may drop it)."""
        with self._lock:
            context = self.get(tenant, context_id)
            was_retained = context.state == RETAINED
            if was_retained:
                context.state, context.reason = EVICTED, reason
                self._save()
            return context, was_retained, was_retained and not self.holds(tenant, context.content_id)

    def expire(self) -> list[tuple[Context, bool, bool]]:
        """Evict every retained context whose TTL has passed; ``evict``'s answers for each."""
        with self._lock:
            now = self.clock()
            due = [c for c in self._contexts.values() if c.state == RETAINED and c.expires_at is not None and c.expires_at <= now]
            return [self.evict(c.tenant, c.id, "expired") for c in due]

    def next_expiry(self) -> float | None:
        with self._lock:
            times = [c.expires_at for c in self._contexts.values() if c.state == RETAINED and c.expires_at is not None]
            return min(times) if times else None

    def count(self, context: Context, outcome: str) -> None:
        with self._lock:
            context.uses[outcome] = context.uses.get(outcome, 0) + 1

    # -- internals -------------------------------------------------------------------------

    def _check_cap(self, context: Context) -> None:
        if self.holds(context.tenant, context.content_id, but=context.id):
            return  # its content's KV is retained already: no new bytes
        for cap, held, whose in ((self.max_tenant_bytes, self.retained_bytes(context.tenant), "this tenant's"),
                                 (self.max_total_bytes, self.retained_bytes(), "all tenants'")):
            if cap is not None and held + context.bytes > cap:
                raise OverCap(
                    f"retaining this context ({len(context.token_ids)} tokens, {context.bytes} bytes of KV) would take "
                    f"{whose} retained contexts to {held + context.bytes} bytes, over the cap of {cap} bytes; release a "
                    "context first (nothing was evicted or changed)")

    def _forget_old(self, tenant: str) -> None:
        mine = [c for c in self._contexts.values() if c.tenant == tenant]
        for context in sorted((c for c in mine if c.state == EVICTED), key=lambda c: c.created_at):
            if len(mine) <= self.max_contexts:
                return
            del self._contexts[context.id]
            mine.remove(context)

    def _save(self) -> None:
        if self.path is None:
            return
        rows = [{**asdict(c), "token_ids": list(c.token_ids)} for c in self._contexts.values()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".contexts-")
        with os.fdopen(fd, "w") as handle:
            json.dump({"format": 1, "contexts": rows}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, self.path)

    def _load(self) -> None:
        data = json.loads(self.path.read_text())
        for row in data.get("contexts", []):
            context = Context(**{**row, "token_ids": tuple(row["token_ids"])})
            if context.state == RETAINED:
                context.state, context.reason = EVICTED, "restart"
            self._contexts[context.id] = context


def _expiry(now: float, ttl_s: float | None) -> float | None:
    return None if ttl_s is None else now + float(ttl_s)
