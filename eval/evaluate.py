"""Evaluation of reuse modes against dense prefill on a task workload (`kvcomm eval`).

For every seed the input rows are shuffled with that seed (which samples become anchors first
depends on the order), run once densely (no engine: the reference), then once per reuse mode
and setting, each with a fresh ``ReuseEngine``, in the same order. Only the anchor modes
(``kvcomm``, ``kvblend``) depend on the anchor-pool settings, so they run once per (gamma, V);
the other modes once per seed. Every reuse mode runs once per reuse scope asked for
(``EvalSettings.scopes``), all against the one dense reference.

Per agent call, against dense prefill of the *same prompt* the mode saw (teacher forced):

- ``kl``: KL(dense || mode) of the next-token distribution at each prompt position the mode
  computed after its injected prefix, ``[reuse_end, len(prompt))``, on the dense run's top-k
  tokens plus one "other" bucket holding the remaining mass. Merging outcomes never increases
  KL (log-sum inequality), so this is a **lower bound** on the full-vocabulary KL.
- ``top1``: the share of those positions whose most likely token is the same.
- ``noise``: the same two numbers for dense vs dense computed differently (the prompt
  prefilled in two chunks through the KV cache, split where the mode's prefix ends), the
  floating-point noise floor a mode's KL is to be read against.
- ``reply_equal``: the mode's greedy reply equals the dense run's reply for that row and agent.

Aggregates per (mode, setting, seed) and pooled over seeds (``kvcomm.eval.summary``); outputs with
``kvcomm.eval.outputs`` (results.json, results.csv, PNG plots, the table).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.scopes import DEFAULT_SCOPE, SCOPES
from kvcomm.reuse.strategies import MODES
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.executor import namespaced
from kvcomm.core.divergence import KL_TOP_K, TopK, kl_topk_other, top1_matches, topk_reference
from kvcomm.reuse.runner import AgentCall, run_agent, run_row
from kvcomm.services.quality_guard import DEFAULT_FRACTION, QUALITY_BUDGET, GuardConfig, QualityGuard

DENSE = "dense"
REUSE_MODES = ("exact", "realign", "cacheblend", "kvcomm", "kvblend")
"""``MODES``, in the order the results list them."""
ALL_MODES = (DENSE, *REUSE_MODES)
POOLED = "pooled"
EMBEDDERS = ("kv", "minilm")
"""How the anchor pool narrows its candidates: ``kv`` pools the segment's base values
(``KVEmbedding``, the engine default); ``minilm`` embeds the segment's decoded text with
all-MiniLM-L6-v2 (``SentenceEmbedder``)."""


# -- settings -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSettings:
    """What to run. ``modes`` may include "dense" (always run, as the reference, anyway).
    ``gammas`` x ``max_anchors`` is the grid for the anchor modes "kvcomm" and "kvblend"; the
    other modes use the first of each. ``base_source``: ``ReuseConfig.base_source`` of every reuse mode. ``top_k``: tokens
    kept per position for the KL bound. ``noise``: also measure the dense-vs-dense noise floor
    (one extra prefill per call). ``timing_pass``: with KL on, take TTFT from a separate pass
    without logprobs (see ``evaluate``). ``warm_up``: run the first row densely once,
    unrecorded, before anything is timed. ``warm_rows``: the workload's last N rows calibrate
    every fresh reuse engine and are not evaluated (see ``evaluate``). ``scopes``: the reuse
    scopes (``SCOPES``) every reuse mode runs in, one run each; unless it is the default
    scope alone, each run's setting names its scope."""

    modes: tuple[str, ...] = ALL_MODES
    gammas: tuple[float, ...] = (PoolConfig.gamma,)
    max_anchors: tuple[int, ...] = (PoolConfig.max_anchors,)
    seeds: tuple[int, ...] = (0,)
    base_source: str = ReuseConfig.base_source
    recompute_ratio: float = ReuseConfig.recompute_ratio
    top_k: int = KL_TOP_K
    noise: bool = True
    timing_pass: bool = True
    warm_up: bool = True
    warm_rows: int = 0
    pool: tuple[tuple[str, object], ...] = ()
    """Further ``PoolConfig`` fields of the kvcomm runs, as (name, value) pairs."""
    embedder: str = "kv"
    """One of ``EMBEDDERS``: the anchor embedding of every reuse run."""
    scopes: tuple[str, ...] = (DEFAULT_SCOPE,)
    quality_budget: float | None = QUALITY_BUDGET
    """The anchor-mode runs run under a quality guard holding every slot to this many times
    ``kl_floor`` (``GuardConfig.for_floor``; None: no guard)."""
    kl_floor: float | None = None
    """The model's first-token KL floor, nats (``kvcomm.eval.kl_floor``; `kvcomm eval` measures
    it once per model); None: no guard."""
    guard_fraction: float = DEFAULT_FRACTION
    """The guard's sampling: at most ``100 * guard_fraction`` dense twins per 100 reusing requests."""

    def guard(self, run: "RunSpec") -> GuardConfig | None:
        """The quality guard of ``run``: the anchor modes' when a budget and a floor are set, else None."""
        if self.quality_budget is None or self.kl_floor is None or not MODES[run.mode].estimates:
            return None
        return GuardConfig.for_floor(self.kl_floor, self.quality_budget, fraction=self.guard_fraction)

    def __post_init__(self) -> None:
        for name in ("modes", "gammas", "max_anchors", "seeds", "pool", "scopes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = []
        if not self.modes:
            problems.append(f"modes is empty; choose from {', '.join(ALL_MODES)}")
        unknown = [m for m in self.modes if m not in ALL_MODES]
        if unknown:
            problems.append(f"unknown mode {unknown[0]!r}; valid modes: {', '.join(ALL_MODES)}")
        if len(set(self.modes)) != len(self.modes):
            problems.append("modes are listed twice")
        if not self.gammas or any(not (isinstance(g, (int, float)) and g >= 0 and math.isfinite(g)) for g in self.gammas):
            problems.append(f"gammas must be finite numbers >= 0, at least one (got {list(self.gammas)})")
        if not self.max_anchors or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.max_anchors):
            problems.append(f"max_anchors must be integers >= 1, at least one (got {list(self.max_anchors)})")
        fields = {f.name for f in dataclasses.fields(PoolConfig)} - {"gamma", "max_anchors"}
        unknown_pool = [k for k, _ in self.pool if k not in fields]
        if unknown_pool:
            problems.append(f"unknown pool setting {unknown_pool[0]!r}; valid: {', '.join(sorted(fields))}")
        unknown_scope = [s for s in self.scopes if s not in SCOPES]
        if not self.scopes or unknown_scope or len(set(self.scopes)) != len(self.scopes):
            problems.append(f"scopes must be distinct reuse scopes, at least one (got {list(self.scopes)}; "
                            f"valid: {', '.join(SCOPES)})")
        if not unknown_pool:
            try:  # the pool and reuse configs own these rules
                ReuseConfig(pool=PoolConfig(**dict(self.pool)), base_source=self.base_source)
            except (ValueError, TypeError) as error:
                problems.append(str(error))
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in self.seeds):
            problems.append(f"seeds must be integers, at least one (got {list(self.seeds)})")
        if len(set(self.seeds)) != len(self.seeds):
            problems.append("seeds are listed twice")
        if not 0 < self.recompute_ratio <= 1:
            problems.append(f"recompute_ratio must be in (0, 1] (got {self.recompute_ratio})")
        if self.top_k < 1:
            problems.append(f"top_k must be >= 1 (got {self.top_k})")
        if isinstance(self.warm_rows, bool) or not isinstance(self.warm_rows, int) or self.warm_rows < 0:
            problems.append(f"warm_rows must be an integer >= 0 (got {self.warm_rows!r})")
        if self.quality_budget is not None or self.kl_floor is not None:
            try:  # the guard's config owns these rules
                GuardConfig.for_floor(0.0 if self.kl_floor is None else self.kl_floor,
                                      QUALITY_BUDGET if self.quality_budget is None else self.quality_budget,
                                      fraction=self.guard_fraction)
            except (ValueError, TypeError) as error:
                problems.append(str(error))
        if self.embedder not in EMBEDDERS:
            problems.append(f"unknown embedder {self.embedder!r}; valid: {', '.join(EMBEDDERS)}")
        if problems:
            raise ValueError("invalid eval settings: " + "; ".join(problems))

    def runs(self) -> list["RunSpec"]:
        """The reuse runs of one seed, in order (dense excluded: it always runs first)."""
        out = []
        named = self.scopes != (DEFAULT_SCOPE,)
        for mode in self.modes:
            if mode == DENSE:
                continue
            for scope in self.scopes:
                scope = scope if named else None
                if MODES[mode].estimates:
                    out += [RunSpec(mode, g, v, scope) for g in self.gammas for v in self.max_anchors]
                else:
                    out.append(RunSpec(mode, None, None, scope))
        return out

    def config(self, run: "RunSpec") -> ReuseConfig:
        pool = PoolConfig(
            gamma=run.gamma if run.gamma is not None else self.gammas[0],
            max_anchors=run.max_anchors if run.max_anchors is not None else self.max_anchors[0],
            **dict(self.pool),
        )
        return ReuseConfig(pool=pool, mode=run.mode, scope=run.scope or self.scopes[0],
                           recompute_ratio=self.recompute_ratio, base_source=self.base_source)


