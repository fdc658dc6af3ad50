"""The `kvcomm eval` subcommand: argument parsing and the command itself.

Wire it into the main parser with ``add_eval_parser(subparsers)`` and dispatch
``args.command == "eval"`` to ``run_eval_command(args)`` (returns the exit status).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
from tqdm import tqdm

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import BASE_SOURCES, ReuseConfig
from kvcomm.reuse.scopes import DEFAULT_SCOPE, SCOPES
from kvcomm.reuse.strategies import MODES, RECOMPUTE_MODES
from kvcomm.services.quality_guard import QUALITY_BUDGET
from kvcomm.eval.evaluate import ALL_MODES, EMBEDDERS, EvalSettings
from kvcomm.eval.outputs import check_out_dir
from kvcomm.integrations.transformers.embedded import DTYPES

BACKENDS = ("transformers", "vllm")
AVAILABLE_BACKENDS = ("transformers", "vllm")


def _items(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list with no empty items, got {text!r}")
    return items


def _names(text: str, option: str, kind: str, valid) -> tuple[str, ...]:
    """A comma-separated list of distinct names from ``valid`` (``kind``: what one is called)."""
    names = _items(text, option)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {kind} {unknown[0]!r}; valid {kind}s: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a {kind} is listed twice in {text!r}")
    return tuple(names)


def parse_modes(text: str) -> tuple[str, ...]:
    return _names(text, "--modes", "mode", ALL_MODES)


def parse_scopes(text: str) -> tuple[str, ...]:
    return _names(text, "--reuse-scope", "reuse scope", tuple(SCOPES))


def parse_gammas(text: str) -> tuple[float, ...]:
    values = []
    for item in _items(text, "--gammas"):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--gammas: {item!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"--gammas: {item!r} must be a finite number >= 0")
        values.append(value)
    return tuple(dict.fromkeys(values))


def _int_list(text: str, what: str, minimum: int | None) -> tuple[int, ...]:
    values = []
    for item in _items(text, what):
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {item!r} is not an integer") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{what}: {value} must be >= {minimum}")
        values.append(value)
    return tuple(dict.fromkeys(values))


def parse_max_anchors(text: str) -> tuple[int, ...]:
    return _int_list(text, "--max-anchors", 1)


def parse_seeds(text: str) -> tuple[int, ...]:
    return _int_list(text, "--seeds", None)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0)


def ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``subparsers`` (from ``add_subparsers``); returns it.
    What each option does at length: docs/evaluation.md."""
    parser = subparsers.add_parser(
        "eval", help="evaluate reuse modes against dense prefill on a task workload",
        description="Run a workload densely and in each reuse mode; write accuracy, reuse, KL to dense, "
                    "reply agreement and TTFT to --out (results.json, results.csv, plots). "
                    "A LIST is comma-separated. Every option at length: docs/evaluation.md.",
    )
    parser.add_argument("--workload", required=True, metavar="W",
                        help="mmlu, gsm, humaneval, retrieval, or a workload file")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created if missing)")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="only the first N items")
    parser.add_argument("--warm-items", type=nonnegative_int, default=0, metavar="N",
                        help="calibrate each reuse engine on the N next items first (default 0)")
    parser.add_argument("--agents", type=positive_int, default=3, metavar="N",
                        help="agents before the decider (default 3)")
    parser.add_argument("--modes", type=parse_modes, default=ALL_MODES, metavar="LIST",
                        help=f"subset of {','.join(ALL_MODES)} (default all)")
    parser.add_argument("--reuse-scope", type=parse_scopes, default=(DEFAULT_SCOPE,), metavar="LIST",
                        help=f"of {', '.join(SCOPES)}; one run each (default {DEFAULT_SCOPE})")
    parser.add_argument("--gammas", type=parse_gammas, default=(PoolConfig.gamma,), metavar="LIST",
                        help=f"admission thresholds (default {PoolConfig.gamma})")
    parser.add_argument("--max-anchors", type=parse_max_anchors, default=(PoolConfig.max_anchors,), metavar="LIST",
                        help=f"anchors per pool, V (default {PoolConfig.max_anchors})")
    parser.add_argument("--seeds", type=parse_seeds, default=(0,), metavar="LIST",
                        help="input-order shuffle seeds (default 0)")
    parser.add_argument("--base-source", choices=BASE_SOURCES, default=ReuseConfig.base_source, metavar="SRC",
                        help=f"{' or '.join(BASE_SOURCES)} (default {ReuseConfig.base_source})")
    parser.add_argument("--pool", type=config_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a PoolConfig field, VALUE in JSON; repeatable")
    parser.add_argument("--recompute-ratio", type=ratio, default=0.15, metavar="R",
                        help="cacheblend and kvblend recompute ratio (default 0.15)")
    parser.add_argument("--embedder", choices=EMBEDDERS, default="kv", metavar="E",
                        help=f"anchor embedding: {' or '.join(EMBEDDERS)} (default kv)")
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="override the reply budget")
    parser.add_argument("--top-k", type=positive_int, default=20, metavar="K",
                        help="tokens kept per position for the KL bound (default 20)")
    parser.add_argument("--no-kl", action="store_true", help="skip the KL metrics (faster)")
    parser.add_argument("--single-pass", action="store_true", help="no separate timing pass (faster)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--backend", choices=BACKENDS, default="transformers", metavar="B",
                        help=f"{' or '.join(BACKENDS)} (default transformers)")
    parser.add_argument("--model", metavar="PATH", help="transformers model folder (default: embedded SmolLM2)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", metavar="DTYPE",
                        help=f"{', '.join(DTYPES)} (default float32)")
    parser.add_argument("--device", metavar="DEV", help="transformers backend: cpu (default), cuda or cuda:N")
    parser.add_argument("--noise-floor", choices=tuple(DTYPES), metavar="DTYPE",
                        help="also measure dense in DTYPE against --dtype")
    parser.add_argument("--quality-budget", type=quality_budget, default=argparse.SUPPRESS, metavar="TIMES",
                        help=f"run kvcomm and kvblend under a quality guard holding every slot to TIMES x the model's "
                        f"first-token KL floor (measured once per model and cached); 'off': no guard "
                        f"(default {QUALITY_BUDGET:g} on the transformers backend, off on vllm, which keeps no "
                        f"log-probabilities for the guard's twins)")
    parser.set_defaults(eval_command=run_eval_command)
    return parser


