"""Server-side reuse planning for requests annotated with shared segments
(``kv_transfer_params["kvcomm"]["segments"]``, see ``vllm.wire.params``).

Runs in vLLM's worker process (``vllm.planning.worker_plans``, the connector's worker side), one ``ReuseEngine``
per tenant key (``kv_transfer_params["kvcomm"]["tenant"]``; ``kvcomm serve`` with API keys
sets it from the authenticated key). A request's prompt becomes fixed segments (the gaps)
and shared segments (the annotated spans); the engine plans and materializes the reusable
front of the prompt, and after the request finishes it learns from the real KV the
connector captured.

Base KV choice: a shared segment seen for the first time has no base; the engine plans it
as computed (reuse stops there), and its base becomes its position-free KV as captured in
that first prefill (``ReuseConfig.base_source`` "first_use": no extra forward pass is run).
Later requests estimate from it.

Adapters: a request under a LoRA adapter is planned, learned and detected in its tenant's
engine for that adapter (``kvcomm.services.tenants.adapter_key``); its ``PlannedRequest.tenant``
is that engine key. Adapter engines are saved and restored like any tenant's, under their key.

Safety: approximate KV only goes to requests carrying a ``cache_salt`` (so vLLM's prefix
cache keeps their blocks apart from every request without that salt); an annotated
request without a salt gets exact reuse only.

Preambles (plans made ahead): vLLM's connector supplies KV for one range right after
vLLM's own prefix hit, so a plan that computes a preamble (text no stored KV serves, such as an
agent's unseen system prompt, with shared content after it: ``ReusePlan.preamble_end``) cannot be
served by one request. `kvcomm serve` plans such requests ahead, outside the engine step
(``plan_ahead``, called through vLLM's ``collective_rpc`` by ``vllm.connector.worker_extension``), with
``computes_preambles=True``, as the in-process runner does, and parks the plan under a ticket; when the plan
has a preamble it first sends a request of its own for the prompt's first ``preamble_end`` tokens
(purpose ``preamble``: the exact prefix injected, the preamble computed and kept under the ticket), then
the request itself with the ticket: it is served the plan made ahead, the preamble's KV (through
vLLM's prefix cache under the same salt, the rest injected) and the pieces after it, and learns
the preamble as the in-process engine does. A ticket is used once; at most ``MAX_AHEAD`` plans are
parked (oldest dropped), none older than ``AHEAD_TTL_S``.

Quality guard (``vllm.planning.guard``, with ``guard`` settings): every plan is cut at slots the
tenant's guard disabled; a plan made ahead that the guard samples is also parked under its
twin ticket (``TWIN_SUFFIX``, at most ``MAX_AHEAD``, none older than ``TWIN_TTL_S``) for
the reuse twin `kvcomm serve` sends after the response (purpose ``reuse_twin``: served the same plan,
it learns nothing), and ``guard_record`` takes the KL measured from the twins.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvcomm.reuse.config import ReuseConfig
from kvcomm.services.quality_guard import GuardConfig

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV, to_position_free
from kvcomm.core.place import Piece
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.reason import explain
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment
from kvcomm.services.tenants import TenantRegistry, adapter_key
from kvcomm.integrations.vllm.wire.channel import Capture, Injection, Order
from kvcomm.reuse.assemble import exact_piece, pieces
from kvcomm.integrations.vllm.planning.run_index import RunIndex
from kvcomm.integrations.vllm.planning.guard import ServerGuards
from kvcomm.integrations.vllm.planning.segment_ids import SegmentIds
from kvcomm.integrations.vllm.planning.metrics import record_pools
from kvcomm.integrations.vllm.wire.params import KvcommParams, KvcommParamsError, shown

MAX_AHEAD = 64
"""Plans made ahead and not yet used, per process, at most (the oldest is dropped)."""
AHEAD_TTL_S = 120.0
"""Seconds a plan made ahead waits for its request before it is dropped."""
TWIN_SUFFIX = ".twin"
"""A sampled plan's twin ticket: its ticket with this suffix."""
TWIN_TTL_S = 600.0
"""Seconds a sampled plan waits for its twins (sent after the response, which may stream long)."""


