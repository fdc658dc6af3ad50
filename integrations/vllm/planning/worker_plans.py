"""The worker side of server-side planning: the ``ServerPlanner`` (tenants, pools, bases,
exact prefixes, persistence, learning) lives in the process that holds the KV cache.

``WorkerPlans`` answers the scheduler's ``PlanAsk`` messages (plan, materialize, place the
order on this process's ``Channel`` under ``handle_of(req_id)``, where the worker side's
layer hooks (``vllm.connector.worker``) find the KV to inject and put the captured KV) and learns on ``Finished``. The
scheduler sees only the ``PlanAnswer`` numbers (``vllm.wire.messages``) and which captures were let go.

Learning runs in the engine step, so it is bounded per step: a finished request's capture waits
in a queue, and each step learns from the oldest ones until ``LEARN_POSITIONS_PER_STEP``
captured positions (at least one request per step). One request finishing at a time is learned
in the step after it finishes, as before; a burst of long requests that finish together is
learned over the following steps (and the rest of a burst waits for the next step if the
server goes idle), its capture bytes held until then. A quality guard's dense twin, learned from
as a client's request is, waits in the same queue; preamble requests and reuse twins are taken
at once (nothing to learn but a preamble's KV). Every rank learns the same requests in the same
steps: the budget counts positions, not time. Requests still queued when the server stops are
not learned from.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import TYPE_CHECKING

from kvcomm.integrations.vllm.wire.channel import Capture, Channel
from kvcomm.integrations.vllm.wire.config import ConnectorConfig
from kvcomm.integrations.vllm.planning.host_memory import Trimmer
from kvcomm.integrations.vllm.wire.messages import Finished, PlanAnswer, PlanAsk, handle_of
from kvcomm.integrations.vllm.planning.server_planner import PlannedRequest, ServerPlanner

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
LEARN_POSITIONS_PER_STEP = 1024
"""Captured positions learned from per engine step, at most (and at least one request): one
request of 900 positions costs ~60 ms of one CPU core with SmolLM2-135M in fp32 (three copies of
its KV), so a step stays far under 200 ms (docs/measurements/2026-12-06-serve-hardening.md)."""


class WorkerPlans:
    """Planned requests of one worker, from their ``PlanAsk`` to their ``Finished``.

    The planner is built at start-up (``start``, from the worker side's ``register_kv_caches``,
    on the served model's rotary numbers it read into ``channel.rotary``), restoring any saved
    state then, before the engine serves: the first request after a restart is planned like any
    other (it used to build the planner, and restore gigabytes, inside its engine step).
    """

    def __init__(self, vllm_config: "VllmConfig", channel: Channel, config: ConnectorConfig):
        self._vllm_config = vllm_config
        self._config = config
        self.channel = channel
        self.planner: ServerPlanner | None = None
        self.trimmer: Trimmer | None = None
        """Returns the host memory learning and eviction free (``vllm.planning.host_memory``); built with the planner."""
        self._planned: dict[str, PlannedRequest] = {}
        self._learning: deque[tuple[Finished, PlannedRequest, Capture]] = deque()
        self._released: list[str] = []
        self.max_total_bytes = config.max_total_bytes
        """All ranks' byte cap; the worker sets it from the device memory at start-up (``refusals.device_memory_budget``)."""
        self._known_slots = config.slots

    def start(self) -> str | None:
        """Build the planner now when server-side planning is on (``plan`` in the connector's
        extra config); returns why it could not be built (the connector is then refused), else None."""
        if not self._config.plan:
            return None
        try:
            self._ensure_planner()
        except Exception as error:  # refused at start-up, never inside a forward
            log.exception("kvcomm: building the server-side planner failed")
            return f"the server-side planner could not be built ({type(error).__name__}: {str(error)[:300]})"
        return None

    def _ensure_planner(self) -> None:
        if self.planner is None:
            self.planner = make_planner(self._vllm_config, self.channel, self._config, self.max_total_bytes)
            self.trimmer = Trimmer()

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
        ``kv_transfer_params["kvcomm"]`` as the middleware rewrote it): ``{"preamble": [start, end] | None,
        "twin": None | {"ticket": twin ticket, "top_k": k}}`` (``twin``: the quality guard
        sampled the plan, ``vllm.planning.guard``), or ``{"error": why}`` (the request is then planned in
        the step as usual)."""
        from kvcomm.integrations.vllm.wire.params import KvcommParamsError, parse_params

        if refused is not None:
            return {"error": f"kvcomm is off in this engine: {refused}"}
        try:
            self._ensure_planner()
            params = parse_params({"kvcomm": kvcomm}, len(token_ids), self._known_slots)
            preamble, twin = self.planner.plan_ahead(ticket, list(token_ids), params)
        except KvcommParamsError as error:  # the client's mistake: the engine step reports it to the request
            return {"error": str(error)[:300]}
        except Exception as error:  # a planning failure must not take the engine down
            log.warning("kvcomm: planning ahead failed (%s: %s); the request is planned in the engine step",
                        type(error).__name__, str(error)[:300])
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        if twin is not None:
            twin = {"ticket": twin, "top_k": self.planner.guards.config.top_k}
        return {"preamble": None if preamble is None else list(preamble), "twin": twin}

    def guard_record(self, twin: str, kl: float, seconds: float) -> dict:
        """``ServerPlanner.guard_record``: ``{"recorded": bool}``, or ``{"error": why}``."""
        if self.planner is None or not isinstance(twin, str) or not isinstance(kl, (int, float)) or not kl >= 0:
            return {"error": f"nothing to record (planner {'not built' if self.planner is None else 'built'}, "
                             f"KL {str(kl)[:40]})"}
        try:
            return {"recorded": self.planner.guard_record(twin, float(kl), float(seconds))}
        except Exception as error:  # a guard failure must not take the engine down
            log.warning("kvcomm: recording a quality guard sample failed (%s: %s)", type(error).__name__, str(error)[:300])
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}

    def finish(self, done: Finished) -> None:
        """Take the finished request's captured KV off the channel and queue it for ``learn``
        (a client's request or a dense twin: both are learned from); a preamble request's KV
        (wanted by the next plan), a reuse twin and a request with nothing captured are handled
        at once."""
        capture, _ = self.channel.take(handle_of(done.req_id))
        planned = self._planned.pop(done.req_id, None)
        if planned is not None and capture is not None and planned.learns_prompt:
            self._learning.append((done, planned, capture))
            return
        if planned is not None:
            self._finish(done, planned, capture)
        self._released.append(done.req_id)

    def learn(self) -> tuple[str, ...]:
        """Learn from the oldest queued requests, up to ``LEARN_POSITIONS_PER_STEP`` captured
        positions (at least one request); returns the requests whose captures were let go since
        the last call (learned, or taken at once by ``finish``)."""
        spent = 0
        while self._learning and (not spent or spent + self._learning[0][2].filled.numel() <= LEARN_POSITIONS_PER_STEP):
            done, planned, capture = self._learning.popleft()
            spent += capture.filled.numel()
            self._finish(done, planned, capture)
            self._released.append(done.req_id)
        released, self._released = tuple(self._released), []
        if released and self.trimmer is not None:
            self.trimmer.released()
        return released

    @property
    def queued(self) -> int:
        """Finished requests waiting to be learned from."""
        return len(self._learning)

    def _finish(self, done: Finished, planned: PlannedRequest, capture: Capture | None) -> None:
        try:
            self.planner.finish(planned, capture, list(done.reply_ids))
        except Exception:  # learning is best effort: the request was already served
            log.exception("kvcomm: learning from request %s failed", done.req_id)


def tensor_parallel_heads(vllm_config: "VllmConfig"):
    """The KV heads this worker holds: all of them, or its rank's share of vLLM's tensor-parallel
    group (partials gathered over the group's device communicator where it carries the KV's
    device, NCCL on a GPU, else over its CPU (gloo) communicator)."""
    from kvcomm.core.heads import ALL_HEADS, ProcessGroupHeads

    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return ALL_HEADS
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return ProcessGroupHeads(group.cpu_group, group.device_group)


def _rank_share(cap: int | None, size: int) -> int | None:
    """A byte cap on all ranks together (None, or a positive integer: ``ConnectorConfig``
    checked it) -> the cap on one rank's share."""
    if cap is None or size == 1:
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


def make_planner(vllm_config: "VllmConfig", channel: Channel, config: ConnectorConfig,
                 max_total_bytes: int | None = None) -> ServerPlanner:
    """A planner on the served model's own rotary embedding (vLLM's module, self-checked at
    start-up), with the connector's settings ``config``. With ``state_dir`` the checkpoint is also loaded with transformers, once, for
    the fingerprint of the saved state (its config and weights, under transformers' names),
    and the state is restored and then saved periodically and at exit, from this process.
    ``max_total_bytes``: the byte cap of all ranks together (``WorkerPlans.max_total_bytes``; None:
    no cap).

    Under tensor parallelism (``tensor_parallel_heads``) each rank's planner holds its heads;
    the byte caps are split evenly (a rank holds ``1/size`` of every KV and counts ``1/size`` of
    every embedding it holds whole, so a rank is over its share exactly when one process holding
    all heads would be over the cap, for caps that ``size`` divides), and
    each rank keeps its state in ``state_dir/tp{size}-rank{rank}`` (a state saved under
    another tensor-parallel size is not loaded)."""
    from kvcomm.anchors.config import PoolConfig
    from kvcomm.reuse.config import ReuseConfig

    rotary = channel.rotary
    if rotary is None:
        raise RuntimeError("the kvcomm connector's worker side has not read the served model's rotary embedding")
    pool = PoolConfig(gamma=config.gamma, max_anchors=config.max_anchors)
    heads = tensor_parallel_heads(vllm_config)
    caps = {"max_total_bytes": _rank_share(max_total_bytes, heads.size),
            "max_tenant_bytes": _rank_share(config.max_tenant_bytes, heads.size)}
    planner = ServerPlanner(rotary, ReuseConfig(pool=pool, scope=config.reuse_scope), heads=heads, guard=config.guard,
                            **caps)
    state_dir = config.state_dir
    if state_dir and heads.size > 1:
        state_dir = os.path.join(state_dir, f"tp{heads.size}-rank{heads.rank}")  # each rank saves its own heads
    if state_dir:
        from kvcomm.core.fingerprint import model_fingerprint
        from kvcomm.integrations.vllm.planning.planner_state import PlannerState
        from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(str(vllm_config.model_config.model))
        fingerprint = model_fingerprint(model, tokenizer, rotary, kv_dtype=vllm_config.model_config.dtype)
        del model
        state = PlannerState(planner, state_dir, fingerprint, config.save_interval_s)
        state.restore()
        _agree_on_restored(planner, heads)
        state.start()
    return planner
