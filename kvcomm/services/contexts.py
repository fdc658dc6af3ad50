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

Persistence (``path``, a folder): one file per context, ``<id>.json``, written atomically when
that context changes (its use counts go with its next change, or another context's), deleted
when the record is forgotten, so a change writes about that context's bytes whatever the
number of contexts. At start the records are read back; a context read back is ``evicted``
with reason ``"restart"`` (its KV is not pinned in the new process): retaining it again
recomputes or re-pins its KV. A record file that cannot be read (torn, not JSON, wrong fields)
is moved aside to ``<id>.json.unreadable-<UTC time>`` with a log line naming it, and the store
starts without it; temp files of a write that was killed are removed. The records of a
``legacy`` single file (``contexts.json``, written whole on every change before) are moved
into the folder, and that file removed once they are durable (moved aside, named in the log,
if it cannot be read). Thread-safe.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvcomm.services.state_files import move_aside, remove_temp_files, write_text_atomically

log = logging.getLogger(__name__)
RETAINED, EVICTED = "retained", "evicted"
CONTEXT_ID = re.compile(r"ctx-[0-9a-f]{32}")
MAX_RECORD_BYTES = 64 << 20
"""A record file larger than this is not one kvcomm wrote (a context's text is at most 1 Mi characters)."""


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
                 path: str | Path | None = None, clock: Callable[[], float] = time.time, max_contexts: int = 10_000,
                 legacy: str | Path | None = None):
        self.max_tenant_bytes = max_tenant_bytes
        self.max_total_bytes = max_total_bytes
        self.max_contexts = max_contexts
        """Records kept per tenant; past it, the oldest evicted ones are forgotten (retained ones never)."""
        self.path = Path(path) if path else None
        """The folder of the record files (None: records in memory only)."""
        self.clock = clock
        self._contexts: dict[str, Context] = {}
        self._dirty: set[str] = set()  # contexts whose use counts changed since their file was written
        self._lock = threading.RLock()
        if self.path is not None:
            self._load(Path(legacy) if legacy else None)

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
            self._save(context)
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
            self._save(context)
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
                self._save(context)
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
            self._dirty.add(context.id)

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
            self._dirty.discard(context.id)
            if self.path is not None:
                (self.path / f"{context.id}.json").unlink(missing_ok=True)

    def _save(self, changed: Context) -> None:
        """Write the file of ``changed`` and of the contexts whose use counts changed since theirs."""
        if self.path is None:
            return
        for context in [changed, *(self._contexts[i] for i in sorted(self._dirty - {changed.id}) if i in self._contexts)]:
            write_text_atomically(self.path / f"{context.id}.json", json.dumps(_row(context)))
        self._dirty.clear()

    def _load(self, legacy: Path | None) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        removed = remove_temp_files(self.path)
        if removed:
            log.info("kvcomm: removed %d temp files of killed writes (%d bytes) in %s", len(removed),
                     sum(removed.values()), self.path)
        for file in sorted(self.path.glob("ctx-*.json")):
            try:
                if file.stat().st_size > MAX_RECORD_BYTES:
                    raise ValueError(f"{file.stat().st_size} bytes, more than a record holds")
                context = _context(json.loads(file.read_text(encoding="utf-8")))
                if f"{context.id}.json" != file.name:
                    raise ValueError(f"it holds context {context.id!r}")
            except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, RecursionError) as error:
                self._set_aside(file, error, "the server starts without this context")
                continue
            self._restarted(context)
        if legacy is not None and legacy.is_file():
            self._migrate(legacy)

    def _migrate(self, legacy: Path) -> None:
        """Move the records of the single file of earlier versions into the folder, then remove it."""
        for stale in legacy.parent.glob(".contexts-*"):  # its temp files of a killed write
            stale.unlink(missing_ok=True)
        try:
            rows = json.loads(legacy.read_text(encoding="utf-8"))["contexts"]
            contexts = [_context(row) for row in rows]
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, RecursionError) as error:
            self._set_aside(legacy, error, "the server starts without its contexts")
            return
        for context in contexts:
            if context.id not in self._contexts:
                self._restarted(context)
                write_text_atomically(self.path / f"{context.id}.json", json.dumps(_row(context)))
        legacy.unlink()
        log.info("kvcomm: %d context records moved from %s to one file each in %s", len(contexts), legacy, self.path)

    def _restarted(self, context: Context) -> None:
        if context.state == RETAINED:
            context.state, context.reason = EVICTED, "restart"
        self._contexts[context.id] = context

    @staticmethod
    def _set_aside(path: Path, error: Exception, outcome: str) -> None:
        try:
            where = f"moved aside to {move_aside(path)}"
        except OSError as failed:
            where = f"could not be moved aside ({failed}); it is skipped"
        log.error("kvcomm: %s cannot be read (%s: %s); %s; %s", path, type(error).__name__, str(error)[:200], where,
                  outcome)


def _row(context: Context) -> dict:
    return {**asdict(context), "token_ids": list(context.token_ids)}


def _context(row: object) -> Context:
    """A record read back, every field checked (ValueError saying which is wrong)."""
    if not isinstance(row, dict):
        raise ValueError("a record must be a JSON object")

    def get(key: str, kinds: tuple, optional: bool = False):
        value = row.get(key)
        if (value is None and optional) or (isinstance(value, kinds) and not isinstance(value, bool)):
            return value
        raise ValueError(f"field {key!r} is {str(value)[:40]!r}")

    context_id = get("id", (str,))
    if not CONTEXT_ID.fullmatch(context_id):
        raise ValueError(f"field 'id' is {context_id[:40]!r}, not a context id")
    tokens = get("token_ids", (list,))
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in tokens):
        raise ValueError("field 'token_ids' must hold token ids")
    uses = get("uses", (dict,))
    if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in uses.items()):
        raise ValueError("field 'uses' must count uses by outcome")
    state = get("state", (str,))
    if state not in (RETAINED, EVICTED):
        raise ValueError(f"field 'state' is {state[:40]!r}")
    nbytes = get("bytes", (int,))
    if nbytes < 0:
        raise ValueError("field 'bytes' is negative")
    return Context(context_id, get("tenant", (str,)), get("content_id", (str,)), tuple(tokens), get("model", (str,)),
                   get("fingerprint", (str,)), get("adapter", (str,), True), nbytes, state, get("reason", (str,), True),
                   float(get("created_at", (int, float))), _number(get("expires_at", (int, float), True)), dict(uses))


def _number(value: float | None) -> float | None:
    return None if value is None else float(value)


def _expiry(now: float, ttl_s: float | None) -> float | None:
    return None if ttl_s is None else now + float(ttl_s)
