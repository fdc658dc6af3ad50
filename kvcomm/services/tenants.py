"""Tenant isolation and a byte cap across tenants.

Every tenant gets its own ``TenantEngine``: anchor pools, base KV, fixed-segment bases and
exact prefix store are never shared, so one tenant's requests cannot make another's faster
(a shared cache is a timing side channel). A ``TenantRegistry`` caps the bytes all engines
hold together, and optionally each tenant's own bytes, by evicting after every call that
grew an engine.

A per-tenant quota with ``max_tenants * max_tenant_bytes <= max_total_bytes`` means the total
cap is never what evicts, so one tenant's load cannot evict another's entries either; with
the total cap alone, eviction hits the largest tenant first, and a tenant that fills the
shared budget can observe (by its own misses) that others are active.

Adapters: a tenant may hold one engine more per LoRA adapter its requests run under
(``adapter_key``): KV computed under one adapter is wrong for another and for the base model,
so nothing is shared between them, while requests under the same adapter reuse each other.
A tenant's engines count together against ``max_tenant_bytes``; each is listed, saved and
labelled under its own key.

Locks: an engine's lock guards its state; the registry's lock guards the tenant map and
enforcement. Enforcement runs only while no engine lock is held by the calling thread and
takes one engine lock at a time, so the two never wait on each other in a cycle.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from kvcomm.anchors.index import Embedder
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import BaseProvider, ReuseEngine
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV
from kvcomm.reuse.plan import ReusePlan
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment
from kvcomm.reuse.workspace import KVWorkspace

MAX_TENANT_KEY_LENGTH = 256
MAX_ADAPTER_ID_LENGTH = 128
_ADAPTER_SEP = "\x00adapter:"


def adapter_key(tenant: str, adapter: str | None) -> str:
    """The engine key of ``tenant``'s requests under LoRA adapter ``adapter`` (its identity,
    e.g. ``vllm.wire.params.adapter_identity``; None: the base model, whose key is ``tenant``)."""
    _check_key(tenant)
    if adapter is None:
        return tenant
    if not isinstance(adapter, str) or not adapter or len(adapter) > MAX_ADAPTER_ID_LENGTH:
        raise ValueError(f"an adapter identity must be a non-empty string of at most {MAX_ADAPTER_ID_LENGTH} characters")
    return f"{tenant}{_ADAPTER_SEP}{adapter}"


def owner_of(key: str) -> str:
    """The tenant an engine key belongs to (``adapter_key``'s inverse, less the adapter); a
    value that is not a string is returned as it is (for ``_check_key`` to refuse)."""
    return key.split(_ADAPTER_SEP, 1)[0] if isinstance(key, str) else key


@dataclass(frozen=True)
class EngineBytes:
    """Bytes of tensors an engine holds, by kind. ``pools``: slot name -> anchor bytes."""

    pools: dict[str, int]
    prefix_store: int
    bases: int
    fixed_bases: int

    @property
    def total(self) -> int:
        return sum(self.pools.values()) + self.prefix_store + self.bases + self.fixed_bases


class TenantEngine(ReuseEngine):
    """A ``ReuseEngine`` that reports its bytes, can shrink itself, and calls ``on_grow``
    (outside its lock) after every call that may have grown it: ``plan``, ``learn``,
    ``register_base``."""

    def __init__(
        self, rotary: Rotary, config: ReuseConfig | None = None, embedder: Embedder | None = None,
        on_grow: Callable[[], None] | None = None, workspace: KVWorkspace | None = None, head_shards: HeadShards = ALL_HEADS,
    ):
        super().__init__(rotary, config, embedder, workspace, head_shards)
        self.on_grow = on_grow
        self.evicted = {"prefix_store": 0, "bases": 0, "fixed_bases": 0, "anchors": 0}
        self.pinned: set[str] = set()
        """Content ids whose bases ``shrink`` never evicts (retained contexts); whoever pins
        keeps their bytes within the caps (``kvcomm.services.contexts``)."""
        self._local = threading.local()

    def _grew(self) -> None:
        if self.on_grow is not None and not getattr(self._local, "depth", 0):
            self.on_grow()

    @contextmanager
    def _held_without_shrink(self):
        """Hold the lock and defer ``on_grow`` (a shrink) until the block ends, so nothing a
        plan or a learn registers is dropped before it is used; ``on_grow`` runs once after."""
        with self._lock:
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                yield
            finally:
                self._local.depth -= 1
        self._grew()

    def plan(self, prompt: Prompt, provide_base: BaseProvider | None = None, computes_preambles: bool = False) -> ReusePlan:
        # A concurrent shrink must not drop a base between its registration and its use.
        with self._held_without_shrink():
            return super().plan(prompt, provide_base, computes_preambles)

    def learn(self, plan: ReusePlan, computed: KV, reply_ids: tuple[int, ...] = (), reply_kv: KV | None = None,
              preamble: KV | None = None) -> None:
        with self._held_without_shrink():  # new content's bases are registered, then learned from
            # (a base evicted under memory pressure since planning is not learned from: ReuseEngine.learn)
            super().learn(plan, computed, reply_ids, reply_kv, preamble)

    def register_base(self, segment: Segment, base: KV) -> KV:
        held = super().register_base(segment, base)
        self._grew()
        return held

    def pin(self, shared_id: str) -> None:
        """Keep the base of ``shared_id`` through every ``shrink`` (it may be registered later)."""
        with self._lock:
            self.pinned.add(shared_id)

    def unpin(self, shared_id: str) -> bool:
        """Stop keeping ``shared_id`` and drop the engine's base of it (an anchor of that
        content keeps its own base). Returns whether the engine held one."""
        with self._lock:
            self.pinned.discard(shared_id)
            return self.drop_base(shared_id)

    def memory(self) -> EngineBytes:
        with self._lock:
            return EngineBytes(
                {slot: pool.nbytes for slot, pool in self.pools.items()},
                self.prefix_store.nbytes,
                sum(kv.nbytes + self._embedding_share(emb) for kv, emb in self._bases.values()
                    if id(kv.values) not in self._anchor_bases()),
                sum(kv.nbytes for kv in self._fixed_bases.values()),
            )

    def _embedding_share(self, embedding) -> int:
        """Bytes counted for a base's embedding: this rank's share, as for its KV. Every rank of a
        head split holds the whole vector, so counting it whole would put a rank over its share
        of a byte cap before one process holding all heads would be over the cap."""
        return getattr(embedding, "nbytes", 0) // self.head_shards.size

    def _anchor_bases(self) -> set[int]:
        """Ids of the base value tensors anchors hold: a content's base held by the engine and
        by its anchor is one tensor, counted once (with the anchor's pool)."""
        return {id(a.base.values) for pool in self.pools.values() for a in pool.anchors}

    @property
    def nbytes(self) -> int:
        return self.memory().total

    def shrink(self, target: int) -> int:
        """Evict until this engine holds <= ``target`` bytes (or nothing is left); returns
        the bytes freed. Cheapest to rebuild goes first: exact prefixes (LRU), base KV of
        shared content that no anchor holds and nobody pinned (oldest first; recomputed on demand), fixed-segment bases (oldest
        first; relearned by the next dense prefill), then anchors, from the largest pool
        by its own eviction rule."""
        with self._lock:
            held = self.nbytes
            start = held
            while held > target and self.prefix_store.nbytes:
                held -= self.prefix_store.drop_oldest()
                self.evicted["prefix_store"] += 1
            shared = self._anchor_bases()
            for shared_id in [s for s, (kv, _) in self._bases.items() if id(kv.values) not in shared and s not in self.pinned]:
                if held <= target:
                    break
                kv, embedding = self._bases.pop(shared_id)  # an anchor's base frees nothing: kept
                held -= kv.nbytes + self._embedding_share(embedding)
                self.evicted["bases"] += 1
            while held > target and self._fixed_bases:
                held -= self._fixed_bases.pop(next(iter(self._fixed_bases))).nbytes
                self.evicted["fixed_bases"] += 1
            while held > target:
                pools = [p for p in self.pools.values() if len(p)]
                if not pools:
                    break
                pool = max(pools, key=lambda p: p.nbytes)
                if pool.evict() is None:
                    break
                held = self.nbytes  # an evicted anchor's base may stay, as the engine's base of its content
                self.evicted["anchors"] += 1
            return start - held


def tenant_label(tenant: str) -> str:
    """A short stable label for metrics and logs: tenant keys may be API keys, never export them."""
    return hashlib.blake2b(tenant.encode("utf-8"), digest_size=6).hexdigest()


class TenantRegistry:
    """Tenant key -> its own ``TenantEngine``, created on first use, all sharing one rotary
    and config. After every call that grows an engine: if its tenant's engines (``owner_of``)
    together exceed ``max_tenant_bytes``, that engine is shrunk first, then the tenant's others,
    largest first, by the excess; then, while all engines together exceed ``max_total_bytes``,
    the largest engine is shrunk by the excess."""

    def __init__(
        self, rotary: Rotary, config: ReuseConfig | None = None, *, max_total_bytes: int | None = None,
        max_tenant_bytes: int | None = None, embedder: Embedder | None = None, head_shards: HeadShards = ALL_HEADS,
    ):
        """head_shards: the KV heads this process holds (``kvcomm.core.heads``); the byte caps
        apply to the bytes this process holds."""
        for name, value in (("max_total_bytes", max_total_bytes), ("max_tenant_bytes", max_tenant_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None (got {value!r})")
        self.rotary = rotary
        self.config = config or ReuseConfig()
        self.embedder = embedder
        self.head_shards = head_shards
        self.max_total_bytes = max_total_bytes
        self.max_tenant_bytes = max_tenant_bytes
        self._engines: dict[str, TenantEngine] = {}
        self._lock = threading.RLock()
        self.enforcements = 0
        self.workspace = KVWorkspace(self.config.workspace_bytes)  # scratch, not tenant state: outside the byte limits

    def engine(self, tenant: str) -> TenantEngine:
        """The engine of ``tenant`` (a tenant key, or an ``adapter_key``; created empty on first use)."""
        _check_key(owner_of(tenant))
        if tenant != owner_of(tenant):
            adapter_key(owner_of(tenant), tenant.split(_ADAPTER_SEP, 1)[1])  # checks the adapter part
        with self._lock:
            engine = self._engines.get(tenant)
            if engine is None:
                engine = TenantEngine(self.rotary, self.config, self.embedder, workspace=self.workspace, head_shards=self.head_shards)
                engine.on_grow = lambda: self.enforce(engine)
                self._engines[tenant] = engine
            return engine

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._engines

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def tenants(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._engines)

    def drop(self, tenant: str) -> None:
        """Forget ``tenant`` and everything its engine holds (KeyError if unknown)."""
        with self._lock:
            if tenant not in self._engines:
                raise KeyError(f"unknown tenant {tenant_label(tenant)} (label); nothing to drop")
            self._engines.pop(tenant).on_grow = None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._engines.values())

    def load(self, tenant: str, directory, fingerprint) -> None:
        """Restore ``tenant``'s pools from a save (``kvcomm.services.persist.load_engine``), then apply the caps."""
        from kvcomm.services.persist import load_engine  # persistence is optional for a registry

        engine = self.engine(tenant)
        load_engine(directory, engine, fingerprint)
        self.enforce(engine)

    def enforce(self, grown: TenantEngine | None = None) -> int:
        """Apply the per-tenant quota to ``grown`` and the total cap to all; returns bytes freed."""
        with self._lock:
            freed = 0
            if grown is not None and self.max_tenant_bytes is not None:
                owner = next((owner_of(k) for k, e in self._engines.items() if e is grown), None)
                group = [e for k, e in self._engines.items() if owner is not None and owner_of(k) == owner]
                sizes = {id(e): e.nbytes for e in group}
                excess = sum(sizes.values()) - self.max_tenant_bytes
                for engine in sorted(group, key=lambda e: (e is not grown, -sizes[id(e)])):
                    if excess <= 0:
                        break
                    released = engine.shrink(max(0, sizes[id(engine)] - excess))
                    freed += released
                    excess -= released
            if self.max_total_bytes is not None:
                sizes = {id(e): e.nbytes for e in self._engines.values()}
                excess = sum(sizes.values()) - self.max_total_bytes
                for engine in sorted(self._engines.values(), key=lambda e: -sizes[id(e)]):
                    if excess <= 0:
                        break
                    released = engine.shrink(sizes[id(engine)] - excess)
                    freed += released
                    excess -= released
            self.enforcements += int(freed > 0)
            return freed

    def problems(self) -> list[str]:
        """Violated invariants of the registry and of every pool in it (``AnchorPool.problems``),
        as sentences naming the tenant label and slot; empty when consistent. Byte caps are
        checked as they hold between calls (a growing call exceeds them until it returns)."""
        with self._lock:
            found = []
            owned: dict[str, int] = {}
            for tenant, engine in self._engines.items():
                label = tenant_label(tenant)
                for slot, pool in list(engine.pools.items()):
                    found += [f"tenant {label}, slot {slot!r}: {p}" for p in pool.problems()]
                owned[owner_of(tenant)] = owned.get(owner_of(tenant), 0) + engine.nbytes
            for owner, held in owned.items():
                if self.max_tenant_bytes is not None and held > self.max_tenant_bytes:
                    found.append(f"tenant {tenant_label(owner)} holds {held} bytes > max_tenant_bytes {self.max_tenant_bytes}")
            total = sum(e.nbytes for e in self._engines.values())
            if self.max_total_bytes is not None and total > self.max_total_bytes:
                found.append(f"tenants hold {total} bytes > max_total_bytes {self.max_total_bytes}")
            return found

    def metrics(self) -> dict:
        """Numbers for a metrics exporter: total bytes and caps, and per tenant label its
        bytes by kind, anchors per slot and evictions by kind."""
        with self._lock:
            tenants = {}
            for tenant, engine in self._engines.items():
                memory = engine.memory()
                tenants[tenant_label(tenant)] = {
                    "bytes": memory.total, "pool_bytes": dict(memory.pools), "prefix_store_bytes": memory.prefix_store,
                    "base_bytes": memory.bases, "fixed_base_bytes": memory.fixed_bases,
                    "anchors": {slot: len(pool) for slot, pool in engine.pools.items()},
                    "evicted": dict(engine.evicted),
                }
            return {
                "bytes": sum(t["bytes"] for t in tenants.values()), "max_total_bytes": self.max_total_bytes,
                "max_tenant_bytes": self.max_tenant_bytes, "tenants": tenants, "enforcements": self.enforcements,
            }


def _check_key(tenant: object) -> None:
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_KEY_LENGTH or "\x00" in tenant:
        shown = type(tenant).__name__ if not isinstance(tenant, str) else f"a string of {len(tenant)} characters"
        raise ValueError(
            f"tenant key must be a non-empty string of at most {MAX_TENANT_KEY_LENGTH} characters and no NUL, got {shown}; "
            "pass e.g. the request's API key or a tenant name"
        )