@dataclass
class Ahead:
    """A plan made ahead (``ServerPlanner.plan_ahead``) for the request with ``token_ids``;
    ``preamble``: its preamble's real KV, rotated at its positions, once the preamble request ran."""

    engine: ReuseEngine
    plan: ReusePlan
    tenant: str
    token_ids: tuple[int, ...]
    made_at: float
    preamble: KV | None = None


@dataclass
class PlannedRequest:
    """One annotated request: its plan and the order for the connector."""

    engine: ReuseEngine
    plan: ReusePlan
    order: Order
    tenant: str = "default"
    preamble: KV | None = None
    """The plan's preamble's KV (computed by the preamble request), learned with the prompt."""
    preamble_of: Ahead | None = None
    """Set on a preamble request: the plan made ahead whose preamble it computes."""
    purpose: str = "client"
    """``params.purpose``: a client's request, a preamble request (``preamble_of`` set) or one of the
    quality guard's twins of a sampled plan; all but a client's are counted nowhere."""
    learns: bool = True
    """Whether ``finish`` learns from it: all but the reuse twin (served a plan already learned from)."""

    @property
    def learns_prompt(self) -> bool:
        """Whether ``finish`` learns from its prompt's captured KV (a client's request, a dense
        twin): the work ``WorkerPlans`` bounds per step. A preamble request only hands its KV on."""
        return self.learns and self.preamble_of is None

    def summary(self) -> dict:
        """Per-request provenance, returned in the output's ``kv_transfer_params["kvcomm"]``;
        ``reply_base``: whether ``finish`` keeps the reply's decode KV as the base of its text
        (for the tokens whose KV was computed, all but the last sampled), by the engine's rule
        (``ReuseEngine.learns_reply_from``: a scope that takes replies' bases from their decode,
        and nothing estimated in the prompt)."""
        if self.preamble_of is not None:
            start, end = self.plan.exact_length, self.plan.pieces_start
            return {"prompt_tokens": end, "exact_tokens": start, "estimated_tokens": 0, "computed_tokens": end - start,
                    "preamble_tokens": 0, "fallback": False, "purpose": "preamble",
                    "note": "computes the preamble of a request planned ahead"}
        p = self.plan.provenance()
        summary = {"prompt_tokens": p.prompt_tokens, "exact_tokens": p.exact_tokens,
                   "estimated_tokens": p.estimated_tokens, "realigned_tokens": p.realigned_tokens,
                   "computed_tokens": p.computed_tokens, "preamble_tokens": p.preamble_tokens, "fallback": p.fallback,
                   "reply_base": self.engine.uses_bases and self.engine.learns_reply_from(self.plan),
                   "note": self.plan.note, "reason": explain(p)}
        return summary if self.purpose == "client" else summary | {"purpose": self.purpose}


def annotated_prompt(token_ids: list[int], params: KvcommParams) -> Prompt:
    """Fixed segments between the (validated, sorted) annotated shared spans."""
    segments: list[Segment] = []
    at = 0
    for span in params.segments:
        if span.start > at:
            segments.append(Segment(tuple(token_ids[at : span.start])))
        segments.append(Segment(tuple(token_ids[span.start : span.end]), slot=span.slot, shared_id=span.shared_id))
        at = span.end
    if at < len(token_ids):
        segments.append(Segment(tuple(token_ids[at:])))
    return Prompt(params.template, tuple(segments))


