"""The worker side of server-side planning: the ``ServerPlanner`` (tenants, pools, bases,
exact prefixes, persistence, learning) lives in the process that holds the KV cache.

``WorkerPlans`` answers the scheduler's ``PlanAsk`` messages (plan, materialize, place the
order on this process's ``Channel`` under ``handle_of(req_id)``, where the worker side's
layer hooks (``vllm.worker``) find the KV to inject and put the captured KV) and learns on ``Finished``. The
scheduler sees only the ``PlanAnswer`` numbers (``vllm.messages``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvcomm.integrations.vllm.channel import Channel
from kvcomm.integrations.vllm.guard import guard_config
from kvcomm.integrations.vllm.messages import Finished, PlanAnswer, PlanAsk, handle_of
from kvcomm.integrations.vllm.request_plans import PlannedRequest, ServerPlanner

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class WorkerPlans:
    """Planned requests of one worker, from their ``PlanAsk`` to their ``Finished``.

    The planner is built on first use, on the served model's rotary numbers (read into
    ``channel.rotary`` at start-up by the worker side's ``register_kv_caches``).
    """

    def __init__(self, vllm_config: "VllmConfig", channel: Channel):
        self._vllm_config = vllm_config
        self.channel = channel
        self.planner: ServerPlanner | None = None
        self._planned: dict[str, PlannedRequest] = {}
        self.max_total_bytes = vllm_config.kv_transfer_config.get_from_extra_config("max_total_bytes", None)
        """All ranks' byte cap; the worker sets it from the device memory at start-up (``refusals.device_memory_budget``)."""
        slots = vllm_config.kv_transfer_config.get_from_extra_config("slots", None)
        self._known_slots = None if slots is None else frozenset(slots)

    def _ensure_planner(self) -> None:
        if self.planner is None:
            self.planner = make_planner(self._vllm_config, self.channel, self.max_total_bytes)

    def answer(self, ask: PlanAsk, refused: str | None) -> PlanAnswer:
        """Plan ``ask``; a failure answers with the error (that request gets no reuse)."""
        if refused is not None:
            return PlanAnswer(error=f"kvcomm is off in this engine: {refused}")
        try:
            self._ensure_planner()
            planned = self.planner.prepare(list(ask.token_ids), ask.params, salted=ask.salted, max_tokens=ask.max_tokens,
                                           adapter=ask.adapter)
            self.channel.place(handle_of(ask.req_id), planned.order)
        except Exception as error:  # a planning failure must not take the engine down
            log.exception("kvcomm: planning request %s failed; serving it without reuse", ask.req_id)
            return PlanAnswer(error=f"kvcomm planning failed ({type(error).__name__}: {error}); served without reuse")
        self._planned[ask.req_id] = planned
        inject = planned.order.inject
        return PlanAnswer(0 if inject is None else inject.length, planned.order.capture_from, planned.summary(),
                          capture_to=planned.order.capture_to)

    def plan_ahead(self, ticket: str, token_ids: list[int], kvcomm: dict, refused: str | None) -> dict:
        """``ServerPlanner.plan_ahead`` for a request `kvcomm serve` is about to submit (its
        ``kv_transfer_params["kvcomm"]`` as the middleware rewrote it): ``{"head": [start, end] | None,
        "shadow": None | {"ticket": shadow ticket, "top_k": k}}`` (``shadow``: the quality guard
        sampled the plan, ``vllm.guard``), or ``{"error": why}`` (the request is then planned in
        the step as usual)."""
        from kvcomm.integrations.vllm.params import KvcommParamsError, parse_params

        if refused is not None:
            return {"error": f"kvcomm is off in this engine: {refused}"}
        try:
            self._ensure_planner()
            params = parse_params({"kvcomm": kvcomm}, len(token_ids), self._known_slots)
            head, shadow = self.planner.plan_ahead(ticket, list(token_ids), params)
        except KvcommParamsError as error:  # the client's mistake: the engine step reports it to the request
            return {"error": str(error)[:300]}
        except Exception as error:  # a planning failure must not take the engine down
            log.warning("kvcomm: planning ahead failed (%s: %s); the request is planned in the engine step",
                        type(error).__name__, str(error)[:300])
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        if shadow is not None:
            shadow = {"ticket": shadow, "top_k": self.planner.guards.config.top_k}
        return {"head": None if head is None else list(head), "shadow": shadow}

    def guard_record(self, shadow: str, kl: float, seconds: float) -> dict:
        """``ServerPlanner.guard_record``: ``{"recorded": bool}``, or ``{"error": why}``."""
        if self.planner is None or not isinstance(shadow, str) or not isinstance(kl, (int, float)) or not kl >= 0:
            return {"error": f"nothing to record (planner {'not built' if self.planner is None else 'built'}, "
                             f"KL {str(kl)[:40]})"}
        try:
            return {"recorded": self.planner.guard_record(shadow, float(kl), float(seconds))}
        except Exception as error:  # a guard failure must not take the engine down
            log.warning("kvcomm: recording a quality guard sample failed (%s: %s)", type(error).__name__, str(error)[:300])
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}

    def finish(self, done: Finished) -> None:
        """Learn from the request's captured KV (if its prefill completed) and drop its state."""
        capture, _ = self.channel.take(handle_of(done.req_id))
        planned = self._planned.pop(done.req_id, None)
        if planned is None:
            return
        try:
            self.planner.finish(planned, capture, list(done.reply_ids))
        except Exception:  # learning is best effort: the request was already served
            log.exception("kvcomm: learning from request %s failed", done.req_id)


