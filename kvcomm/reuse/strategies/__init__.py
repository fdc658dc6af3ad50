"""Plan strategies: how a plan serves the prompt after its exact prefix, one file each.

Every plan starts with the longest exact prefix (``ReuseEngine.plan``); a strategy then adds
the pieces it can serve, in prompt order, up to the first segment it cannot. Where the executor
computes preambles, text right after the exact prefix that no stored KV serves (an agent's unseen
system prompt) may be computed first and the pieces start after it (``realign.preamble_before``). A mode
(``ReuseConfig.mode``) is a strategy, optionally followed by a selective recompute of the
estimated tokens (``recompute``: CacheBlend's step, run by the executor).

- ``exact``: the exact prefix only.
- ``realign``: every segment with a stored base, RoPE-realigned, no deviation.
- ``kvcomm``: anchor-estimated shared segments (KVCOMM); what the anchors cannot estimate once
  the plan has estimated is served realigned.
- ``cacheblend``: ``realign``, then CacheBlend's recompute (Yao et al. 2024).
- ``kvblend``: ``kvcomm``, then CacheBlend's recompute.

A strategy is ``(PlanContext) -> Serving``: it reads the prompt, its exact prefix and the
engine's stored KV through the context (``strategies/context.py``) and returns what it decided:
a preamble's end, the pieces in prompt order, the segments to learn from and why reuse
stops (``kvcomm.reuse.plan.Serving``). The engine hands that to ``ReusePlan.serve``; a strategy
never changes the plan (asking for new content's base may have the engine compute and keep it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvcomm.reuse.plan import Serving
from kvcomm.reuse.strategies.context import PlanContext
from kvcomm.reuse.strategies.estimate import plan_estimates
from kvcomm.reuse.strategies.realign import plan_realigned


def plan_exact(context: PlanContext) -> Serving:
    """Mode "exact": nothing beyond the exact prefix."""
    serving = context.serving()
    serving.stop("mode exact: exact prefix only")
    return serving


@dataclass(frozen=True)
class Mode:
    """A plan strategy and whether a selective recompute of its estimated tokens follows."""

    strategy: Callable[[PlanContext], Serving]
    recompute: bool = False
    uses_bases: bool = True
    """Whether its plans serve shared content from base KV (so replies are worth keeping as bases)."""
    estimates: bool = False
    """Whether its plans estimate from anchor pools (so calibration fills the pools)."""


MODES: dict[str, Mode] = {
    "kvcomm": Mode(plan_estimates, estimates=True),
    "exact": Mode(plan_exact, uses_bases=False),
    "realign": Mode(plan_realigned),
    "cacheblend": Mode(plan_realigned, recompute=True),
    "kvblend": Mode(plan_estimates, recompute=True, estimates=True),
}
"""Reuse modes by name (dense prefill is no mode: it is running without an engine)."""

RECOMPUTE_MODES = tuple(name for name, mode in MODES.items() if mode.recompute)
"""Modes whose plans ask the executor for a selective recompute (the transformers executor only)."""
