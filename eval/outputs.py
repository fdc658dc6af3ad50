"""Outputs of `kvcomm eval`: results.json, results.csv, PNG plots and the printed table."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from kvcomm.eval.evaluate import POOLED, EvalResult, EvalSettings, evaluate
from kvcomm.eval.summary import aggregate, dominance, dominance_lines


CSV_FIELDS = (
    "mode", "setting", "gamma", "max_anchors", "scope", "seed", "rows", "calls", "accuracy", "accuracy_ci_low",
    "accuracy_ci_high", "token_reuse_rate", "exact_token_rate", "estimated_token_rate", "agent_reuse_rate",
    "fallback_rate", "reply_agreement", "kl_mean", "noise_kl_mean", "kl_last_mean", "noise_kl_last_mean", "kl_max",
    "noise_kl_max", "top1_agreement", "noise_top1_agreement", "prompt_tokens", "exact_tokens", "estimated_tokens",
    "computed_tokens", "recomputed_tokens", "cached_tokens", "cached_token_rate", "ttft_mean_s", "ttft_p50_s",
    "ttft_p95_s", "timing_consistent_rate", "pool_bytes", "wall_s",
)

NOTES = {
    "kl": "KL(dense || mode) per computed prompt position on the dense top-k tokens plus an 'other' bucket: a lower "
          "bound on the full-vocabulary KL. Positions: those the mode computed after its injected prefix "
          "[reuse_end, prompt_tokens); the dense reference is a teacher-forced dense prefill of the same prompt.",
    "noise": "noise_*: the same metrics for dense vs the same prompt prefilled in two chunks through the KV cache "
             "(split at the mode's reuse_end, or at the middle when it reused nothing): the numerical noise floor.",
    "accuracy": "mean task score of the decider's reply; 95% Wilson interval (pooled: every (seed, row) a trial).",
    "token_reuse_rate": "(exact + estimated) / prompt tokens; cacheblend's and kvblend's recomputed tokens count as computed.",
    "agent_reuse_rate": "calls that reused some shared content / calls (KVCOMM's definition).",
    "cached_tokens": "prompt tokens the runtime's own prefix cache served instead of computing them (vLLM's "
                     "num_cached_tokens less what kvcomm injected; 0 on transformers), counted in computed_tokens; "
                     "cached_token_rate: over prompt tokens. Each run (and pass) has a prefix-cache namespace of its "
                     "own, so it is served only blocks its own earlier calls computed.",
    "reply_agreement": "calls whose greedy reply equals the dense run's reply for the same row and agent.",
    "pool_bytes": "sum of anchor pool bytes over the engine's pools after the run (pooled: mean over seeds).",
    "ttft": "seconds from the call's start (planning included) to the first token's logits. With KL on, taken from "
            "a separate timing pass without prompt logprobs (fresh engine, same order); timing_consistent_rate: "
            "share of calls where that pass made the same reuse decisions and reply as the measured pass.",
}


def to_json(result: EvalResult) -> dict:
    aggregates = aggregate(result)
    return {
        "workload": result.workload,
        "settings": {**dataclasses.asdict(result.settings), "rows": result.rows, "agents": list(result.agents),
                     "decider": result.decider, **result.meta},
        "elapsed_s": result.elapsed_s,
        "notes": NOTES,
        "aggregates": aggregates,
        "dominance": dominance(aggregates),
        "runs": [{"mode": r.run.mode, "setting": r.run.setting, "seed": r.seed, "pool_bytes": r.pool_bytes,
                  "anchors": r.anchors, "prefix_store_bytes": r.prefix_store_bytes, "wall_s": r.wall_s,
                  "shrinkage": r.shrinkage, "guard": r.guard} for r in result.runs],
        "calls": [dataclasses.asdict(c) for c in result.calls],
    }


def check_out_dir(out: str | os.PathLike) -> Path:
    """Create ``out`` if needed and make sure files can be written there (raises ValueError)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".kvcomm-eval-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out {path}: not writable ({error.strerror or error})") from None
    return path


