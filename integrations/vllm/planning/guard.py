"""The quality guard in the kvcomm connector (``kvcomm.services.quality_guard``): one guard per
engine of the server's planner (a tenant, or a tenant's adapter), set by
``kv_connector_extra_config["guard"] = {"budget": nats, "fraction": share}`` (`kvcomm serve
--guard-budget/--guard-fraction`), checked when the connector starts (``vllm.wire.config.guard_config``).

- Every plan of a guarded engine, made ahead or in the engine step, is cut at the first slot
  the guard disabled (``ServerGuards.restrict``).
- A plan made ahead (``ServerPlanner.plan_ahead``) that estimates KV is sampled with the
  guard's fraction (``ServerGuards.sample``); `kvcomm serve` then measures it after the
  response (``serve.twins``): a dense twin (the prompt with no kvcomm, under the tenant's
  plain salt; the first token's top-k log-probabilities) and a reuse twin (the same plan served
  again through its twin ticket, learning nothing; the log-probabilities of the dense twin's
  top-k tokens) give KL(dense || reuse) over the top-k tokens and an "other" bucket (a lower
  bound of the full KL), recorded on every rank (``ServerGuards.record``, through
  ``vllm.connector.worker_extension``). The guard tightens or disables the slots as in process.

Requests planned in the engine step (chat routes, text prompts, adapters) are restricted but not
sampled: their plans are not kept for a twin. Every rank samples alike (the same seed, the same
plans in the same order). Guard numbers are exported by rank 0 (``metrics.record_guard``).
"""

from __future__ import annotations

from typing import Callable, Collection

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.plan import ReusePlan
from kvcomm.services.quality_guard import GuardConfig, QualityGuard
from kvcomm.integrations.vllm.planning.metrics import record_guard

class ServerGuards:
    """The planner's guards, one per engine key (module docstring). ``config`` None: no guard,
    and every method does nothing. ``rank``: this process's tensor-parallel rank. ``live``: the
    engine keys that exist now (when a guard is made, the guards of others are dropped)."""

    def __init__(self, config: GuardConfig | None, rank: int = 0, live: Callable[[], Collection[str]] = tuple):
        self.config = config
        self.rank = rank
        self._live = live
        self._guards: dict[str, QualityGuard] = {}

    def guard(self, tenant: str, engine: ReuseEngine) -> QualityGuard | None:
        """``tenant``'s guard (made on first use; a new one when the tenant's engine was dropped
        and made again)."""
        if self.config is None:
            return None
        guard = self._guards.get(tenant)
        if guard is None or guard.engine is not engine:
            live = set(self._live())
            self._guards = {key: g for key, g in self._guards.items() if key in live}
            guard = self._guards[tenant] = QualityGuard(self.config)
            guard.bind(engine)
        return guard

    def restrict(self, tenant: str, engine: ReuseEngine, plan: ReusePlan) -> None:
        """Cut ``plan`` at the first slot ``tenant``'s guard disabled."""
        guard = self.guard(tenant, engine)
        if guard is not None:
            guard.restrict(engine, plan)

    def sample(self, tenant: str, engine: ReuseEngine, plan: ReusePlan) -> tuple[str, ...]:
        """The slots a twin measurement of ``plan`` is recorded for, or () to not sample it."""
        guard = self.guard(tenant, engine)
        return () if guard is None else guard.sample(plan)

    def record(self, tenant: str, engine: ReuseEngine, slots: tuple[str, ...], kl: float, seconds: float) -> None:
        """Record a measured ``kl`` (nats) for ``slots`` of ``tenant``'s guard, and export it."""
        guard = self.guard(tenant, engine)
        if guard is None:
            return
        guard.record(engine, slots, kl, seconds)
        if self.rank == 0:
            record_guard(tenant, guard.metrics())
