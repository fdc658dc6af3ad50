"""Side-by-side report of a pipeline run densely and with reuse (the `kvcomm run` output)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

from kvcomm.eval.metrics import percentile
from kvcomm.reuse.runner import AgentCall


@dataclass(frozen=True)
class CallReport:
    """One agent call, dense vs reuse. Token counts are those of the reuse run's prompt:
    exact + estimated + computed = prompt; ``recomputed_tokens`` (modes "kvblend" and
    "cacheblend") are the injected tokens recomputed, counted in ``computed_tokens``.

    dense_prompt_tokens: the dense call's prompt length (it differs from ``prompt_tokens`` once
    an earlier agent's reply differs). dense_cached_tokens: how many of them the runtime's own
    prefix cache served (vLLM's ``num_cached_tokens``; 0 on transformers). reuse_cached_tokens:
    the same for the reuse call beyond what kvcomm injected (vLLM's count less exact + estimated),
    counted in ``computed_tokens``. reason: the reuse call's ``Provenance.reason``: what it
    reused and why it computed the rest, in words (``note`` is the plan's own short form)."""

    agent: str
    input_index: int
    prompt_tokens: int
    exact_tokens: int
    estimated_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    reused: bool
    fallback: bool
    ttft_dense_s: float
    ttft_reuse_s: float
    reply_equal: bool
    note: str
    reason: str
    dense_reply: str
    reuse_reply: str
    dense_prompt_tokens: int
    dense_cached_tokens: int
    reuse_cached_tokens: int


def compare(dense: Sequence[AgentCall], reuse: Sequence[AgentCall]) -> list[CallReport]:
    if [(c.agent, c.input_index) for c in dense] != [(c.agent, c.input_index) for c in reuse]:
        raise ValueError("dense and reuse runs must cover the same agent calls in the same order")
    reports = []
    for d, r in zip(dense, reuse):
        p = r.provenance
        reports.append(CallReport(
            r.agent, r.input_index, p.prompt_tokens, p.exact_tokens, p.estimated_tokens, p.computed_tokens,
            p.recomputed_tokens, p.reused, p.fallback, d.provenance.ttft_s, p.ttft_s, d.reply_ids == r.reply_ids,
            p.note, p.reason, d.reply, r.reply, d.provenance.prompt_tokens, d.provenance.cached_tokens, p.cached_tokens,
        ))
    return reports


def summarize(calls: Sequence[CallReport]) -> dict:
    """Overall numbers. token_reuse_rate = (exact + estimated) / prompt tokens;
    agent_reuse_rate = calls that reused shared content / calls; fallback_rate = calls that
    computed shared content outside their exact prefix and estimated none / calls (such a call
    may still have reused a long exact prefix: ``reason`` says); total_ttft_speedup = summed
    dense TTFT / summed reuse TTFT over all calls, misses included (the headline);
    mean_ttft_speedup = mean of dense/reuse TTFT over calls with any reuse (flatters: it leaves
    out the misses); ttft_speedup_ceiling = 1 / (1 - token_reuse_rate); dense_cached_tokens and
    reuse_cached_tokens: prompt tokens each system's runtime prefix cache served (the reuse
    system's beyond what kvcomm injected), of dense_prompt_tokens and prompt_tokens."""
    prompt = sum(c.prompt_tokens for c in calls)
    reused_tokens = sum(c.exact_tokens + c.estimated_tokens for c in calls)
    rho = reused_tokens / prompt if prompt else 0.0
    with_reuse = [c for c in calls if c.exact_tokens + c.estimated_tokens > 0]
    speedups = [c.ttft_dense_s / c.ttft_reuse_s for c in with_reuse if c.ttft_reuse_s > 0]
    n = len(calls)
    total_dense, total_reuse = sum(c.ttft_dense_s for c in calls), sum(c.ttft_reuse_s for c in calls)
    return {
        "calls": n,
        "prompt_tokens": prompt,
        "exact_tokens": sum(c.exact_tokens for c in calls),
        "estimated_tokens": sum(c.estimated_tokens for c in calls),
        "computed_tokens": sum(c.computed_tokens for c in calls),
        "recomputed_tokens": sum(c.recomputed_tokens for c in calls),
        "reuse_cached_tokens": sum(c.reuse_cached_tokens for c in calls),
        "dense_prompt_tokens": sum(c.dense_prompt_tokens for c in calls),
        "dense_cached_tokens": sum(c.dense_cached_tokens for c in calls),
        "token_reuse_rate": rho,
        "estimated_token_rate": sum(c.estimated_tokens for c in calls) / prompt if prompt else 0.0,
        "agent_reuse_rate": sum(c.reused for c in calls) / n if n else 0.0,
        "fallback_rate": sum(c.fallback for c in calls) / n if n else 0.0,
        "reply_agreement_rate": sum(c.reply_equal for c in calls) / n if n else 0.0,
        "total_ttft_dense_s": total_dense,
        "total_ttft_reuse_s": total_reuse,
        "total_ttft_speedup": total_dense / total_reuse if total_reuse > 0 else None,
        "mean_ttft_speedup": statistics.fmean(speedups) if speedups else None,
        "ttft_speedup_ceiling": 1.0 / (1.0 - rho) if rho < 1 else None,
        "ttft_dense_p50_s": percentile([c.ttft_dense_s for c in calls], 50),
        "ttft_dense_p95_s": percentile([c.ttft_dense_s for c in calls], 95),
        "ttft_reuse_p50_s": percentile([c.ttft_reuse_s for c in calls], 50),
        "ttft_reuse_p95_s": percentile([c.ttft_reuse_s for c in calls], 95),
    }


def per_agent(calls: Sequence[CallReport]) -> list[dict]:
    """Means per agent name, in first-seen order (KVCOMM reports means over agents)."""
    names = list(dict.fromkeys(c.agent for c in calls))
    rows = []
    for name in names:
        mine = [c for c in calls if c.agent == name]
        summary = summarize(mine)
        rows.append({"agent": name, **{k: summary[k] for k in (
            "calls", "token_reuse_rate", "agent_reuse_rate", "fallback_rate", "reply_agreement_rate",
            "mean_ttft_speedup", "ttft_dense_p50_s", "ttft_reuse_p50_s")}})
    return rows


def to_json(calls: Sequence[CallReport], meta: dict, floor=None) -> dict:
    """The `kvcomm run --json` object; ``floor`` (an ``eval.precision_floor.PrecisionFloor``)
    goes to ``summary.precision_floor``."""
    summary = summarize(calls)
    if floor is not None:
        summary["precision_floor"] = floor.to_json()
    return {**meta, "summary": summary, "agents": per_agent(calls), "calls": [asdict(c) for c in calls]}


def agreement_line(calls: Sequence[CallReport], floor=None, dense_name: str = "dense") -> str:
    """"replies equal to dense: 13/20 calls; precision floor: dense bfloat16 vs dense float32
    on the same calls: 17/20" (the floor only when measured)."""
    equal = sum(c.reply_equal for c in calls)
    line = f"replies equal to {dense_name}'s, token for token: {equal}/{len(calls)} calls"
    if floor is not None:
        line += f"; precision floor, {floor.words()}"
    return line


def format_table(calls: Sequence[CallReport], floor=None) -> str:
    """A fixed-width table, one row per agent call (its reason in words last), then the
    summary; ``floor``: the precision floor, printed beside reply agreement."""
    header = ("input", "agent", "prompt", "exact", "estim", "comp", "cached dense", "cached reuse",
              "ttft dense", "ttft reuse", "same reply", "reason")
    rows = [header] + [(
        str(c.input_index), c.agent, str(c.prompt_tokens), str(c.exact_tokens), str(c.estimated_tokens),
        str(c.computed_tokens), str(c.dense_cached_tokens), str(c.reuse_cached_tokens),
        f"{c.ttft_dense_s * 1000:.0f} ms",
        f"{c.ttft_reuse_s * 1000:.0f} ms", "yes" if c.reply_equal else "no", c.reason,
    ) for c in calls]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    left = (1, len(header) - 1)
    lines = ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = summarize(calls)

    def fmt(x, unit=""):
        return "n/a" if x is None else f"{x:.2f}{unit}"

    lines += [
        "",
        f"token-level reuse {s['token_reuse_rate']:.1%} (exact {s['exact_tokens']}, estimated {s['estimated_tokens']}, "
        f"computed {s['computed_tokens']} of {s['prompt_tokens']} prompt tokens)",
        f"agent-level reuse {s['agent_reuse_rate']:.1%}   calls that computed shared content and estimated none "
        f"{s['fallback_rate']:.1%}",
        agreement_line(calls, floor),
        f"total TTFT over all calls, misses included: dense {s['total_ttft_dense_s']:.2f} s, reuse "
        f"{s['total_ttft_reuse_s']:.2f} s = {fmt(s['total_ttft_speedup'], 'x')} "
        f"(ceiling 1/(1-rho) = {fmt(s['ttft_speedup_ceiling'], 'x')})",
        f"TTFT p50 / p95: dense {s['ttft_dense_p50_s'] * 1000:.0f} / {s['ttft_dense_p95_s'] * 1000:.0f} ms, reuse "
        f"{s['ttft_reuse_p50_s'] * 1000:.0f} / {s['ttft_reuse_p95_s'] * 1000:.0f} ms; mean per-call speedup over "
        f"calls with reuse {fmt(s['mean_ttft_speedup'], 'x')}",
        f"served by the runtime's own prefix cache (vLLM's; none on transformers), each system from its own calls: "
        f"dense {s['dense_cached_tokens']} of its {s['dense_prompt_tokens']} prompt tokens, reuse "
        f"{s['reuse_cached_tokens']} of its {s['prompt_tokens']} (counted as computed) besides the "
        f"{s['exact_tokens'] + s['estimated_tokens']} kvcomm injected",
    ]
    return "\n".join(lines)