def write_outputs(result: EvalResult, out: str | os.PathLike, plots: bool = True) -> dict[str, Path]:
    """Write results.json, results.csv and (``plots``) the PNGs into ``out``; returns the paths."""
    path = check_out_dir(out)
    data = to_json(result)
    files = {"json": path / "results.json", "csv": path / "results.csv"}
    files["json"].write_text(json.dumps(_finite(data), indent=2, default=_json_default, allow_nan=False) + "\n")
    agents = result.agents
    fields = list(CSV_FIELDS) + [f"ttft_{stat}_s_{i}_{a}" for i, a in enumerate(agents) for stat in ("mean", "p50", "p95")]
    with files["csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in data["aggregates"]:
            flat = {k: _csv_value(row.get(k)) for k in CSV_FIELDS}
            for entry in row["ttft_by_position"]:
                for stat in ("mean", "p50", "p95"):
                    flat[f"ttft_{stat}_s_{entry['position']}_{entry['agent']}"] = _csv_value(entry[f"ttft_{stat}_s"])
            writer.writerow(flat)
    if plots:
        from kvcomm.eval.plots import write_plots

        files.update(write_plots(data, path))
    return files


def _finite(value):
    """JSON has no NaN/Infinity: NaN becomes null, infinities the strings "inf"/"-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_table(result: EvalResult | dict, per_seed: bool = False) -> str:
    """A compact fixed-width table: one row per (mode, setting), pooled over seeds; with
    ``per_seed`` and several seeds, each seed's row too. ``result``: an ``EvalResult`` or
    its ``to_json`` dict."""
    rows = result["aggregates"] if isinstance(result, dict) else aggregate(result)
    seeds = {r["seed"] for r in rows if r["seed"] != POOLED}
    shown = [r for r in rows if r["seed"] == POOLED or (per_seed and len(seeds) > 1)]
    header = ("mode", "setting", "seed", "acc [95% CI]", "tok reuse", "agent reuse", "fallback", "KL", "noise KL",
              "top1", "noise top1", "reply eq", "TTFT p50", "TTFT p95", "prefix hit", "pool")
    lines = [header]
    for r in shown:
        ci = "" if r["accuracy_ci_low"] is None else f" [{r['accuracy_ci_low']:.2f},{r['accuracy_ci_high']:.2f}]"
        lines.append((
            r["mode"], r["setting"] or "-", str(r["seed"]),
            _fmt(r["accuracy"], ".2f") + ci,
            _fmt(r["token_reuse_rate"], ".1%"), _fmt(r["agent_reuse_rate"], ".1%"), _fmt(r["fallback_rate"], ".1%"),
            _fmt(r["kl_mean"], ".2e"), _fmt(r["noise_kl_mean"], ".1e"),
            _fmt(r["top1_agreement"], ".1%"), _fmt(r["noise_top1_agreement"], ".1%"), _fmt(r["reply_agreement"], ".1%"),
            _fmt(None if r["ttft_p50_s"] is None else r["ttft_p50_s"] * 1000, ".0f") + " ms",
            _fmt(None if r["ttft_p95_s"] is None else r["ttft_p95_s"] * 1000, ".0f") + " ms",
            _fmt(r.get("cached_token_rate"), ".1%"),
            _bytes(r["pool_bytes"]),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "-" * len(text[0]))
    text.append("KL: mean over computed prompt positions of KL(dense || mode) on dense top-k + 'other' (a lower bound); "
                "noise: dense vs two-chunk dense prefill of the same prompts. prefix hit: prompt tokens the runtime's "
                "own prefix cache (vLLM's) served the run from its own earlier calls, beyond what kvcomm injected.")
    return "\n".join(text)


def _bytes(value) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)  # pragma: no cover


def run_evaluation(workload, executor, out: str | os.PathLike, settings: EvalSettings | None = None, *,
                   progress: bool = True, kl: bool = True, meta: dict | None = None, plots: bool = True,
                   print_table: bool = True) -> EvalResult:
    """``evaluate`` + ``write_outputs`` + print the table: the whole of `kvcomm eval` minus
    argument parsing and model loading."""
    check_out_dir(out)
    result = evaluate(workload, executor, settings, progress=progress, kl=kl, meta=meta)
    write_outputs(result, out, plots=plots)
    if print_table:
        print(format_table(result))
        for line in dominance_lines(aggregate(result)):
            print(line)
    return result
