"""PNG plots of a `kvcomm eval` result (matplotlib, Agg backend, no display needed).

All plots read the JSON-shaped result (``kvcomm.eval.evaluate.to_json``) and use the rows
pooled over seeds:

- ``accuracy_vs_reuse.png``: decider accuracy vs token reuse rate, one point per mode/setting,
  error bars = 95% Wilson interval, dense as a horizontal reference line.
- ``kl_vs_reuse.png``: mean KL(dense || mode) lower bound vs token reuse rate (log y axis),
  the dense-vs-dense noise floor as a horizontal reference line, each mode's own floor as an
  open marker.
- ``ttft_by_agent.png``: mean TTFT per agent position, one line per mode/setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=True)
import matplotlib.pyplot as plt  # noqa: E402

POOLED = "pooled"
KL_FLOOR = 1e-12  # exact zeros are drawn here on the log axis when nothing positive is smaller


def _pooled(data: dict) -> list[dict]:
    return [row for row in data["aggregates"] if row["seed"] == POOLED]


def _label(row: dict) -> str:
    return f"{row['mode']} {row['setting']}".strip()


def _colors(rows: list[dict]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {_label(r): cycle[i % len(cycle)] for i, r in enumerate(rows)}


def plot_accuracy_vs_reuse(data: dict, path: str | os.PathLike) -> Path:
    rows = _pooled(data)
    colors = _colors(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = next((r for r in rows if r["mode"] == "dense"), None)
    if dense is not None and dense["accuracy"] is not None:
        ax.axhline(dense["accuracy"], color="black", linestyle="--", linewidth=1, label=f"dense ({dense['accuracy']:.2f})")
        if dense["accuracy_ci_low"] is not None:
            ax.axhspan(dense["accuracy_ci_low"], dense["accuracy_ci_high"], color="black", alpha=0.06, linewidth=0)
    for row in rows:
        if row["mode"] == "dense" or row["accuracy"] is None:
            continue
        x, y = row["token_reuse_rate"] or 0.0, row["accuracy"]
        err = [[y - row["accuracy_ci_low"]], [row["accuracy_ci_high"] - y]]
        ax.errorbar([x], [y], yerr=err, fmt="o", capsize=4, color=colors[_label(row)], label=_label(row))
    ax.set_xlabel("token-level reuse rate ((exact + estimated) / prompt tokens)")
    ax.set_ylabel(f"decider accuracy ({data['workload']})")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Accuracy vs reuse (error bars: 95% Wilson interval)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def plot_kl_vs_reuse(data: dict, path: str | os.PathLike) -> Path:
    rows = _pooled(data)
    colors = _colors(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values = [r[k] for r in rows for k in ("kl_mean", "noise_kl_mean") if r.get(k) is not None]
    positive = [v for v in values if v > 0]
    clip = min(KL_FLOOR, min(positive) / 3) if positive else KL_FLOOR  # where exact zeros are drawn
    floors = [r["noise_kl_mean"] for r in rows if r.get("noise_kl_mean") is not None]
    if floors:
        # the floor over all modes' prompts, weighted by their compared positions
        weights = [r["kl_positions"] for r in rows if r.get("noise_kl_mean") is not None]
        floor = sum(f * w for f, w in zip(floors, weights)) / sum(weights) if sum(weights) else max(floors)
        ax.axhline(max(floor, clip), color="gray", linestyle="--", linewidth=1, label=f"noise floor ({floor:.1e})")
    for row in rows:
        if row.get("kl_mean") is None:
            continue
        x = row["token_reuse_rate"] or 0.0
        color = colors[_label(row)]
        ax.plot([x], [max(row["kl_mean"], clip)], "o", color=color, label=_label(row))
        if row.get("noise_kl_mean") is not None:
            ax.plot([x], [max(row["noise_kl_mean"], clip)], "o", markerfacecolor="none", color=color, alpha=0.7)
    if not any(row.get("kl_mean") is not None for row in rows):
        ax.text(0.5, 0.5, "KL not measured (--no-kl)", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_yscale("log")
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("token-level reuse rate")
    ax.set_ylabel(f"mean KL(dense || mode), top-{data['settings'].get('top_k', 20)} + other (lower bound)")
    ax.set_title(f"KL vs reuse (open markers: each mode's noise floor; 0 drawn at {clip:.0e})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    _legend(ax)
    return _save(fig, path)


def plot_ttft_by_agent(data: dict, path: str | os.PathLike) -> Path:
    rows = _pooled(data)
    colors = _colors(rows)
    agents = list(data["settings"]["agents"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        points = [(e["position"], e["ttft_mean_s"]) for e in row["ttft_by_position"] if e["ttft_mean_s"] is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        style = "--" if row["mode"] == "dense" else "-"
        ax.plot(xs, [y * 1000 for y in ys], style, marker="o", color="black" if row["mode"] == "dense" else colors[_label(row)],
                label=_label(row))
    ax.set_xticks(range(len(agents)))
    ax.set_xticklabels([f"{i}: {a}" for i, a in enumerate(agents)])
    ax.set_xlabel("agent position")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Time to first token by agent position")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def write_plots(data: dict, out: str | os.PathLike) -> dict[str, Path]:
    """All three PNGs into folder ``out``; returns {name: path}."""
    out = Path(out)
    return {
        "accuracy_vs_reuse": plot_accuracy_vs_reuse(data, out / "accuracy_vs_reuse.png"),
        "kl_vs_reuse": plot_kl_vs_reuse(data, out / "kl_vs_reuse.png"),
        "ttft_by_agent": plot_ttft_by_agent(data, out / "ttft_by_agent.png"),
    }


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def _save(fig, path) -> Path:
    path = Path(path)
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


__all__ = ["write_plots", "plot_accuracy_vs_reuse", "plot_kl_vs_reuse", "plot_ttft_by_agent"]