def quality_budget(text: str) -> float | None:
    """``--quality-budget``: a multiple of the floor >= 0, or "off" (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a multiple of the precision floor (e.g. 5) or 'off', got {text!r}")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"the quality budget must be a finite multiple >= 0, got {text!r}")
    return value


def settings_from_args(args, kl_floor: float | None = None) -> EvalSettings:
    return EvalSettings(
        modes=args.modes, gammas=args.gammas, max_anchors=args.max_anchors, seeds=args.seeds,
        base_source=args.base_source, recompute_ratio=args.recompute_ratio, top_k=args.top_k,
        timing_pass=not args.single_pass, pool=tuple(getattr(args, "pool", ())), embedder=getattr(args, "embedder", "kv"),
        warm_rows=getattr(args, "warm_items", 0),
        scopes=getattr(args, "reuse_scope", (DEFAULT_SCOPE,)),
        quality_budget=getattr(args, "quality_budget", QUALITY_BUDGET), kl_floor=kl_floor,
    )


def config_setting(text: str) -> tuple[str, object]:
    """A ``--pool`` ``NAME=VALUE``, the value in JSON (a bare word is taken as a string)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. shrinkage=false), got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def load_executor(model: str | None, backend: str = "transformers", dtype: str = "float32", device: str | None = None):
    """(executor, model path) for ``model`` or the embedded model on ``backend`` in ``dtype`` on ``device``."""
    from kvcomm.integrations.runtimes import load_executor as load

    return load(model, backend, dtype, device)