@dataclass(frozen=True)
class RunSpec:
    """One reuse run of a seed: its mode, anchor-pool setting (anchor modes only) and reuse
    scope (None: the evaluation's only scope, the default)."""

    mode: str
    gamma: float | None = None
    max_anchors: int | None = None
    scope: str | None = None

    @property
    def setting(self) -> str:
        """The run's settings as the results name them: "gamma=1,V=20", "scope=content", both, or ""."""
        parts = [] if self.gamma is None and self.max_anchors is None else [f"gamma={self.gamma:g}", f"V={self.max_anchors}"]
        return ",".join(parts + ([f"scope={self.scope}"] if self.scope is not None else []))

    @property
    def label(self) -> str:
        return f"{self.mode} {self.setting}".strip()


DENSE_RUN = RunSpec(DENSE)


# -- the reference: dense prefill of a given prompt -----------------------------------------


class DenseReference:
    """Teacher-forced dense prefills of prompts, compressed to ``TopK`` and cached by prompt;
    the two-chunk noise-floor prefills cached by (prompt, split)."""

    def __init__(self, executor, top_k: int = KL_TOP_K, with_noise: bool = True):
        self.executor = executor
        self.top_k = top_k
        self.with_noise = with_noise
        self._dense: dict[tuple[int, ...], TopK] = {}
        self._noise: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _logprobs(self, ids: Sequence[int], prefix=None):
        generation = self.executor.generate(list(ids), prefix, 0, None, keep_logprobs=True)
        if generation.prompt_logprobs is None:
            raise RuntimeError("the executor returned no prompt_logprobs with keep_logprobs=True")
        return generation

    def dense(self, ids: tuple[int, ...]) -> TopK:
        """The dense distribution at every prompt position ``[0, len(ids))``."""
        if ids not in self._dense:
            self._dense[ids] = topk_reference(self._logprobs(ids).prompt_logprobs, self.top_k)
        return self._dense[ids]

    def noise(self, ids: tuple[int, ...], reuse_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL bound, top-1 match) at positions ``[reuse_end, len(ids))`` of dense vs the same
        prompt prefilled in two chunks through the KV cache: ``[0, split)`` then
        ``[split, n)``, split at ``reuse_end`` (the same structure as the mode's injected
        prefix and computed tail), or in the middle when ``reuse_end`` is 0."""
        n = len(ids)
        key = (ids, reuse_end)
        if key not in self._noise:
            reference = self.dense(ids)
            split = reuse_end if reuse_end >= 1 else n // 2
            if split < 1:  # a one-token prompt: no second way to compute it
                self._noise[key] = (torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool))
                return self._noise[key]
            first_logits = split > reuse_end  # the first chunk's positions are compared only when reuse_end < split
            first = self.executor.generate(list(ids[:split]), None, 0, None, keep_logprobs=first_logits)
            tail = self._logprobs(ids, first.computed).prompt_logprobs
            parts = [(split, tail)]
            if first_logits:
                parts.insert(0, (0, first.prompt_logprobs[reuse_end:]))
            kls, tops = [], []
            for start, lp in parts:
                ref = _slice(reference, max(start, reuse_end), max(start, reuse_end) + lp.shape[0])
                kls.append(kl_topk_other(ref, lp))
                tops.append(top1_matches(ref, lp))
            self._noise[key] = (torch.cat(kls), torch.cat(tops))
        return self._noise[key]


def _slice(ref: TopK, start: int, end: int) -> TopK:
    return TopK(ref.ids[start:end], ref.logprobs[start:end], ref.log_other[start:end], ref.top1[start:end])


# -- the evaluation loop ------------------------------------------------------------------


@dataclass
class CallRecord:
    """One agent call of one run (see module docstring for the metrics)."""

    seed: int
    mode: str
    setting: str
    gamma: float | None
    max_anchors: int | None
    order: int  # position of the row in this seed's shuffled order
    input_index: int
    agent: str
    agent_position: int
    prompt_tokens: int
    exact_tokens: int
    estimated_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    cached_tokens: int  # of computed_tokens, those the runtime's own prefix cache served (vLLM's; 0 on transformers)
    preamble_tokens: int  # of computed_tokens, those computed before the reused ones (an agent's new system prompt)
    shared_tokens: int
    reused_shared_tokens: int
    reused: bool
    fallback: bool
    note: str
    ttft_s: float
    reply_tokens: int
    reply_equal: bool
    score: float | None  # task score of the decider's reply, None for other agents
    kl_positions: int
    kl_sum: float
    kl_max: float
    kl_last: float  # at the last prompt position: the first reply token's distribution
    top1_matches: int
    noise_split: int | None
    noise_kl_sum: float | None
    noise_kl_max: float | None
    noise_kl_last: float | None
    noise_top1_matches: int | None
    reply: str
    measured_pass_ttft_s: float | None = None  # TTFT of the pass that kept logprobs, when ttft_s is from a timing pass
    timing_consistent: bool | None = None  # the timing pass made the same decisions and reply (None: no timing pass)


@dataclass
class RunResult:
    seed: int
    run: RunSpec
    calls: list[CallRecord]
    pool_bytes: int
    anchors: dict[str, int]
    prefix_store_bytes: int
    wall_s: float
    shrinkage: dict[str, dict] = field(default_factory=dict)
    """Per "slot/part" of the engine's pools: the shrinkage fit after the run (``_shrinkage_state``)."""
    guard: dict | None = None
    """The run's quality guard after it (None: unguarded): budget (nats), fraction, twins (dense
    twins run, each a prefill of a call's prompt), slots over budget (disabled or tightened)."""