def tensor_parallel_heads(vllm_config: "VllmConfig"):
    """The KV heads this worker holds: all of them, or its rank's share of vLLM's tensor-parallel
    group (decisions gathered over the group's CPU (gloo) communicator)."""
    from kvcomm.core.heads import ALL_HEADS, ProcessGroupHeads

    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return ALL_HEADS
    from vllm.distributed.parallel_state import get_tp_group

    return ProcessGroupHeads(get_tp_group().cpu_group)


def _rank_share(cap: int | None, size: int) -> int | None:
    """A byte cap on all ranks together -> the cap on one rank's share (a value that is not a
    positive integer is left for ``TenantRegistry`` to refuse with its own message)."""
    if cap is None or size == 1 or isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        return cap
    return max(1, cap // size)


def restored_summary(planner: ServerPlanner) -> dict:
    """What the planner holds per tenant, in terms every tensor-parallel rank shares (its own
    heads aside): each slot's anchors by content id, and the held bases' content ids."""
    summary = {}
    for tenant in planner.registry.tenants:
        engine = planner.engine(tenant)
        summary[tenant] = ({str(slot): sorted(a.segment_id for a in pool.anchors) for slot, pool in engine.pools.items()},
                           sorted(engine.base_ids()))
    return summary


def _agree_on_restored(planner: ServerPlanner, heads) -> None:
    """Ranks that restored different states (one rank's save at exit cut short, a folder lost)
    would plan every request differently, and so reuse nothing; then every rank starts cold."""
    if heads.agree(restored_summary(planner)):
        return
    for tenant in planner.registry.tenants:
        planner.registry.drop(tenant)
    log.error("kvcomm: the tensor-parallel ranks restored different states (a rank's save was cut short or is "
              "missing); every rank starts cold")


def make_planner(vllm_config: "VllmConfig", channel: Channel, max_total_bytes: object = None) -> ServerPlanner:
    """A planner on the served model's own rotary embedding (vLLM's module, self-checked at
    start-up). With ``state_dir`` the checkpoint is also loaded with transformers, once, for
    the fingerprint of the saved state (its config and weights, under transformers' names),
    and the state is restored and then saved periodically and at exit, from this process.
    ``max_total_bytes``: the byte cap of all ranks together (``WorkerPlans.max_total_bytes``).

    Under tensor parallelism (``tensor_parallel_heads``) each rank's planner holds its heads;
    the byte caps are split evenly (a rank holds ``1/size`` of every KV and counts ``1/size`` of
    every embedding it holds whole, so a rank is over its share exactly when one process holding
    all heads would be over the cap, for caps that ``size`` divides), and
    each rank keeps its state in ``state_dir/tp{size}-rank{rank}`` (a state saved under
    another tensor-parallel size is not loaded)."""
    from kvcomm.anchors.config import PoolConfig
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.scopes import DEFAULT_SCOPE

    rotary = channel.rotary
    if rotary is None:
        raise RuntimeError("the kvcomm connector's worker side has not read the served model's rotary embedding")
    extra = vllm_config.kv_transfer_config
    pool = PoolConfig(gamma=float(extra.get_from_extra_config("gamma", PoolConfig.gamma)),
                      max_anchors=int(extra.get_from_extra_config("max_anchors", PoolConfig.max_anchors)))
    heads = tensor_parallel_heads(vllm_config)
    caps = {"max_total_bytes": _rank_share(max_total_bytes, heads.size),
            "max_tenant_bytes": _rank_share(extra.get_from_extra_config("max_tenant_bytes", None), heads.size)}
    scope = extra.get_from_extra_config("reuse_scope", DEFAULT_SCOPE)  # checked at start by the connector
    guard = guard_config(extra.get_from_extra_config("guard", None))  # checked at start by the connector
    planner = ServerPlanner(rotary, ReuseConfig(pool=pool, scope=scope), heads=heads, guard=guard, **caps)
    state_dir = extra.get_from_extra_config("state_dir", None)
    if state_dir and heads.size > 1:
        state_dir = os.path.join(state_dir, f"tp{heads.size}-rank{heads.rank}")  # each rank saves its own heads
    if state_dir:
        from kvcomm.core.fingerprint import model_fingerprint
        from kvcomm.integrations.vllm.state import PlannerState
        from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(str(vllm_config.model_config.model))
        fingerprint = model_fingerprint(model, tokenizer, rotary, kv_dtype=vllm_config.model_config.dtype)
        del model
        state = PlannerState(planner, state_dir, fingerprint, float(extra.get_from_extra_config("save_interval_s", 60.0)))
        state.restore()
        _agree_on_restored(planner, heads)
        state.start()
    return planner