def dtype_noise_floor(workload, executor, other, top_k: int = 20, progress: bool = False, rows: int | None = None) -> dict:
    """How far the same model in another precision is from ``executor`` on the workload's prompts
    (its first ``rows`` rows; None: all).

    Every row runs densely on ``executor`` (the reference: its prompts and replies); each agent's
    prompt is then prefilled by ``other`` (the same checkpoint in another dtype) on exactly those
    token ids. Returns the KL(reference || other) bound on the reference's ``top_k`` tokens plus
    an "other" bucket (``kvcomm.core.divergence.kl_topk_other``) over every prompt position: its mean,
    median and max, the share of positions with the same most likely token, and the counts
    (``prompts``, ``positions``). No reuse is involved: this is the floor a reuse mode's KL
    (also measured against ``executor``) is read against.
    """
    from kvcomm.core.divergence import kl_topk_other, top1_matches, topk_reference
    from kvcomm.reuse.runner import run_row

    spec = workload.pipeline
    kls, tops, prompts, equal = [], [], 0, 0
    for row in tqdm(range(len(spec.inputs) if rows is None else rows), desc="noise floor", unit="row", disable=not progress, file=sys.stderr):
        for call in run_row(spec, row, executor, None, keep_logprobs=True):
            reference = topk_reference(call.prompt_logprobs, top_k)
            replayed = other.generate(list(call.prompt_ids), None, spec.max_new_tokens, None, keep_logprobs=True)
            logprobs = replayed.prompt_logprobs
            kls.append(kl_topk_other(reference, logprobs))
            tops.append(top1_matches(reference, logprobs))
            equal += tuple(replayed.reply_ids) == tuple(call.reply_ids)
            prompts += 1
    if not prompts:
        raise ValueError("the workload has no rows to measure a noise floor on")
    kl, top = torch.cat(kls), torch.cat(tops)
    return {"prompts": prompts, "positions": int(kl.numel()), "kl_mean": float(kl.mean()),
            "kl_median": float(kl.median()), "kl_max": float(kl.max()), "same_top1": float(top.double().mean()),
            "replies_equal": equal, "reply_agreement": equal / prompts}


def format_noise_floor(floor: dict) -> str:
    return (f"noise floor, dense {floor['dtype']} vs dense {floor['reference_dtype']} on the same {floor['prompts']} "
            f"prompts ({floor['positions']} positions): KL mean {floor['kl_mean']:.3g}, median "
            f"{floor['kl_median']:.3g}, max {floor['kl_max']:.3g}; same top-1 {100 * floor['same_top1']:.1f}%; "
            f"greedy replies equal {floor['replies_equal']}/{floor['prompts']} (the floor of 'reply eq')")