@dataclass
class EvalResult:
    workload: str
    settings: EvalSettings
    agents: tuple[str, ...]
    decider: str
    rows: int
    runs: list[RunResult] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def calls(self) -> list[CallRecord]:
        return [c for r in self.runs for c in r.calls]


def _decider(spec) -> str:
    names = [a.name for a in spec.agents]
    return "decider" if "decider" in names else names[-1]


def _score(workload, row: int, reply: str) -> float | None:
    """The decider's score on ``row``; None when the workload has no reference for it."""
    references = getattr(workload, "references", None)
    if references is not None and references[row] is None:
        return None
    value = float(workload.score(row, reply))
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"workload {workload.name!r} scored row {row} as {value}, outside [0, 1]")
    return value


def _record(
    call: AgentCall, run: RunSpec, seed: int, order: int, position: int, dense_reply: tuple[int, ...],
    score: float | None, reference: DenseReference | None,
) -> CallRecord:
    p = call.provenance
    ids = tuple(call.prompt_ids)
    n = len(ids)
    kl_positions, kl_sum, kl_max, kl_last, top1 = 0, 0.0, 0.0, 0.0, 0
    noise = (None, None, None, None, None)
    if reference is not None:
        lp = call.prompt_logprobs
        if lp is None:
            raise RuntimeError("run_row returned no prompt_logprobs with keep_logprobs=True")
        count = lp.shape[0]
        if count != n - p.reuse_end:
            raise RuntimeError(f"{count} prompt logprob rows for {n - p.reuse_end} computed positions")
        dense = reference.dense(ids).tail(count)
        kl = kl_topk_other(dense, lp)
        kl_positions, kl_sum = count, float(kl.sum())
        kl_max, kl_last = float(kl.max()) if count else 0.0, float(kl[-1]) if count else 0.0
        top1 = int(top1_matches(dense, lp).sum())
        if reference.with_noise:
            split = p.reuse_end if p.reuse_end >= 1 else n // 2
            noise_kl, noise_top = reference.noise(ids, p.reuse_end)
            noise = (
                split, float(noise_kl.sum()), float(noise_kl.max()) if count else 0.0,
                float(noise_kl[-1]) if count else 0.0, int(noise_top.sum()),
            )
    return CallRecord(
        seed=seed, mode=run.mode, setting=run.setting, gamma=run.gamma, max_anchors=run.max_anchors, order=order,
        input_index=call.input_index, agent=call.agent, agent_position=position,
        prompt_tokens=p.prompt_tokens, exact_tokens=p.exact_tokens, estimated_tokens=p.estimated_tokens,
        computed_tokens=p.computed_tokens, recomputed_tokens=getattr(p, "recomputed_tokens", 0),
        cached_tokens=getattr(p, "cached_tokens", 0), preamble_tokens=getattr(p, "preamble_tokens", 0), shared_tokens=p.shared_tokens,
        reused_shared_tokens=p.reused_shared_tokens, reused=p.reused,
        fallback=p.fallback, note=p.note, ttft_s=float(p.ttft_s), reply_tokens=len(call.reply_ids),
        reply_equal=tuple(call.reply_ids) == tuple(dense_reply), score=score,
        kl_positions=kl_positions, kl_sum=kl_sum, kl_max=kl_max, kl_last=kl_last, top1_matches=top1,
        noise_split=noise[0], noise_kl_sum=noise[1], noise_kl_max=noise[2], noise_kl_last=noise[3],
        noise_top1_matches=noise[4], reply=call.reply,
    )


