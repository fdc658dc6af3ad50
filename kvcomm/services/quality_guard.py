"""Quality guard: measure what estimated reuse costs on live traffic and back
off per slot when it costs too much.

For a sampled fraction of the requests that reused stored KV beyond the exact prefix
(estimated or realigned), the guard also runs the dense prefill of the same prompt, its twin,
and records KL(dense || reuse) of the first reply token's distribution (top-k + "other"
bucket, as the evaluation computes it: a lower bound of the full KL). Each slot whose content
was served in that request gets the sample. The budget is ``QUALITY_BUDGET`` (5) times the
model's first-token KL floor (``GuardConfig.for_floor``), on by default in `kvcomm eval` and
`kvcomm serve`; `kvcomm run`, `kvcomm demo` and the in-process clients run without it.
When a slot's rolling mean exceeds the budget, the guard acts and logs why:

- ``"tighten"``: multiply the slot pool's gamma by ``tighten_factor`` (``AnchorPool.set_gamma``; the entropy rule reuses
  when H <= gamma * log(n), so a lower gamma means fewer reuses), and after
  ``max_tightenings`` such steps disable the slot;
- ``"disable"``: disable the slot at once.

Admission adapts both ways: a tightened slot whose rolling mean over a full window stays at
or below ``loosen_below * budget`` gets one tightening back (gamma divided by
``tighten_factor``, never above the gamma it had before the guard first tightened it). The gap
between the two thresholds keeps a slot from flapping on every sample.

With ``learn`` (the default), the twin also teaches the engine: its KV is computed densely from the
first token, so the engine learns from it as from a calibration request
(``ReuseEngine.calibration_plan``): every shared segment whose content has a base is recorded in
its slot's pool, which a request that estimated never does.

A disabled slot's estimated pieces are cut from every later plan (``restrict``), so reuse
stops before its content and the rest is computed densely. One guard serves one engine
(slot names are per engine; give each tenant its own guard).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.divergence import kl_topk_other, topk_reference
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.runner import computes_preambles, execute, run_agent
from kvcomm.core.segments import Prompt

log = logging.getLogger("kvcomm.services.quality_guard")
ACTIONS = ("tighten", "disable")
SLOT_METRICS = {
    "kl_mean": "Rolling mean KL(dense || reuse) of the first reply token, nats (top-k + other: a lower bound)",
    "kl_last": "Latest measured KL(dense || reuse) of the first reply token, nats",
    "samples": "Shadowed requests recorded for the slot",
    "tightenings": "Tightenings of the slot's gamma in force (lowered minus raised back)",
    "loosenings": "Times the guard raised the slot's gamma back after a full window well within budget",
    "disabled": "1 when the guard disabled reuse for the slot",
    "gamma": "The slot pool's admission gamma now",
}
"""The per-slot numbers of ``QualityGuard.metrics()`` and what each means (for exporters)."""


QUALITY_BUDGET = 5.0
"""The quality budget, in the unit a user reads: a slot's rolling mean first-token KL may reach
this many times the model's precision floor (first-token KL of dense in the serving dtype
against the other, ``kvcomm.eval.kl_floor``); R4's "no measurable change". `kvcomm eval` and
`kvcomm serve` hold every slot to it by default (``GuardConfig.for_floor``)."""

DEFAULT_FRACTION = 0.05
"""Share of reusing requests the guard twins: at most 5 dense twins per 100 requests (each a
dense prefill of the request's prompt, after its reply)."""


@dataclass(frozen=True)
class GuardConfig:
    """budget: the most KL (nats, first-token distribution) a slot's rolling mean may reach;
    ``for_floor`` sets it as ``QUALITY_BUDGET`` times the model's floor (the one setting a user
    chooses). fraction: share of requests with reused KV that are measured against a dense twin, in [0, 1] (the
    cost: ``100 * fraction`` dense twins per 100 such requests at most). window: samples in the
    rolling mean. min_samples: samples before the guard acts. action, tighten_factor,
    max_tightenings: see the module docs. loosen_below: share of the budget a full window's
    mean must stay at or below to undo one tightening, in [0, 1) (0: never loosen). top_k:
    tokens kept before the "other" bucket. seed: the sampling RNG's seed. learn: the twins'
    dense prefills teach the engine (their anchors and the slots' evidence: the only way a
    slot whose plans serve realigned KV learns, ``kvcomm.reuse.strategies.estimate``)."""

    budget: float
    fraction: float = DEFAULT_FRACTION
    window: int = 20
    min_samples: int = 3
    action: str = "tighten"
    tighten_factor: float = 0.5
    max_tightenings: int = 3
    loosen_below: float = 0.25
    top_k: int = 20
    seed: int = 0
    learn: bool = True

    @classmethod
    def for_floor(cls, floor: float, times: float = QUALITY_BUDGET, **settings) -> "GuardConfig":
        """The guard holding every slot to ``times`` x ``floor``: the model's first-token KL floor
        in nats (``kvcomm.eval.kl_floor``), ``times`` >= 0 (0: any measured cost is over budget)."""
        if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor >= 0):
            raise ValueError(f"the precision floor must be a finite number of nats >= 0 (got {floor!r})")
        if not (isinstance(times, (int, float)) and math.isfinite(times) and times >= 0):
            raise ValueError(f"the quality budget must be a finite multiple of the floor >= 0 (got {times!r})")
        return cls(budget=float(times) * float(floor), **settings)

    @property
    def twins_per_100(self) -> float:
        """The most dense twins the guard runs per 100 reusing requests."""
        return 100.0 * self.fraction

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.fraction <= 1:
            problems.append(f"fraction must be in [0, 1] (got {self.fraction})")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not self.budget >= 0:
            problems.append(f"budget must be >= 0 nats (got {self.budget})")
        if not 1 <= self.min_samples <= self.window:
            problems.append(f"need 1 <= min_samples <= window (got {self.min_samples}, {self.window})")
        if self.action not in ACTIONS:
            problems.append(f"action must be one of {', '.join(ACTIONS)} (got {self.action!r})")
        if not 0 < self.tighten_factor < 1:
            problems.append(f"tighten_factor must be in (0, 1) (got {self.tighten_factor})")
        if not 0 <= self.loosen_below < 1:
            problems.append(f"loosen_below must be in [0, 1) (got {self.loosen_below})")
        if self.max_tightenings < 0 or self.top_k < 1:
            problems.append(f"max_tightenings must be >= 0 and top_k >= 1 (got {self.max_tightenings}, {self.top_k})")
        if problems:
            raise ValueError("invalid quality guard config: " + "; ".join(problems))


