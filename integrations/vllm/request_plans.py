"""Server-side reuse planning for requests annotated with shared segments
(``kv_transfer_params["kvcomm"]["segments"]``, see ``vllm.params``).

Runs in vLLM's worker process (``vllm.worker_plans``, the connector's worker side), one ``ReuseEngine``
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
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from kvcomm.reuse.config import ReuseConfig

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV, to_position_free
from kvcomm.reuse.plan import ReusePlan
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment
from kvcomm.services.tenants import TenantRegistry, adapter_key
from kvcomm.integrations.vllm.channel import Capture, Injection, Order
from kvcomm.reuse.assemble import pieces
from kvcomm.integrations.vllm.detect import RunIndex
from kvcomm.integrations.vllm.ids import SegmentIds
from kvcomm.integrations.vllm.metrics import record_pools
from kvcomm.integrations.vllm.params import KvcommParams


@dataclass
class PlannedRequest:
    """One annotated request: its plan and the order for the connector."""

    engine: ReuseEngine
    plan: ReusePlan
    order: Order
    tenant: str = "default"

    def summary(self) -> dict:
        """Per-request provenance, returned in the output's ``kv_transfer_params["kvcomm"]``."""
        p = self.plan.provenance()
        return {"prompt_tokens": p.prompt_tokens, "exact_tokens": p.exact_tokens,
                "estimated_tokens": p.estimated_tokens, "computed_tokens": p.computed_tokens,
                "fallback": p.fallback, "note": self.plan.note}


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
    ):
        """heads: the KV heads this process holds (a tensor-parallel rank's share); the caps
        apply to what this process holds."""
        self.rotary = rotary
        self.registry = TenantRegistry(rotary, config, max_total_bytes=max_total_bytes, max_tenant_bytes=max_tenant_bytes,
                                       heads=heads)
        self.config = self.registry.config
        self.totals = {"exact": 0, "estimated": 0, "computed": 0, "requests": 0, "fallbacks": 0}
        self._runs: dict[str, RunIndex] = {}
        self.ids = SegmentIds()
        self._lock = threading.Lock()

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
        if params.calibrate:
            plan = engine.calibration_plan(prompt)
        elif not salted:
            plan = ReusePlan(prompt)
            length, kv = engine.prefix_store.longest(prompt)
            length = min(length, len(prompt) - 1)
            plan.exact_length, plan.exact_kv = length, (kv.span(0, length) if length else None)
            plan.note = "no cache_salt: exact reuse only"
        else:
            plan = engine.plan(prompt)  # no base provider: new content's base comes from this prefill
        inject = Injection(tuple(pieces(plan)), plan.reuse_end) if plan.reuse_end else None  # written at load, into the slots
        reply = max_tokens if engine.learns_reply_from(plan) else 0
        return PlannedRequest(engine, plan, Order(inject, plan.reuse_end, len(prompt) + reply), tenant)

    def finish(self, planned: PlannedRequest, capture: Capture | None, reply_ids: list[int]) -> None:
        """Learn from the captured real KV of prompt positions ``[reuse_end, len(prompt))``;
        ``reply_ids`` (stop token excluded) becomes shared content with its decode KV as base
        when all of it was fed back (a reply cut by max_tokens lacks its last token's KV)."""
        plan, prompt = planned.plan, planned.plan.prompt
        if capture is None or not capture.has(plan.reuse_end, len(prompt)):
            return  # aborted before its prefill completed: nothing to learn
        computed: KV = capture.span(plan.reuse_end, len(prompt))
        runs = self.runs(planned.tenant)
        planned.engine.learn(plan, computed)  # registers the bases of new shared content too
        for segment in prompt.segments:
            if segment.is_shared:
                runs.add(segment.token_ids, segment.slot)
        n, r = len(prompt), len(reply_ids)
        if r and planned.engine.learns_at(n + r):
            reply = Segment(tuple(reply_ids), slot="_")
            if capture.has(n, n + r) and not planned.engine.has_base(reply.shared_id) and planned.engine.learns_reply_from(plan):
                planned.engine.register_base(reply, to_position_free(capture.span(n, n + r), self.rotary, n))
            runs.add(reply_ids, f"{prompt.template_id}.reply")  # a pool per producing template
        provenance = plan.provenance()
        with self._lock:
            self.totals["requests"] += 1
            self.totals["exact"] += provenance.exact_tokens
            self.totals["estimated"] += provenance.estimated_tokens
            self.totals["computed"] += provenance.computed_tokens
            self.totals["fallbacks"] += int(provenance.fallback)
        record_pools(self.registry)