def _named_pools(engine: ReuseEngine) -> list[tuple[object, object]]:
    """(slot name or index, pool) of every pool the engine holds (a dict, or a list for test engines)."""
    return list(engine.pools.items() if isinstance(engine.pools, dict) else enumerate(engine.pools))


def _pool_state(engine: ReuseEngine | None) -> tuple[int, dict[str, int], int]:
    if engine is None:
        return 0, {}, 0
    pools = _named_pools(engine)
    bases = {id(a.base.keys): a.base.nbytes for _, pool in pools for a in pool.anchors}  # one base per content, counted once
    deviations = sum(d.nbytes for _, pool in pools for a in pool.anchors for d in a.deviations.values())
    return (
        int(sum(bases.values()) + deviations),
        {str(slot): len(pool) for slot, pool in pools},
        int(engine.prefix_store.nbytes),
    )


def _shrinkage_state(engine: ReuseEngine | None) -> dict[str, dict]:
    """Per pool slot, template slot and part: observed pairs, mean key/value factor and the
    error ratio of the shrunk estimate to realignment's on those pairs."""
    if engine is None:
        return {}
    out = {}
    for name, pool in _named_pools(engine):
        for ((template, slot), part), fit in sorted(pool.fits.items()):
            factors, ratio = fit.factors(1), fit.error_ratio()
            out[f"{name}/{template}:{slot}/{part}"] = {
                "pairs": fit.pairs, "key_factor_mean": float(factors[0].mean()), "value_factor_mean": float(factors[1].mean()),
                "key_error_ratio": ratio[0], "value_error_ratio": ratio[1],
            }
    return out


