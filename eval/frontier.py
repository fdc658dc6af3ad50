"""The KL-vs-reuse frontier over several `kvcomm eval` results: one table and one chart.

Every mode/setting of every result folder (pooled over seeds) is a point (token reuse rate,
mean KL(dense || mode)); runs of the same workload that differ in flags such as
``--base-source`` are told apart by those flags. A point is on the frontier when no other
point of its workload reuses at least as many tokens at a KL at most as large (one of the two
strictly); a KL mean is weighed only against those of runs that compute the same prompt
positions (a reuse scope or ``compute_tail`` changes them). The noise floors drawn next to
the points are the chunked-prefill floor each run measures and, where a run measured it
(``--noise-floor``), the same model in another dtype.
Each KL comes with a 95% bootstrap interval over the run's inputs (``KL_INTERVAL``): at a few
dozen inputs a handful of calls decide the mean, and two points whose intervals overlap are
not told apart by it (``kvcomm paired`` compares them call by call). Two KLs, two frontiers:
the mean over every computed prompt position (``kl_mean``: weighted towards the calls that
compute many positions behind reused KV, such as a decider computing a reply no base holds),
and the mean over calls of the first reply token's KL (``kl_last_mean``: one position per
call, the distribution every reply starts from).

    kvcomm frontier OUT1 OUT2 ... --out FOLDER   # or: python -m kvcomm.eval.frontier ...

writes ``FOLDER/frontier.md`` (a table per workload) and ``FOLDER/frontier.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvcomm.reuse.scopes import SCOPES, Scope
from kvcomm.eval.metrics import bootstrap_ratio_interval

POOLED = "pooled"
DISTINGUISHING = ("base_source", "min_estimate_anchors", "recompute_ratio", "recompute_selection", "recompute_boundary", "dtype",
                  "pool", "embedder", "reuse", "warm_rows", "scopes")
"""Run settings that make two results' points different configurations (shown in labels when
they differ between the runs of one workload). ``min_estimate_anchors``, ``recompute_selection``,
``recompute_boundary`` and ``reuse`` are settings of results written before those variants were
removed; the chart still reads such results. ``scopes`` tells apart runs of the default scope
alone, which name no scope in their setting (``all`` until 2026-12-06, ``all-reader-replies``
since)."""
ONLY_FOR = {
    "pool": ("kvcomm", "kvblend"), "min_estimate_anchors": ("kvcomm", "kvblend"), "embedder": ("kvcomm", "kvblend"),
    "recompute_ratio": ("cacheblend", "kvblend"), "recompute_selection": ("cacheblend", "kvblend"),
    "recompute_boundary": ("cacheblend", "kvblend"),
}
"""Settings that change only these modes' runs: other modes' labels leave them out."""
SETTING_DEFAULTS = {"embedder": "kv", "warm_rows": 0, "scopes": ["all"]}
"""What a result written before one of those settings existed ran with."""
COMPUTED_POSITIONS = ("compute_trailing_text", "decode_reply_bases", "bases_after_estimates", "compute_tail")
"""Scope fields (and the removed ``compute_tail``) that change which prompt positions a run
computes behind its reused KV, and so which positions its KL mean averages over; results
written before scopes were presets carry them as ``reuse`` overrides."""

_OLD_DEFAULTS = {**dataclasses.asdict(Scope()), "compute_tail": 1}
"""What a result's ``reuse`` overrides were relative to."""
RETIRED_SCOPES = {
    "reader-replies": Scope(decode_reply_bases=False, bases_after_estimates=True, compute_trailing_text=True),
    "inputs": Scope(decode_reply_bases=False, compute_trailing_text=True),
}
"""Presets deleted on 2026-12-06 (no workload picked them; docs/decisions.md), kept here only so
that results written with them are still named and placed by their scope."""
_READABLE_SCOPES = {**SCOPES, **RETIRED_SCOPES}
_LABEL_NAMES = {"scopes": "scope"}
KL_INTERVAL = {"draws": 2000, "seed": 0, "level": 0.95}
"""The bootstrap behind each point's KL interval: inputs resampled with replacement."""


@dataclass(frozen=True)
class Point:
    """One mode/setting of one run, pooled over seeds. Rates are in [0, 1]; KL in nats."""

    workload: str
    label: str
    mode: str
    token_reuse: float
    exact_rate: float
    estimated_rate: float
    kl_mean: float | None
    top1: float | None
    reply_agreement: float | None
    accuracy: float | None
    accuracy_ci: tuple[float | None, float | None]
    noise_kl_mean: float | None
    kl_ci: tuple[float, float] | None = None
    """95% bootstrap interval of ``kl_mean`` over the run's inputs; None when the result holds
    no per-call KL for the point (a result without calls, or a run without ``--kl``)."""
    kl_last_mean: float | None = None
    """Mean over calls of KL(dense || mode) at the last prompt position (the first reply token), nats."""
    kl_last_ci: tuple[float, float] | None = None
    """95% bootstrap interval of ``kl_last_mean`` over the run's inputs (as ``kl_ci``)."""
    computed_positions: str = ""
    """The point's settings that change which positions it computes (``_computed_positions``)."""

    def interval(self, metric: str) -> tuple[float, float] | None:
        """The interval of ``metric`` (a ``KL_METRICS`` key)."""
        return self.kl_ci if metric == "kl_mean" else self.kl_last_ci