@dataclass
class SlotQuality:
    """What the guard knows about one slot (pool)."""

    recent: deque = field(default_factory=deque)
    samples: int = 0
    last_kl: float | None = None
    tightenings: int = 0
    loosenings: int = 0
    gamma_before: float | None = None
    """The slot pool's gamma before the guard first tightened it: the most loosening restores."""
    disabled: bool = False
    reason: str = ""

    @property
    def mean(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None


class QualityGuard:
    def __init__(self, config: GuardConfig):
        self.config = config
        self.slots: dict[str, SlotQuality] = {}
        self.measured = 0
        self.twin_seconds = 0.0
        self._engine: ReuseEngine | None = None
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()

    @property
    def engine(self) -> ReuseEngine | None:
        """The engine this guard serves (None until its first request)."""
        return self._engine

    def bind(self, engine: ReuseEngine) -> None:
        """Serve ``engine`` (ValueError when this guard already serves another)."""
        if self._engine is None:
            self._engine = engine
        elif self._engine is not engine:
            raise ValueError("a QualityGuard serves one engine; create one guard per engine (per tenant)")

    def _slot(self, slot: str) -> SlotQuality:
        return self.slots.setdefault(slot, SlotQuality(deque(maxlen=self.config.window)))

    def disabled(self, slot: str) -> bool:
        return slot in self.slots and self.slots[slot].disabled

    # -- per request ---------------------------------------------------------------------------

    def run_agent(
        self, executor, engine: ReuseEngine | None, prompt: Prompt, max_new_tokens: int, keep_logprobs: bool = False,
        on_token=None, calibrate: bool = False,
    ):
        """``kvcomm.run_agent`` under this guard: the plan is cut at slots it disabled
        (``restrict``), and a sampled request that estimated KV is also prefilled densely to
        record its first-token KL (``measure``). Dense and calibration calls pass unguarded."""
        if engine is None or calibrate:
            return run_agent(executor, engine, prompt, max_new_tokens, keep_logprobs, on_token, calibrate)
        started = time.perf_counter()
        plan = engine.plan(prompt, engine.base_provider(executor), computes_preambles(executor))
        self.restrict(engine, plan)
        slots = self.sample(plan)
        generation = execute(executor, engine, plan, max_new_tokens, started, keep_logprobs or bool(slots), on_token)
        engine.learn(plan, generation.computed, generation.reply_ids, generation.reply_kv, generation.preamble)
        if slots:
            self.measure(executor, engine, prompt, generation.prompt_logprobs[-1], slots)
        return generation, plan.provenance(generation.ttft_s, generation.cached_tokens)

    def restrict(self, engine: ReuseEngine, plan: ReusePlan) -> None:
        """Cut ``plan`` (before materializing) at its first piece whose shared segment's slot
        is disabled; everything from there on is computed densely."""
        self.bind(engine)
        for i, piece in enumerate(plan.pieces):
            segment = plan.prompt.segments[piece.segment_index]
            if segment.is_shared and self.disabled(segment.slot):
                plan.cut(i, f"quality guard: reuse disabled for slot {segment.slot!r} ({self.slots[segment.slot].reason})")
                return

    def sample(self, plan: ReusePlan) -> tuple[str, ...]:
        """The slots to attribute a twin sample of this request to, or () to not measure it."""
        slots = tuple(dict.fromkeys(
            plan.prompt.segments[p.segment_index].slot for p in plan.pieces
            if plan.prompt.segments[p.segment_index].is_shared
        ))
        if not slots or plan.estimated_tokens == 0:
            return ()
        with self._lock:
            return slots if self._rng.random() < self.config.fraction else ()

    def measure(self, executor, engine: ReuseEngine, prompt: Prompt, reuse_logprobs: torch.Tensor, slots: tuple[str, ...]) -> float:
        """Run the dense prefill of ``prompt``, record KL(dense || reuse) of the first-token
        distribution (``reuse_logprobs``: ``[vocab]`` log-softmax) for ``slots`` and act on it;
        with ``config.learn`` the engine learns from the prefill."""
        started = time.perf_counter()
        generation = executor.generate(prompt.token_ids, None, 1, started, keep_logprobs=True)
        if self.config.learn:
            engine.learn(engine.calibration_plan(prompt, engine.base_provider(executor)), generation.computed)
        dense = generation.prompt_logprobs[-1]
        kl = float(kl_topk_other(topk_reference(dense[None].float(), self.config.top_k), reuse_logprobs[None].float())[0])
        self.record(engine, slots, kl, time.perf_counter() - started)
        return kl

    def record(self, engine: ReuseEngine, slots: tuple[str, ...], kl: float, seconds: float = 0.0) -> None:
        """Record one twin sample measured elsewhere (e.g. by `kvcomm serve`'s twin requests):
        ``kl`` nats of KL(dense || reuse) of the first reply token for ``slots`` of ``engine``,
        ``seconds`` spent measuring it; act on it as ``measure`` does."""
        self.bind(engine)
        with self._lock:
            self.measured += 1
            self.twin_seconds += seconds
            for slot in slots:
                self._record(engine, slot, kl)

    def _record(self, engine: ReuseEngine, slot: str, kl: float) -> None:
        state = self._slot(slot)
        state.recent.append(kl)
        state.samples += 1
        state.last_kl = kl
        mean = state.mean
        if state.disabled or len(state.recent) < self.config.min_samples:
            return
        pool = engine.pool(slot)
        if mean <= self.config.budget:
            if state.tightenings and len(state.recent) == self.config.window and mean <= self.config.loosen_below * self.config.budget:
                self._loosen(state, pool, slot, mean)
            return
        why = f"mean KL {mean:.4g} over the last {len(state.recent)} measured requests exceeds budget {self.config.budget:g}"
        if self.config.action == "tighten" and state.tightenings < self.config.max_tightenings:
            if state.gamma_before is None:
                state.gamma_before = pool.config.gamma
            gamma = pool.config.gamma * self.config.tighten_factor
            pool.set_gamma(gamma)
            state.tightenings += 1
            state.reason = f"{why}: gamma lowered to {gamma:.4g} (fewer reuses)"
            state.recent.clear()  # judge the new gamma on its own samples
        else:
            state.disabled = True
            state.reason = f"{why}: reuse disabled"
        log.warning("quality guard, slot %r: %s", slot, state.reason)

    def _loosen(self, state: SlotQuality, pool, slot: str, mean: float) -> None:
        """Undo one tightening of ``slot`` (a full window well within budget)."""
        gamma = min(pool.config.gamma / self.config.tighten_factor, state.gamma_before)
        pool.set_gamma(gamma)
        state.tightenings -= 1
        state.loosenings += 1
        state.reason = (f"mean KL {mean:.4g} over the last {len(state.recent)} measured requests is at most "
                        f"{self.config.loosen_below:g} x budget {self.config.budget:g}: gamma raised to {gamma:.4g}")
        state.recent.clear()  # judge the new gamma on its own samples
        log.info("quality guard, slot %r: %s", slot, state.reason)

    # -- export --------------------------------------------------------------------------------

    def metrics(self) -> dict:
        """Numbers for a metrics exporter: measured requests, seconds spent on twins, and per
        slot the rolling mean / last KL, samples, current gamma, tightenings (net of loosenings),
        loosenings, disabled."""
        with self._lock:
            pools = self._engine.pools if self._engine is not None else {}
            return {
                "measured": self.measured, "twin_seconds": self.twin_seconds, "budget": self.config.budget,
                "slots": {
                    slot: {
                        "kl_mean": s.mean, "kl_last": s.last_kl, "samples": s.samples, "tightenings": s.tightenings,
                        "loosenings": s.loosenings,
                        "disabled": s.disabled, "reason": s.reason,
                        "gamma": pools[slot].config.gamma if slot in pools else None,
                    } for slot, s in self.slots.items()
                },
            }