def _guard_state(guard: QualityGuard | None) -> dict | None:
    """What a run's guard did (``RunResult.guard``)."""
    if guard is None:
        return None
    metrics = guard.metrics()
    return {"budget": guard.config.budget, "fraction": guard.config.fraction, "twins": metrics["measured"],
            "twin_s": metrics["twin_seconds"],
            "over_budget": sorted(slot for slot, m in metrics["slots"].items() if m["disabled"] or m["tightenings"]),
            "kl_mean": {slot: m["kl_mean"] for slot, m in metrics["slots"].items()}}


def _signature(call: AgentCall) -> tuple:
    """What a deterministic rerun must reproduce: token provenance and the reply."""
    p = call.provenance
    return (p.exact_tokens, p.estimated_tokens, p.computed_tokens, getattr(p, "recomputed_tokens", 0), tuple(call.reply_ids))


def default_engine_factory(embedder: str, executor) -> Callable[[Any, ReuseConfig], ReuseEngine]:
    """Fresh ``ReuseEngine`` s with the anchor embedding named ``embedder`` (one of ``EMBEDDERS``);
    ``minilm`` loads the sentence model once and decodes segments with ``executor.decode``."""
    if embedder == "kv":
        return lambda rotary, config: ReuseEngine(rotary, config)
    if embedder == "minilm":
        from kvcomm.integrations.transformers.sentence_embedder import SentenceEmbedder

        text_embedder = SentenceEmbedder(executor.decode)
        return lambda rotary, config: ReuseEngine(rotary, config, text_embedder)
    raise ValueError(f"unknown embedder {embedder!r}; valid: {', '.join(EMBEDDERS)}")