class ServerPlanner:
    """Reuse engines per tenant (a ``TenantRegistry``: nothing shared across tenants, byte
    caps per tenant and in total) and the plan/learn cycle of annotated requests; thread-safe."""

    def __init__(
        self, rotary: Rotary, config: ReuseConfig | None = None, *,
        max_total_bytes: int | None = None, max_tenant_bytes: int | None = None, heads: HeadShards = ALL_HEADS,
        guard: GuardConfig | None = None,
    ):
        """heads: the KV heads this process holds (a tensor-parallel rank's share); the caps
        apply to what this process holds. guard: the quality guard's settings (None: none)."""
        self.rotary = rotary
        self.registry = TenantRegistry(rotary, config, max_total_bytes=max_total_bytes, max_tenant_bytes=max_tenant_bytes,
                                       head_shards=heads)
        self.config = self.registry.config
        self.totals = {"exact": 0, "estimated": 0, "computed": 0, "requests": 0, "fallbacks": 0}
        self._runs: dict[str, RunIndex] = {}
        self.ids = SegmentIds()
        self._lock = threading.Lock()
        self._ahead: OrderedDict[str, Ahead] = OrderedDict()
        self.guards = ServerGuards(guard, heads.rank, lambda: self.registry.tenants)
        self._twins: OrderedDict[str, tuple[Ahead, tuple[str, ...]]] = OrderedDict()

    @property
    def engines(self) -> dict[str, ReuseEngine]:
        return {tenant: self.registry.engine(tenant) for tenant in self.registry.tenants}

    def engine(self, tenant: str) -> ReuseEngine:
        return self.registry.engine(tenant)

    def runs(self, tenant: str) -> RunIndex:
        """Shared token runs seen in ``tenant``'s requests (automatic detection is per tenant too)."""
        with self._lock:
            return self._runs.setdefault(tenant, RunIndex())

    def prepare(
        self, token_ids: list[int], params: KvcommParams, salted: bool, max_tokens: int, tenant: str | None = None,
        adapter: str | None = None,
    ) -> PlannedRequest:
        """Plan; the order's injection is the plan's pieces (position-free KV, estimates), which
        the worker writes into the request's cache slots at load, and it captures what learning
        needs: the prompt's computed tail, and the reply only when its decode KV may become a
        base (``ReuseEngine.learns_reply_from``).
        Without annotated segments, known shared runs are detected in the prompt. A
        ``calibrate`` request is planned by ``ReuseEngine.calibration_plan``: nothing is
        reused (so it needs no cache salt) and everything its prefill reveals is learned.
        ``params.release`` / ``params.retain`` (retained contexts, set by `kvcomm serve` only)
        unpin and drop, then pin, those content ids' bases in the tenant's engine first.
        ``adapter``: the LoRA adapter's identity (None: the base model); its requests use their
        own engine in ``tenant`` (``adapter_key``)."""
        if params.ticket is not None:
            return self._planned_ahead(token_ids, params, salted, max_tokens, adapter)
        engine, prompt, tenant = self._prompt(token_ids, params, tenant, adapter)
        if params.calibrate:
            request = _request(engine, engine.calibration_plan(prompt), tenant, max_tokens)
            request.purpose = params.purpose
            return request
        if not salted:
            plan = ReusePlan(prompt)
            length, kv = engine.prefix_store.longest(prompt)
            length = min(length, len(prompt) - 1)
            plan.exact_length, plan.exact_kv = length, (kv.span(0, length) if length else None)
            plan.note = "no cache_salt: exact reuse only"
        else:
            plan = engine.plan(prompt)  # no base provider: new content's base comes from this prefill
            self.guards.restrict(tenant, engine, plan)
        return _request(engine, plan, tenant, max_tokens)

    def _prompt(self, token_ids: list[int], params: KvcommParams, tenant: str | None,
                adapter: str | None) -> tuple[ReuseEngine, Prompt, str]:
        """The request's engine (its tenant's for its adapter), prompt and engine key; detects
        shared runs when none are annotated, binds ids to content, and applies release/retain."""
        tenant = adapter_key(params.tenant if tenant is None else tenant, adapter)
        if params.segments is None:
            params = dataclasses.replace(params, segments=self.runs(tenant).find(token_ids))
        params = self.ids.bind(tenant, token_ids, params)  # keyed by content; an id reused for other tokens: refused
        prompt = annotated_prompt(token_ids, params)
        engine = self.engine(tenant)
        for shared_id in params.release:  # before planning: this request already falls back for them
            engine.unpin(shared_id)
        for shared_id in params.retain:  # before planning: a base this request registers is kept
            engine.pin(shared_id)
        return engine, prompt, tenant

    def plan_ahead(self, ticket: str, token_ids: list[int], params: KvcommParams) -> tuple[tuple[int, int] | None, str | None]:
        """Plan a salted request of the base model before it is submitted, as the in-process
        runner plans (``computes_preambles=True``), and park the plan under ``ticket`` (module docstring).
        Returns the preamble ``(start, end)`` the request's preamble request must compute
        (its prompt: the first ``end`` tokens), or None when the plan has no preamble; and the
        twin ticket when the quality guard sampled the plan (else None)."""
        if params.handle is not None or params.calibrate or params.ticket is not None:
            raise KvcommParamsError("a plan made ahead is for an annotated request without handle, calibrate or ticket")
        engine, prompt, tenant = self._prompt(token_ids, params, None, None)
        plan = engine.plan(prompt, computes_preambles=True)
        self.guards.restrict(tenant, engine, plan)
        slots = self.guards.sample(tenant, engine, plan)
        now = time.monotonic()
        ahead = Ahead(engine, plan, tenant, tuple(token_ids), now)
        twin = ticket + TWIN_SUFFIX if slots else None
        with self._lock:
            self._ahead[ticket] = ahead
            _expire(self._ahead, now - AHEAD_TTL_S, lambda a: a.made_at)
            if twin is not None:
                self._twins[twin] = (ahead, slots)
                _expire(self._twins, now - TWIN_TTL_S, lambda entry: entry[0].made_at)
        return ((plan.exact_length, plan.pieces_start) if plan.preamble_length else None), twin

    def guard_record(self, twin: str, kl: float, seconds: float) -> bool:
        """Record ``kl`` (nats, measured from the twins of the plan sampled under the twin
        ticket ``twin``; ``seconds`` they took) in its tenant's guard; False when no such
        sample is parked (expired or recorded)."""
        with self._lock:
            entry = self._twins.pop(twin, None)
        if entry is None:
            return False
        ahead, slots = entry
        self.guards.record(ahead.tenant, ahead.engine, slots, kl, seconds)
        return True

    def _planned_ahead(self, token_ids: list[int], params: KvcommParams, salted: bool, max_tokens: int,
                       adapter: str | None) -> PlannedRequest:
        """The request of a plan made ahead, its preamble request (purpose ``preamble``) or its
        reuse twin (purpose ``reuse_twin``)."""
        if params.purpose == "reuse_twin":
            return self._reuse_twin(token_ids, params, salted, adapter)
        with self._lock:
            ahead = self._ahead.get(params.ticket) if params.computes_preamble else self._ahead.pop(params.ticket, None)
        if ahead is None or adapter is not None or not salted:
            raise KvcommParamsError(f"ticket {shown(params.ticket)} names no plan made ahead in this engine for a salted "
                                    "request of the base model (expired or used); served without reuse")
        plan = ahead.plan
        start, end = plan.exact_length, plan.pieces_start
        if params.computes_preamble:
            if not plan.preamble_length or tuple(token_ids) != ahead.token_ids[:end]:
                raise KvcommParamsError(f"ticket {shown(params.ticket)}: this prompt is not the first {end} tokens of the "
                                        "planned request, or its plan computes no preamble")
            inject = Injection((exact_piece(plan),), start) if start else None
            return PlannedRequest(ahead.engine, plan, Order(inject, start, end), ahead.tenant, preamble_of=ahead, purpose="preamble")
        if tuple(token_ids) != ahead.token_ids:
            raise KvcommParamsError(f"ticket {shown(params.ticket)} was planned for another prompt")
        if plan.preamble_length and ahead.preamble is None:
            plan = _exact_only(plan, "the preamble request did not complete: reuse only of the exact prefix")
        return _request(ahead.engine, plan, ahead.tenant, max_tokens, ahead.preamble if plan.preamble_length else None)

    def _reuse_twin(self, token_ids: list[int], params: KvcommParams, salted: bool, adapter: str | None) -> PlannedRequest:
        """The reuse twin of a sampled plan: the plan served again as its request was, no
        capture, nothing learned."""
        with self._lock:
            entry = self._twins.get(params.ticket)
        if entry is None or adapter is not None or not salted or tuple(token_ids) != entry[0].token_ids:
            raise KvcommParamsError(f"twin ticket {shown(params.ticket)} names no sampled plan of this prompt in this "
                                    "engine (expired or recorded)")
        ahead = entry[0]
        if ahead.plan.preamble_length and ahead.preamble is None:
            raise KvcommParamsError("the sampled plan's preamble request did not complete: its request reused the exact "
                                    "prefix only, nothing to measure")
        twin = _request(ahead.engine, ahead.plan, ahead.tenant, 0, ahead.preamble if ahead.plan.preamble_length else None)
        return dataclasses.replace(twin, order=Order(twin.order.inject, 0, 0), purpose="reuse_twin", learns=False)

    def finish(self, planned: PlannedRequest, capture: Capture | None, reply_ids: list[int]) -> None:
        """Learn from the captured real KV of prompt positions ``[reuse_end, len(prompt))``;
        ``reply_ids`` (stop token excluded) becomes shared content with its decode KV as base
        when all of it was fed back (a reply cut by max_tokens lacks its last token's KV)."""
        plan, prompt = planned.plan, planned.plan.prompt
        if not planned.learns:
            return
        if planned.preamble_of is not None:  # a preamble request: its KV waits for the planned request
            start, end = plan.exact_length, plan.pieces_start
            if capture is not None and capture.has(start, end):
                planned.preamble_of.preamble = capture.span(start, end)
            return
        if capture is None or not capture.has(plan.reuse_end, len(prompt)):
            return  # aborted before its prefill completed: nothing to learn
        computed: KV = capture.span(plan.reuse_end, len(prompt))
        runs = self.runs(planned.tenant)
        planned.engine.learn(plan, computed, preamble=planned.preamble)  # registers the bases of new shared content too
        for segment in prompt.segments:
            if segment.is_shared:
                runs.add(segment.token_ids, segment.slot)
        n, r = len(prompt), len(reply_ids)
        if r and planned.engine.learns_at(n + r):
            reply = Segment(tuple(reply_ids), slot="_")
            if capture.has(n, n + r) and not planned.engine.has_base(reply.shared_id) and planned.engine.learns_reply_from(plan):
                planned.engine.register_base(reply, to_position_free(capture.span(n, n + r), self.rotary, n))
            runs.add(reply_ids, f"{prompt.template_id}.reply")  # a pool per producing template
        if planned.purpose == "dense_twin":  # the dense twin: learned from, counted nowhere
            record_pools(self.registry)
            return
        provenance = plan.provenance()
        with self._lock:
            self.totals["requests"] += 1
            self.totals["exact"] += provenance.exact_tokens
            self.totals["estimated"] += provenance.estimated_tokens
            self.totals["computed"] += provenance.computed_tokens
            self.totals["fallbacks"] += int(provenance.fallback)
        record_pools(self.registry)


