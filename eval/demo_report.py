"""The figures, text and chart of `kvcomm demo`, computed from its per-call records.

Every figure is a function of the list of :class:`DemoCall` records alone, so a test can
recompute it by hand. "Dense" is the baseline system (stock vLLM with its prefix cache, or the
transformers executor without reuse), "reuse" is kvcomm; the names match `kvcomm run --json`.

Headline figures, all over every call (calls that reused nothing included):

- ``total_ttft_{dense,reuse}_s``: sums of TTFT, seconds; ``total_ttft_speedup``: their ratio
  (dense over reuse). Not a mean of per-call ratios, which would let a few fast calls hide
  the slow ones.
- per agent: TTFT p50 / p95 / total for both systems (linear-interpolation percentiles).
- prompt tokens of the reuse run split exact / estimated / computed (they add up to
  ``prompt_tokens``), ``token_reuse_rate`` rho = (exact + estimated) / prompt tokens and the
  ceiling 1 / (1 - rho) on the prefill speedup that reuse alone can give.
- ``reply_agreement_rate``: calls whose greedy reply equals the baseline's, token for token,
  beside its precision floor (``summary.precision_floor``, ``eval.precision_floor``): the same
  figure for the baseline's prompts rerun densely in the other dtype.
- per call, ``reason``: what kvcomm's call reused and why it computed the rest, in words.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from kvcomm.eval.report import CallReport, summarize


@dataclass(frozen=True)
class DemoCall(CallReport):
    """One agent call run by both systems (the fields of ``CallReport``, TTFT in seconds; "dense"
    is the baseline: ``dense_cached_tokens`` is what stock vLLM's prefix cache served it, 0 for
    the transformers baseline)."""


def demo_summary(calls: Sequence[DemoCall]) -> dict:
    """``kvcomm.eval.report.summarize`` (its TTFT totals are the headline; it counts both
    systems' prompt tokens served by vLLM's prefix cache) plus the rows."""
    if not calls:
        raise ValueError("the demo ran no agent calls; give it at least one input row")
    return {**summarize(calls), "rows": len({c.input_index for c in calls})}


AGENT_KEYS = ("calls", "ttft_dense_p50_s", "ttft_dense_p95_s", "ttft_reuse_p50_s", "ttft_reuse_p95_s",
              "total_ttft_dense_s", "total_ttft_reuse_s", "total_ttft_speedup", "prompt_tokens", "exact_tokens",
              "estimated_tokens", "computed_tokens", "token_reuse_rate", "reply_agreement_rate", "dense_cached_tokens",
              "reuse_cached_tokens")
"""The ``summarize`` figures each per-agent row of the demo reports, in this order."""


def demo_agents(calls: Sequence[DemoCall]) -> list[dict]:
    """One row per agent name, in first-seen order: calls, TTFT p50/p95/total of both
    systems, the reuse run's token split and reply agreement."""
    rows = []
    for name in dict.fromkeys(c.agent for c in calls):
        summary = summarize([c for c in calls if c.agent == name])
        rows.append({"agent": name, **{key: summary[key] for key in AGENT_KEYS}})
    return rows


def demo_json(calls: Sequence[DemoCall], meta: dict, floor=None) -> dict:
    """The `kvcomm demo --json` object: ``meta`` keys, ``summary``, ``agents``, ``calls``;
    ``floor`` (an ``eval.precision_floor.PrecisionFloor``) goes to ``summary.precision_floor``."""
    summary = demo_summary(calls)
    if floor is not None:
        summary["precision_floor"] = floor.to_json()
    return {**meta, "summary": summary, "agents": demo_agents(calls), "calls": [asdict(c) for c in calls]}