def evaluate(
    workload, executor, settings: EvalSettings | None = None, *, progress: bool = True,
    kl: bool = True, meta: dict | None = None, engine_factory: Callable[[Any, ReuseConfig], ReuseEngine] | None = None,
) -> EvalResult:
    """Run ``workload`` (``.name``, ``.pipeline``, ``.score(row, reply)``) on ``executor``
    for every seed: dense, then every reuse run of ``settings``; see the module docstring.

    ``kl=False`` skips the KL / noise metrics (no logprobs kept, no reference prefills).
    With ``kl`` and ``settings.timing_pass``, every run is done twice with fresh engines: a
    timing pass without logprobs (TTFT is taken from it: keeping prompt logprobs computes the
    full-vocabulary logits of every computed position before the first token, which would
    inflate TTFT in proportion to the computed tokens), then the measured pass. Both must make
    the same reuse decisions and replies (``timing_consistent`` per call).
    ``engine_factory(rotary, config)``: how a fresh engine is made (default: a ``ReuseEngine``
    with ``settings.embedder``).
    With ``settings.warm_rows`` = N, the last N rows of ``workload.pipeline.inputs`` are not
    evaluated: every fresh reuse engine first runs them in order as calibration traffic
    (dense prefills that learn everything, ``ReuseEngine.calibration_plan``), unrecorded, so
    the evaluated rows meet pools of up to V anchors per slot, as a long-running server's
    would be, instead of empty ones.

    On a runtime with a prefix cache of its own (vLLM), every pass of every run (dense
    included), the warm-up and each engine's calibration run in a namespace of their own
    (``namespaced``): a run is served only blocks its own earlier calls computed (as stock vLLM
    with prefix caching would serve one user's traffic), never those of another run, the
    warm-up or the calibration; ``CallRecord.cached_tokens`` counts what it was served.
    """
    settings = settings or EvalSettings()
    spec = workload.pipeline
    runs = settings.runs()
    factory = engine_factory or (default_engine_factory(settings.embedder, executor) if runs else None)
    if runs and getattr(executor, "rotary", None) is None:
        raise ValueError("this executor has no verified rotary embedding (dense only): reuse modes cannot run")
    configs = {run: settings.config(run) for run in runs}  # validates every config before any work
    agents = tuple(a.name for a in spec.agents)
    decider = _decider(spec)
    timing_pass = kl and settings.timing_pass
    evaluated = len(spec.inputs) - settings.warm_rows
    if evaluated < 1:
        raise ValueError(f"warm_rows {settings.warm_rows} leaves none of the workload's {len(spec.inputs)} rows to evaluate")
    warm = range(evaluated, len(spec.inputs))
    result = EvalResult(getattr(workload, "name", "workload"), settings, agents, decider, evaluated, meta=dict(meta or {}))
    result.meta.setdefault("kl", kl)
    result.meta.setdefault("ttft_source", "separate timing pass without logprobs" if timing_pass else
                           "the measured pass" + (" (with prompt logprobs: inflated by full-vocabulary logits)" if kl else ""))
    reference = DenseReference(executor, settings.top_k, settings.noise) if kl else None
    passes = 2 if timing_pass else 1
    total = len(settings.seeds) * ((1 + len(runs)) * evaluated + len(runs) * len(warm)) * len(agents) * passes
    bar = tqdm(total=total, desc=f"eval {result.workload}", unit="call", disable=not progress, file=sys.stderr)
    tick = lambda _: bar.update()  # noqa: E731

    def _calibrated(engine: ReuseEngine) -> ReuseEngine:
        calibration = namespaced(executor, "eval-calibration")
        for row in warm:
            run_row(spec, row, calibration, engine, on_call=tick, calibrate=True)
        return engine

    started = time.perf_counter()
    try:
        if settings.warm_up and spec.inputs:
            bar.set_postfix_str("warm-up")
            # first-call overheads (allocator, kernels) out of the timings; no prefix-cache hits for anyone
            run_row(spec, 0, namespaced(executor, "eval-warm-up"), None)
        for seed in settings.seeds:
            order = list(range(evaluated))
            random.Random(seed).shuffle(order)
            dense_replies: dict[tuple[int, str], tuple[int, ...]] = {}
            for run in [DENSE_RUN, *runs]:
                make = (lambda: None) if run.mode == DENSE else (lambda: _calibrated(factory(executor.rotary, configs[run])))
                timing: dict[tuple[int, str], tuple[float, tuple]] = {}
                guarded = None if run.mode == DENSE else settings.guard(run)
                if timing_pass:
                    bar.set_postfix_str(f"seed {seed} {run.label} (timing)")
                    engine, runner = make(), namespaced(executor, f"eval-seed{seed}-{run.mode}-timing")
                    step = run_agent if guarded is None else QualityGuard(guarded).run_agent
                    for row in order:
                        for call in run_row(spec, row, runner, engine, on_call=tick, step=step):
                            timing[(row, call.agent)] = (float(call.provenance.ttft_s), _signature(call))
                    del engine
                bar.set_postfix_str(f"seed {seed} {run.label}")
                engine, runner = make(), namespaced(executor, f"eval-seed{seed}-{run.mode}")
                guard = None if guarded is None else QualityGuard(guarded)
                run_started = time.perf_counter()
                records: list[CallRecord] = []
                for position_in_order, row in enumerate(order):
                    calls = run_row(spec, row, runner, engine, on_call=tick, keep_logprobs=kl,
                                    step=run_agent if guard is None else guard.run_agent)
                    for agent_position, call in enumerate(calls):
                        if run.mode == DENSE:
                            dense_replies[(row, call.agent)] = tuple(call.reply_ids)
                        score = _score(workload, row, call.reply) if call.agent == decider else None
                        record = _record(call, run, seed, position_in_order, agent_position,
                                         dense_replies[(row, call.agent)], score, reference)
                        if timing_pass:
                            ttft, signature = timing[(row, call.agent)]
                            record.measured_pass_ttft_s, record.ttft_s = record.ttft_s, ttft
                            record.timing_consistent = signature == _signature(call)
                        records.append(record)
                    del calls
                pool_bytes, anchors, store_bytes = _pool_state(engine)
                result.runs.append(RunResult(seed, run, records, pool_bytes, anchors, store_bytes, time.perf_counter() - run_started,
                                             _shrinkage_state(engine), _guard_state(guard)))
    finally:
        bar.close()
    result.elapsed_s = time.perf_counter() - started
    return result