def run_eval_command(args, executor=None) -> int:
    """The ``eval`` command. ``executor``: use this one instead of loading ``--model``
    (tests). Returns 0, or 2 with a message on stderr for a usage or input problem."""
    from kvcomm.eval.outputs import run_evaluation
    from kvcomm.reuse.pipeline import PipelineError
    from kvcomm.core.rope import RopeError

    def fail(message: str) -> int:
        print(f"kvcomm eval: error: {message}", file=sys.stderr)
        return 2

    if args.backend not in AVAILABLE_BACKENDS:
        return fail(f"the {args.backend} backend is not available yet; use --backend transformers")
    if args.backend == "vllm" and (not args.no_kl or set(RECOMPUTE_MODES) & set(args.modes)):
        return fail("the vllm backend keeps no prompt log-probabilities and runs no CacheBlend recompute: "
                    "pass --no-kl and leave cacheblend and kvblend out of --modes, or use --backend transformers")
    owned = None  # an executor loaded here, closed here
    try:
        settings = settings_from_args(args)
        out = check_out_dir(args.out)
        from kvcomm.eval.workloads import load_workload

        limit = args.limit + settings.warm_rows if args.limit is not None else None
        workload = load_workload(args.workload, limit=limit, n_agents=args.agents, seed=0,
                                 max_new_tokens=args.max_new_tokens)
        if settings.warm_rows and args.limit is not None and len(workload.pipeline.inputs) < limit:
            raise ValueError(f"the workload has {len(workload.pipeline.inputs)} items: --limit {args.limit} plus "
                             f"--warm-items {settings.warm_rows} needs {limit}; lower one of them")
        floor_dtype = getattr(args, "noise_floor", None)
        if floor_dtype is not None:  # refused before any model is loaded
            if args.backend != "transformers":
                raise ValueError("--noise-floor runs the model on the transformers backend; use --backend transformers")
            if floor_dtype == getattr(args, "dtype", "float32"):
                raise ValueError(f"--noise-floor {floor_dtype} is the --dtype itself; name another dtype, "
                                 "e.g. --noise-floor bfloat16 with the default --dtype float32")
        model_path = getattr(args, "model", None)
        if executor is None:
            executor, model_path = load_executor(args.model, args.backend, getattr(args, "dtype", "float32"),
                                                 getattr(args, "device", None))
            owned = executor
        meta = {"model": model_path, "backend": args.backend, "dtype": getattr(args, "dtype", "float32"),
                "device": getattr(args, "device", None) or "cpu", "limit": args.limit,
                "warm_items": settings.warm_rows, "workload_arg": args.workload,
                "workload_seed": 0, "n_agents": args.agents,
                "max_new_tokens": workload.pipeline.max_new_tokens, "kl": not args.no_kl,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if floor_dtype is not None:
            other, _ = load_executor(args.model, "transformers", floor_dtype, getattr(args, "device", None))
            floor = dtype_noise_floor(workload, executor, other, settings.top_k, progress=not args.no_progress,
                                      rows=len(workload.pipeline.inputs) - settings.warm_rows)
            del other
            meta["dtype_noise_floor"] = {"dtype": floor_dtype, "reference_dtype": meta["dtype"], **floor}
            print(format_noise_floor(meta["dtype_noise_floor"]))
        guarded = settings.quality_budget is not None and any(MODES[m].estimates for m in settings.modes if m in MODES)
        if guarded and args.backend != "transformers":
            if hasattr(args, "quality_budget"):
                raise ValueError("the quality guard measures twins on the transformers backend: pass --quality-budget off "
                                 "with --backend vllm")
            print("quality guard off: the vllm backend keeps no log-probabilities for its twins (on by default on the "
                  "transformers backend)")
            settings, guarded = dataclasses.replace(settings, quality_budget=None), False
        if guarded:
            from kvcomm.eval.kl_floor import kl_floor

            floor = kl_floor(getattr(args, "model", None), meta["dtype"], settings.top_k, getattr(args, "device", None))
            settings = dataclasses.replace(settings, kl_floor=floor.kl_mean)
            meta["kl_floor"] = {"kl_mean": floor.kl_mean, "dtype": floor.dtype, "reference_dtype": floor.reference_dtype,
                                "prompts": len(floor.kl_values), "measured_at": floor.measured_at}
            print(f"quality budget: {settings.quality_budget:g} x {floor.words()} = "
                  f"{settings.quality_budget * floor.kl_mean:.3g} nats per slot")
        result = run_evaluation(workload, executor, out, settings, progress=not args.no_progress, kl=not args.no_kl,
                                meta=meta)
    except (PipelineError, RopeError, FileNotFoundError, ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        return fail(str(message))
    finally:
        if owned is not None:
            from kvcomm.integrations.runtimes import close_executor

            close_executor(owned)
    floor = meta.get("dtype_noise_floor")
    if floor is not None:  # the table's 'reply eq' beside what the precision alone changes
        print(f"reply eq floor: dense {floor['dtype']} vs dense {floor['reference_dtype']} on the same prompts: "
              f"{floor['reply_agreement']:.1%} ({floor['replies_equal']}/{floor['prompts']})")
    else:
        print("reply eq has no precision floor in this run: add --noise-floor bfloat16 (or float32) to measure how "
              "many greedy replies change with the precision alone")
    print(f"{len(result.calls)} agent calls in {result.elapsed_s:.1f} s; wrote results.json, results.csv and plots to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m kvcomm.eval.cli_eval ...``), same as ``kvcomm eval ...``."""
    parser = argparse.ArgumentParser(prog="kvcomm")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    return run_eval_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