def _seconds(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def format_demo(report: dict, dense_name: str, reuse_name: str = "kvcomm") -> str:
    """The demo's text output from a :func:`demo_json` object: a per-agent TTFT table, then the
    headline lines. ``dense_name``/``reuse_name`` label the two systems."""
    s = report["summary"]
    header = ("agent", "calls", f"{dense_name} p50", "p95", f"{reuse_name} p50", "p95",
              "exact", "estimated", "computed", "same reply")
    rows = [header] + [(
        a["agent"], str(a["calls"]), _seconds(a["ttft_dense_p50_s"]), _seconds(a["ttft_dense_p95_s"]),
        _seconds(a["ttft_reuse_p50_s"]), _seconds(a["ttft_reuse_p95_s"]), str(a["exact_tokens"]),
        str(a["estimated_tokens"]), str(a["computed_tokens"]),
        f"{round(a['reply_agreement_rate'] * a['calls'])}/{a['calls']}",
    ) for a in report["agents"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    speedup = s["total_ttft_speedup"]
    ceiling = s["ttft_speedup_ceiling"]
    agree = round(s["reply_agreement_rate"] * s["calls"])
    floor = s.get("precision_floor")
    lines += ["", f"{'row':>3}  {'agent':{widths[0]}}  {'same':4}  {reuse_name}: what it reused and why it computed the rest"]
    lines += [f"{c['input_index']:>3}  {c['agent']:{widths[0]}}  {'yes' if c['reply_equal'] else 'no':4}  {c['reason']}"
              for c in report["calls"]]
    lines += [
        "",
        f"TTFT summed over all {s['calls']} calls ({s['rows']} rows, misses included): "
        f"{dense_name} {s['total_ttft_dense_s']:.1f} s, {reuse_name} {s['total_ttft_reuse_s']:.1f} s"
        + ("" if speedup is None else f"  ->  {speedup:.2f}x"),
        f"{reuse_name} prompt tokens: {s['exact_tokens']} exact + {s['estimated_tokens']} estimated + "
        f"{s['computed_tokens']} computed = {s['prompt_tokens']} (reuse rho {s['token_reuse_rate']:.1%}; "
        f"ceiling 1/(1-rho) = {'n/a' if ceiling is None else f'{ceiling:.2f}x'})",
        f"from vLLM's prefix cache, each system from its own calls: {dense_name} {s['dense_cached_tokens']} of its "
        f"{s['dense_prompt_tokens']} prompt tokens, {reuse_name} {s['reuse_cached_tokens']} of its "
        f"{s['prompt_tokens']} (counted as computed)",
        f"replies equal to {dense_name}'s, token for token: {agree}/{s['calls']} calls"
        + ("" if floor is None else f"; precision floor, dense {floor['dtype']} vs dense {floor['reference_dtype']} "
           f"on the same calls: {floor['equal']}/{floor['calls']} (greedy replies that change with the precision alone)"),
    ]
    return "\n".join(lines)


def write_chart(report: dict, path: str | Path, dense_name: str, reuse_name: str = "kvcomm") -> Path:
    """Write a PNG of a :func:`demo_json` object: per agent, median TTFT of both systems (bars,
    whiskers up to p95) and, per call in run order, both systems' TTFT. Returns the path.

    Raises ValueError naming the path if its folder does not exist.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"cannot write the chart to {path}: folder {path.parent} does not exist; "
                         f"create it or pass another --chart path")
    agents = report["agents"]
    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    x = range(len(agents))
    width = 0.38
    for offset, key, name, color in ((-width / 2, "dense", dense_name, "#9e9e9e"), (width / 2, "reuse", reuse_name, "#1f77b4")):
        p50 = [a[f"ttft_{key}_p50_s"] for a in agents]
        p95 = [a[f"ttft_{key}_p95_s"] for a in agents]
        left.bar([i + offset for i in x], p50, width, label=name, color=color,
                 yerr=[[0] * len(p50), [hi - lo for lo, hi in zip(p50, p95)]], capsize=4)
    left.set_xticks(list(x), [a["agent"] for a in agents])
    left.set_ylabel("TTFT, seconds (bar: median, whisker: p95)")
    left.set_title("TTFT per agent")
    left.legend()
    calls = report["calls"]
    index = range(1, len(calls) + 1)
    right.plot(index, [c["ttft_dense_s"] for c in calls], "o-", color="#9e9e9e", label=dense_name)
    right.plot(index, [c["ttft_reuse_s"] for c in calls], "o-", color="#1f77b4", label=reuse_name)
    for i, c in enumerate(calls, start=1):
        if c["estimated_tokens"] > 0:
            right.plot([i], [c["ttft_reuse_s"]], "o", color="#ff7f0e", zorder=3)
    right.plot([], [], "o", color="#ff7f0e", label=f"{reuse_name} call with estimated KV")
    rows = [c["input_index"] for c in calls]
    for i in range(1, len(rows)):
        if rows[i] != rows[i - 1]:
            right.axvline(i + 0.5, color="#dddddd", linewidth=1, zorder=0)
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    right.set_xlabel("agent call, in run order (grey lines: next input row)")
    right.set_ylabel("TTFT, seconds")
    right.set_title("TTFT per call")
    right.set_ylim(bottom=0)
    right.legend()
    speedup = s["total_ttft_speedup"]
    fig.suptitle(
        f"TTFT summed over all {s['calls']} calls: {dense_name} {s['total_ttft_dense_s']:.1f} s, "
        f"{reuse_name} {s['total_ttft_reuse_s']:.1f} s" + ("" if speedup is None else f" ({speedup:.2f}x)")
        + f"\n{reuse_name} prompt tokens: {s['exact_tokens']} exact, {s['estimated_tokens']} estimated, "
        f"{s['computed_tokens']} computed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