@dataclass(frozen=True)
class Floor:
    """A dtype noise floor measured by ``kvcomm eval --noise-floor``: KL(reference || dtype)."""

    workload: str
    dtype: str
    reference_dtype: str
    kl_mean: float
    kl_median: float | None
    top1: float | None


def load_results(folders: list[str | os.PathLike]) -> tuple[list[Point], list[Floor]]:
    """Points and dtype floors of the ``results.json`` in each folder (or the file itself)."""
    loaded = []
    for folder in folders:
        path = Path(folder)
        path = path / "results.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no results.json; pass folders written by `kvcomm eval --out`")
        with open(path) as f:
            loaded.append(json.load(f))
    points, floors = [], []
    for data in loaded:
        settings = data.get("settings", {})
        workload = data["workload"]
        same = [d.get("settings", {}) for d in loaded if d["workload"] == workload]
        varying = [k for k in DISTINGUISHING if len({json.dumps(_value(s, k) or None) for s in same}) > 1]  # [] and absent alike
        for row in data["aggregates"]:
            if row["seed"] != POOLED:
                continue
            label = f"{row['mode']} {row['setting']}".strip()
            suffix = ", ".join(f"{_LABEL_NAMES.get(k, k.replace('_', ' '))} {_setting(_value(settings, k))}" for k in varying
                               if row["mode"] in ONLY_FOR.get(k, (row["mode"],))
                               and not (k == "reuse" and row.get("scope") and not _value(settings, k))  # named by its setting
                               and not (k == "scopes" and (row.get("scope") or _value(settings, "reuse"))))  # named otherwise
            if suffix and row["mode"] != "dense":
                label += f" ({suffix})"
            points.append(Point(
                workload, label, row["mode"], row["token_reuse_rate"] or 0.0, row.get("exact_token_rate") or 0.0,
                row.get("estimated_token_rate") or 0.0, row.get("kl_mean"), row.get("top1_agreement"),
                row.get("reply_agreement"), row.get("accuracy"), (row.get("accuracy_ci_low"), row.get("accuracy_ci_high")),
                row.get("noise_kl_mean"), _kl_interval(data.get("calls") or [], row["mode"], row["setting"], "kl_sum"),
                row.get("kl_last_mean"), _kl_interval(data.get("calls") or [], row["mode"], row["setting"], "kl_last"),
                _computed_positions(settings, row.get("scope")),
            ))
        floor = data.get("dtype_noise_floor") or settings.get("dtype_noise_floor")
        if floor:
            floors.append(Floor(workload, floor["dtype"], floor["reference_dtype"], floor["kl_mean"],
                                floor.get("kl_median"), floor.get("same_top1")))
    return _dedup_dense(points), floors


def _kl_interval(calls: list[dict], mode: str, setting: str, field: str) -> tuple[float, float] | None:
    """``KL_INTERVAL`` bootstrap of a mean KL, an input (all its calls, every seed) being the unit
    resampled: summed ``kl_sum`` over summed KL positions, or summed ``kl_last`` over calls;
    None without per-call KL."""
    by_input: dict[int, list[float]] = {}
    for c in calls:
        if c.get("mode") != mode or c.get("setting") != setting or c.get(field) is None:
            continue
        sums = by_input.setdefault(c["input_index"], [0.0, 0.0])
        sums[0] += c[field]
        sums[1] += c["kl_positions"] if field == "kl_sum" else 1
    inputs = sorted(by_input)
    low, high = bootstrap_ratio_interval([by_input[i][0] for i in inputs], [by_input[i][1] for i in inputs], **KL_INTERVAL)
    return None if math.isnan(low) else (low, high)


def _value(settings: dict, name: str):
    return settings.get(name, SETTING_DEFAULTS.get(name))


def _setting(value) -> str:
    """A run setting as a label part: overrides as name=value (old ``reuse`` overrides that make
    up a reuse scope by the scope's name), nothing as "default"."""
    if not value:
        return "default"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # ``scopes``: a default-scope run's
        return value[0]
    if isinstance(value, list):
        pairs = dict(value)
        parts = []
        matching = [name for name, scope in _READABLE_SCOPES.items() if _overrides(scope)
                    and all(pairs.get(k) == v for k, v in _overrides(scope).items())]
        scope = max(matching, key=lambda name: len(_overrides(_READABLE_SCOPES[name])), default=None)  # the most specific
        if scope is not None:
            parts.append(f"scope {scope}")
            pairs = {k: v for k, v in pairs.items() if k not in _overrides(_READABLE_SCOPES[scope])}
        return " ".join(parts + [f"{k}={v}" for k, v in pairs.items()])
    return str(value)


