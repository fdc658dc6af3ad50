"""Aggregation of evaluation call records: per (mode, setting, seed) and pooled over seeds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvcomm.eval.evaluate import POOLED, CallRecord, EvalResult, RunResult, RunSpec
from kvcomm.eval.metrics import percentile, wilson_interval


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize_calls(calls: Sequence[CallRecord], agents: Sequence[str], decider: str) -> dict:
    """Aggregate numbers over ``calls`` (one run, or several pooled)."""
    prompt = sum(c.prompt_tokens for c in calls)
    n = len(calls)
    scores = [c.score for c in calls if c.agent == decider and c.score is not None]
    low, high = wilson_interval(sum(scores), len(scores)) if scores else (None, None)
    positions = sum(c.kl_positions for c in calls)
    with_noise = [c for c in calls if c.noise_kl_sum is not None]
    noise_positions = sum(c.kl_positions for c in with_noise)
    ttft = [c.ttft_s for c in calls]
    timed = [c for c in calls if c.timing_consistent is not None]
    by_position = []
    for index, agent in enumerate(agents):
        mine = [c.ttft_s for c in calls if c.agent_position == index]
        by_position.append({
            "position": index, "agent": agent, "calls": len(mine),
            "ttft_mean_s": statistics.fmean(mine) if mine else None,
            "ttft_p50_s": percentile(mine, 50), "ttft_p95_s": percentile(mine, 95),
        })
    return {
        "calls": n,
        "rows": len(scores),
        "accuracy": statistics.fmean(scores) if scores else None,
        "accuracy_ci_low": low,
        "accuracy_ci_high": high,
        "prompt_tokens": prompt,
        "exact_tokens": sum(c.exact_tokens for c in calls),
        "estimated_tokens": sum(c.estimated_tokens for c in calls),
        "computed_tokens": sum(c.computed_tokens for c in calls),
        "recomputed_tokens": sum(c.recomputed_tokens for c in calls),
        "cached_tokens": sum(c.cached_tokens for c in calls),
        "cached_token_rate": _rate(sum(c.cached_tokens for c in calls), prompt),
        "token_reuse_rate": _rate(sum(c.exact_tokens + c.estimated_tokens for c in calls), prompt),
        "exact_token_rate": _rate(sum(c.exact_tokens for c in calls), prompt),
        "estimated_token_rate": _rate(sum(c.estimated_tokens for c in calls), prompt),
        "agent_reuse_rate": _rate(sum(c.reused for c in calls), n),
        "fallback_rate": _rate(sum(c.fallback for c in calls), n),
        "reply_agreement": _rate(sum(c.reply_equal for c in calls), n),
        "kl_positions": positions,
        "kl_mean": _rate(sum(c.kl_sum for c in calls), positions),
        "kl_last_mean": _rate(sum(c.kl_last for c in calls if c.kl_positions), sum(1 for c in calls if c.kl_positions)),
        "kl_max": max((c.kl_max for c in calls if c.kl_positions), default=None),
        "top1_agreement": _rate(sum(c.top1_matches for c in calls), positions),
        "noise_kl_mean": _rate(sum(c.noise_kl_sum for c in with_noise), noise_positions),
        "noise_kl_last_mean": _rate(
            sum(c.noise_kl_last for c in with_noise if c.kl_positions), sum(1 for c in with_noise if c.kl_positions)),
        "noise_kl_max": max((c.noise_kl_max for c in with_noise if c.kl_positions), default=None),
        "noise_top1_agreement": _rate(sum(c.noise_top1_matches for c in with_noise), noise_positions),
        "timing_consistent_rate": _rate(sum(bool(c.timing_consistent) for c in timed), len(timed)),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_by_position": by_position,
    }


def aggregate(result: EvalResult) -> list[dict]:
    """One dict per (mode, setting, seed), then one per (mode, setting) pooled over seeds
    (``seed`` = "pooled"; ``pool_bytes`` is then the mean over seeds). Pooled accuracy CIs
    treat every (seed, row) as a trial, though the rows repeat across seeds."""
    out = []
    keys = list(dict.fromkeys(r.run for r in result.runs))
    for key in keys:
        mine = [r for r in result.runs if r.run == key]
        for r in mine:
            out.append(_aggregate_row(result, key, r.seed, r.calls, [r]))
        out.append(_aggregate_row(result, key, POOLED, [c for r in mine for c in r.calls], mine))
    return out


def _aggregate_row(result: EvalResult, run: RunSpec, seed, calls, runs: Sequence[RunResult]) -> dict:
    row = {"mode": run.mode, "setting": run.setting, "gamma": run.gamma, "max_anchors": run.max_anchors, "scope": run.scope,
           "seed": seed}
    row.update(summarize_calls(calls, result.agents, result.decider))
    row["pool_bytes"] = statistics.fmean(r.pool_bytes for r in runs) if runs else None
    row["anchors"] = {slot: statistics.fmean(r.anchors.get(slot, 0) for r in runs) for slot in sorted({s for r in runs for s in r.anchors})}
    row["wall_s"] = sum(r.wall_s for r in runs)
    guarded = [r.guard for r in runs if r.guard is not None]
    row["guard_budget"] = guarded[0]["budget"] if guarded else None
    row["guard_twins"] = sum(g["twins"] for g in guarded) if guarded else None
    row["guard_twins_per_100"] = _rate(100 * row["guard_twins"], row["calls"]) if guarded else None
    row["guard_over_budget"] = sorted({slot for g in guarded for slot in g["over_budget"]}) if guarded else None
    return row


BASELINES = ("realign", "cacheblend")
"""The modes kvcomm at its defaults is to dominate (``dominance``)."""


def dominance(rows: Sequence[dict]) -> list[dict]:
    """Per seed (and pooled) and baseline in ``BASELINES`` present in ``rows`` (``aggregate``'s):
    whether kvcomm at its defaults (gamma and V of ``PoolConfig``, the default scope) dominates it:
    token reuse at least the baseline's at a first-token KL (``kl_last_mean``) at most the
    baseline's, on both KLs the table shows: over the computed positions (``kl_mean``) and of the
    first reply token (``kl_last_mean``). ``loses``: what it loses on, empty when it dominates."""
    from kvcomm.anchors.config import PoolConfig

    out = []
    for ours in rows:
        if (ours["mode"], ours["gamma"], ours["max_anchors"], ours["scope"]) != ("kvcomm", PoolConfig.gamma, PoolConfig.max_anchors, None):
            continue
        for theirs in rows:
            if theirs["mode"] not in BASELINES or theirs["seed"] != ours["seed"] or theirs["scope"] is not None:
                continue
            loses = []
            if (ours["token_reuse_rate"] or 0) < (theirs["token_reuse_rate"] or 0):
                loses.append("reuse")
            for key, words in (("kl_mean", "KL"), ("kl_last_mean", "first-token KL")):
                if ours[key] is not None and theirs[key] is not None and ours[key] > theirs[key]:
                    loses.append(words)
            out.append({"seed": ours["seed"], "baseline": theirs["mode"], "dominates": not loses, "loses": loses,
                        "reuse": ours["token_reuse_rate"], "baseline_reuse": theirs["token_reuse_rate"],
                        "kl_mean": ours["kl_mean"], "baseline_kl_mean": theirs["kl_mean"],
                        "kl_last_mean": ours["kl_last_mean"], "baseline_kl_last_mean": theirs["kl_last_mean"],
                        "twins": ours["guard_twins"], "twins_per_100": ours["guard_twins_per_100"]})
    return out


def dominance_lines(rows: Sequence[dict]) -> list[str]:
    """``dominance`` of the pooled rows in words, one line per baseline, and the budget's cost."""
    lines = []
    for d in dominance([r for r in rows if r["seed"] == POOLED]):
        verdict = "dominates" if d["dominates"] else f"does not dominate (loses on {' and '.join(d['loses'])})"
        kl = ("no KL measured" if d["kl_mean"] is None else
              f"KL {d['kl_mean']:.3g} vs {d['baseline_kl_mean']:.3g}, first-token KL {d['kl_last_mean']:.3g} vs "
              f"{d['baseline_kl_last_mean']:.3g}")
        lines.append(f"kvcomm at its defaults {verdict} {d['baseline']}: reuse {100 * (d['reuse'] or 0):.1f}% vs "
                     f"{100 * (d['baseline_reuse'] or 0):.1f}%, {kl}")
    for r in rows:
        if r["seed"] == POOLED and r["guard_twins"] is not None:
            over = ", ".join(r["guard_over_budget"]) or "none"
            lines.append(f"quality budget of {r['mode']} {r['setting']}: {r['guard_budget']:.3g} nats; cost "
                         f"{r['guard_twins']} dense twins in {r['calls']} calls ({r['guard_twins_per_100']:.1f} per 100); "
                         f"slots over budget: {over}")
    return lines