def _request(engine: ReuseEngine, plan: ReusePlan, tenant: str, max_tokens: int, preamble: KV | None = None) -> PlannedRequest:
    """The order of ``plan``: its pieces (``preamble``, the preamble's real KV, after the exact
    prefix), written into the request's cache slots at load; the capture learning needs: the
    prompt's computed tail, and the reply only when its decode KV may become a base
    (``ReuseEngine.learns_reply_from``)."""
    parts = pieces(plan)
    if preamble is not None:
        parts.insert(1 if plan.exact_length else 0, Piece(preamble, plan.exact_length, plan.exact_length, rotate=False))
    inject = Injection(tuple(parts), plan.reuse_end) if plan.reuse_end else None
    reply = max_tokens if engine.learns_reply_from(plan) else 0
    return PlannedRequest(engine, plan, Order(inject, plan.reuse_end, len(plan.prompt) + reply), tenant, preamble)


def _expire(parked: OrderedDict, before: float, made_at) -> None:
    """Drop the oldest of ``parked`` past ``MAX_AHEAD`` entries and those made before ``before``."""
    while parked and (len(parked) > MAX_AHEAD or made_at(next(iter(parked.values()))) < before):
        parked.popitem(last=False)


def _exact_only(plan: ReusePlan, note: str) -> ReusePlan:
    """``plan`` cut to its exact prefix (its preamble and pieces computed instead)."""
    return ReusePlan(plan.prompt, exact_length=plan.exact_length, exact_kv=plan.exact_kv,
                     exact_position_free=plan.exact_position_free, new_bases=list(plan.new_bases), note=note)