def _overrides(scope: Scope) -> dict:
    """A scope's fields that differ from scope ``all``'s."""
    return {k: v for k, v in dataclasses.asdict(scope).items() if _OLD_DEFAULTS[k] != v}


def _computed_positions(settings: dict, scope: str | None) -> str:
    """The ``COMPUTED_POSITIONS`` settings of a run's point (its scope, else the evaluation's
    first scope, "all" for results that name none; plus any old ``reuse`` overrides), as a
    comparable string."""
    scope = scope or (settings.get("scopes") or ["all"])[0]
    values = {**_OLD_DEFAULTS, **dict(settings.get("reuse") or []), **_overrides(_READABLE_SCOPES.get(scope, Scope()))}
    return json.dumps({k: values[k] for k in COMPUTED_POSITIONS}, sort_keys=True)


def _dedup_dense(points: list[Point]) -> list[Point]:
    """One dense point per workload (every run measures the same dense reference)."""
    seen, out = set(), []
    for p in points:
        if p.mode == "dense":
            if p.workload in seen:
                continue
            seen.add(p.workload)
        out.append(p)
    return out


KL_METRICS = {"kl_mean": "mean KL over computed positions", "kl_last_mean": "mean first-reply-token KL"}
"""The two KLs a point is judged on (``Point`` fields) and their axis names."""


