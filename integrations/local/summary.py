"""What the chat clients' ``summary()`` reports: totals over logged calls, per agent and in all.

Times are the calls' own, summed: ``ttft_s`` (each call from its start, rendering, planning
and any preamble included, to its first reply token) and ``wall_s`` (each call from its
start to its return, ``ChatCall.latency_s``). Summed TTFT is the time the calls kept their
callers waiting for a first token; summed wall time is what a team that makes its calls one
after the other spends in them. Give ``baseline`` (the summary of the same team run by
another client, e.g. the dense ``reuse=False`` one) to get both against it.
"""

from __future__ import annotations

from typing import Any, Sequence


def _times(calls: Sequence) -> dict[str, Any]:
    """Summed TTFT (None when no call has one; ``ttft_unknown`` counts the calls without one),
    summed wall time, and summed planning time where measured (in process)."""
    ttfts = [c.provenance.ttft_s for c in calls if c.provenance.ttft_s is not None]
    plans = [c.provenance.plan_s for c in calls if c.provenance.plan_s is not None]
    return {
        "ttft_s": sum(ttfts) if ttfts else None,
        "ttft_unknown": len(calls) - len(ttfts),
        "wall_s": sum(c.latency_s for c in calls),
        "plan_s": sum(plans) if plans else None,
    }


def _tokens(calls: Sequence) -> dict[str, Any]:
    prompt = sum(c.provenance.prompt_tokens for c in calls)
    exact = sum(c.provenance.exact_tokens for c in calls)
    estimated = sum(c.provenance.estimated_tokens for c in calls)
    return {
        "calls": len(calls), "prompt_tokens": prompt, "exact_tokens": exact, "estimated_tokens": estimated,
        "computed_tokens": prompt - exact - estimated,
        "preamble_tokens": sum(c.provenance.preamble_tokens for c in calls),
        "realigned_tokens": sum(c.provenance.realigned_tokens for c in calls),
        "token_reuse_rate": (exact + estimated) / prompt if prompt else 0.0,
    }


def summarize(calls: Sequence, baseline: Any = None) -> dict[str, Any]:
    """Totals over ``calls`` (``ChatCall``s): the token counts by source (they add up to
    ``prompt_tokens``; ``preamble_tokens``: of the computed ones, those computed before reused
    content; ``realigned_tokens``: of the estimated ones, those served as their realigned base
    without an anchor's deviation, ``Provenance.realigned_tokens``), ``token_reuse_rate``, ``agent_reuse_rate`` (calls that reused some shared
    message / calls), ``calls_reusing_nothing`` (no token exact or estimated),
    ``calls_estimating_nothing`` (shared messages outside the exact prefix, none estimated:
    ``Provenance.fallback``; such a call may still have reused a long exact prefix), the
    times (``ttft_s``, ``wall_s``, ``plan_s``, ``ttft_unknown``: module docstring), and
    ``agents``: the same tokens and times per calling agent (``ChatCall.agent``; None when
    unknown), in first-call order.

    baseline: another summary (a dict from ``summarize``), or a client or backend with
    ``summary()``: adds ``baseline`` with its ``ttft_s`` and ``wall_s`` and the ratios
    ``ttft_speedup`` = baseline TTFT / this TTFT, ``wall_speedup`` likewise (None where a
    side has no time), over all calls and per agent present in both."""
    out = {
        **_tokens(calls),
        "agent_reuse_rate": sum(c.provenance.reused for c in calls) / len(calls) if calls else 0.0,
        "calls_reusing_nothing": sum(c.provenance.exact_tokens + c.provenance.estimated_tokens == 0 for c in calls),
        "calls_estimating_nothing": sum(c.provenance.fallback for c in calls),
        **_times(calls),
    }
    names = list(dict.fromkeys(c.agent for c in calls))
    out["agents"] = {name: {**_tokens(mine), **_times(mine)} for name in names
                     for mine in [[c for c in calls if c.agent == name]]}
    if baseline is not None:
        other = baseline if isinstance(baseline, dict) else baseline.summary()
        out["baseline"] = _against(out, other)
        for name, mine in out["agents"].items():
            if name in other.get("agents", {}):
                mine["baseline"] = _against(mine, other["agents"][name])
    return out


def _against(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        a, b = other.get(key), mine.get(key)
        return a / b if a is not None and b else None

    return {"calls": other.get("calls"), "ttft_s": other.get("ttft_s"), "wall_s": other.get("wall_s"),
            "ttft_speedup": ratio("ttft_s"), "wall_speedup": ratio("wall_s")}