def on_frontier(point: Point, points: list[Point], metric: str = "kl_mean") -> bool:
    """No other comparable point of the workload has reuse >= and KL (``metric``, one of
    ``KL_METRICS``) <= this one's, one strictly. Every point's first-token KL is comparable; a
    KL mean only with those of runs that compute the same positions (``computed_positions``;
    the dense reference, with no KL of its own, with every run)."""
    mine = getattr(point, metric)
    if mine is None:
        return False
    for other in points:
        theirs = getattr(other, metric)
        if other is point or other.workload != point.workload or theirs is None:
            continue
        if metric == "kl_mean" and "dense" not in (point.mode, other.mode) and \
                other.computed_positions != point.computed_positions:
            continue
        if other.token_reuse >= point.token_reuse and theirs <= mine and \
                (other.token_reuse > point.token_reuse or theirs < mine):
            return False
    return True


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(points: list[Point], floors: list[Floor]) -> str:
    """A table per workload, sorted by token reuse, frontier points marked."""
    lines = []
    for workload in dict.fromkeys(p.workload for p in points):
        mine = sorted((p for p in points if p.workload == workload), key=lambda p: (p.token_reuse, -(p.kl_mean or 0)))
        lines += [f"### {workload}", ""]
        chunked = [p.noise_kl_mean for p in mine if p.noise_kl_mean is not None]
        notes = []
        if chunked:
            notes.append(f"chunked-prefill floor KL {max(chunked):.1e} (largest over modes)")
        for f in floors:
            if f.workload == workload:
                notes.append(f"{f.dtype} vs {f.reference_dtype} floor: KL mean {f.kl_mean:.1e}, median "
                             f"{_fmt(f.kl_median, '.1e')}, same top-1 {_fmt(f.top1, '.1%')}")
        if notes:
            lines += ["Noise floors: " + "; ".join(notes) + ".", ""]
        if len({p.computed_positions for p in mine if p.mode != "dense"}) > 1:
            lines += ["These runs compute different prompt positions behind their reused KV (reuse scope or "
                      "compute_tail), and the KL mean averages over the positions each computes: compare them "
                      "by first-token KL and reply agreement, which every run measures at the same positions. "
                      "The KL-mean frontier is marked among runs that compute the same positions.", ""]
        lines += ["| mode / setting | token reuse (exact + estimated) | KL mean [95% CI] | first-token KL [95% CI] | top-1 "
                  "| reply eq | accuracy [95% CI] | frontier (KL mean / first token) |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in mine:
            acc = "-" if p.accuracy is None else f"{p.accuracy:.2f} [{_fmt(p.accuracy_ci[0], '.2f')}, {_fmt(p.accuracy_ci[1], '.2f')}]"
            kl, last = (_kl_cell(p, m) for m in KL_METRICS)
            marks = " / ".join("yes" if on_frontier(p, points, m) else "-" for m in KL_METRICS)
            lines.append(
                f"| {p.label} | {p.token_reuse:.1%} ({p.exact_rate:.1%} + {p.estimated_rate:.1%}) | {kl} | {last} "
                f"| {_fmt(p.top1, '.1%')} | {_fmt(p.reply_agreement, '.1%')} | {acc} | {marks} |"
            )
        lines.append("")
    return "\n".join(lines)


def _kl_cell(point: Point, metric: str) -> str:
    """``metric``'s value with its interval (none for dense, whose KL is 0 by definition)."""
    ci = point.interval(metric)
    text = _fmt(getattr(point, metric), ".2e")
    return text if ci is None or point.mode == "dense" else f"{text} [{ci[0]:.1e}, {ci[1]:.1e}]"


def plot(points: list[Point], floors: list[Floor], path: str | os.PathLike) -> Path:
    """A row per workload: KL mean (dtype floors as dashed lines) and first-token KL against token
    reuse, log KL axes, 95% intervals as error bars, frontier points outlined."""
    fig = figure(points, floors)
    import matplotlib.pyplot as plt
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legends sit below the axes
    plt.close(fig)
    return path


def figure(points: list[Point], floors: list[Floor]):
    """The chart ``plot`` saves, as a matplotlib figure: a row of ``KL_METRICS`` panels per
    workload. A label has one colour in every panel, so a setting can be followed across them."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    workloads = list(dict.fromkeys(p.workload for p in points))
    most = max(sum(1 for p in points if p.workload == w) for w in workloads)
    row_height = 4.3 + 0.16 * (most + 1)  # the axes and, below them, a legend line per point
    fig, axes = plt.subplots(len(workloads), len(KL_METRICS), figsize=(6.5 * len(KL_METRICS), row_height * len(workloads)),
                             squeeze=False)
    colors = label_colors(points)
    for row, workload in zip(axes, workloads):
        for ax, metric in zip(row, KL_METRICS):
            _panel(ax, workload, points, floors if metric == "kl_mean" else [], metric, colors)
    fig.tight_layout()
    return fig


def label_colors(points: list[Point]) -> dict[str, str]:
    """A colour per point label, in the order labels first appear (``tab10``, ``tab20`` past ten
    labels; past twenty, colours repeat and the modes' markers still tell points apart)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    labels = list(dict.fromkeys(p.label for p in points if p.mode != "dense"))
    palette = colormaps["tab10" if len(labels) <= 10 else "tab20"].colors
    return {label: to_hex(palette[i % len(palette)]) for i, label in enumerate(labels)}


def _panel(ax, workload: str, points: list[Point], floors: list[Floor], metric: str, colors: dict[str, str]) -> None:
    markers = {"realign": "s", "cacheblend": "^", "kvcomm": "o", "kvblend": "P", "exact": "D"}
    mine = [p for p in points if p.workload == workload and p.mode != "dense" and getattr(p, metric) is not None]
    positive = [getattr(p, metric) for p in mine if getattr(p, metric) > 0] + \
        [f.kl_mean for f in floors if f.workload == workload and f.kl_mean > 0]
    clip = min(positive) / 3 if positive else 1e-12  # the axis' bottom: a floor far below is drawn there
    chunked = [p.noise_kl_mean for p in points if metric == "kl_mean" and p.workload == workload and p.noise_kl_mean is not None]
    if chunked:
        below = " (below the axis)" if max(chunked) < clip else ""
        ax.axhline(max(max(chunked), clip), color="gray", linestyle=":", linewidth=1, label=f"chunked floor {max(chunked):.0e}{below}")
    for f in floors:
        if f.workload == workload:
            ax.axhline(f.kl_mean, color="black", linestyle="--", linewidth=1, label=f"{f.dtype} floor {f.kl_mean:.1e}")
    for p in mine:
        y = max(getattr(p, metric), clip)
        ci = p.interval(metric)
        # a percentile interval need not hold the point itself (a skewed resample distribution)
        spread = None if ci is None else [[max(0.0, y - max(ci[0], clip))], [max(0.0, max(ci[1], clip) - y)]]
        ax.errorbar([p.token_reuse], [y], yerr=spread, fmt=markers.get(p.mode, "o"), markersize=8, capsize=3, color=colors[p.label],
                    markeredgecolor="black" if on_frontier(p, points, metric) else "none", label=p.label)
    ax.set_yscale("log")
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("token reuse rate")
    ax.set_ylabel(KL_METRICS[metric])
    ax.set_title(f"{workload}: {KL_METRICS[metric]} (outlined: frontier; bars: 95% over inputs)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="folders written by `kvcomm eval --out` (or their results.json)")
    parser.add_argument("--out", required=True, help="folder for frontier.md and frontier.png (created if missing)")


def run_frontier_command(args: argparse.Namespace) -> int:
    points, floors = load_results(args.results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(points, floors)
    (out / "frontier.md").write_text(text)
    chart = plot(points, floors, out / "frontier.png")
    print(text)
    print(f"wrote {out / 'frontier.md'} and {chart}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcomm.eval.frontier", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_frontier_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
