"""Run a declarative pipeline on an executor, densely or with reuse, and record provenance."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.executor import Executor, Generation, OnToken
from kvcomm.reuse.pipeline import AgentSpec, PipelineSpec, Slot
from kvcomm.reuse.plan import Provenance, ReusePlan
from kvcomm.core.segments import Prompt, Segment


@dataclass(frozen=True)
class AgentCall:
    """One agent's turn on one input row.

    prompt_logprobs: with ``keep_logprobs``, the next-token log-probabilities at the prompt
    positions ``[provenance.reuse_end, len(prompt_ids))`` (``[positions, vocab]`` float32), to
    compare with a dense run of the same prompt at the same positions; None by default.
    """

    agent: str
    input_index: int
    prompt_ids: tuple[int, ...]
    reply_ids: tuple[int, ...]
    reply: str
    provenance: Provenance
    prompt_logprobs: torch.Tensor | None = None


def build_prompt(executor: Executor, agent: AgentSpec, shared: Mapping[str, Segment | None]) -> Prompt:
    """The agent's chat-rendered prompt with each slot filled by its shared segment.

    ``shared`` maps slot name -> the content's segment (its ``slot`` is rewritten to the
    slot name), or None for empty content, which is left out.
    """
    segments: list[Segment] = []
    for part in executor.render(agent.system, agent.parts):
        if isinstance(part, Slot):
            content = shared[part.name]
            if content is not None:
                segments.append(Segment(content.token_ids, slot=part.name, shared_id=content.shared_id))
        else:
            ids = executor.encode(part)
            if ids:
                segments.append(Segment(tuple(ids)))
    return Prompt(agent.name, tuple(segments))


def _content(executor: Executor, text: str) -> Segment | None:
    ids = executor.encode(text)
    return Segment(tuple(ids), slot="_") if ids else None


def run_agent(
    executor: Executor, engine: ReuseEngine | None, prompt: Prompt, max_new_tokens: int, keep_logprobs: bool = False,
    on_token: OnToken | None = None, calibrate: bool = False,
) -> tuple[Generation, Provenance]:
    """One call: plan, materialize + generate, learn. Returns (Generation, Provenance).

    engine None: a dense call. keep_logprobs: ask the executor for ``Generation.prompt_logprobs``
    (computed positions only). on_token: passed to the executor (streaming, cancellation; see
    ``OnToken``). calibrate: compute the prompt densely and learn everything from it
    (``ReuseEngine.calibration_plan``). A quality guard runs the same step with its checks
    around it (``QualityGuard.run_agent``).
    """
    started = time.perf_counter()
    if engine is None:
        generation = executor.generate(prompt.token_ids, None, max_new_tokens, started, **_options(keep_logprobs, on_token))
        return generation, dense_provenance(prompt, generation.ttft_s, generation.cached_tokens)
    provide = engine.base_provider(executor)
    plan = engine.calibration_plan(prompt, provide) if calibrate else engine.plan(prompt, provide, computes_preambles(executor))
    planned = time.perf_counter() - started
    generation = execute(executor, engine, plan, max_new_tokens, started, keep_logprobs, on_token)
    engine.learn(plan, generation.computed, generation.reply_ids, generation.reply_kv, generation.preamble)
    return generation, plan.provenance(generation.ttft_s, generation.cached_tokens, planned)


def execute(
    executor: Executor, engine: ReuseEngine, plan: ReusePlan, max_new_tokens: int, started: float,
    keep_logprobs: bool = False, on_token: OnToken | None = None,
) -> Generation:
    """Materialize ``plan``'s reused prefix and generate on it; the positions a selective
    recompute (``plan.blend``) recomputed are recorded in ``plan.recompute``."""
    options = _options(keep_logprobs, on_token)
    if plan.blend is not None:
        options["blend"] = plan.blend
    if plan.preamble_length:
        options["preamble"] = (plan.exact_length, plan.pieces_start)
    with engine.materialized(plan) as prefix:  # executors copy the prefix into their own cache
        generation = executor.generate(plan.prompt.token_ids, prefix, max_new_tokens, started, **options)
    if plan.blend is not None:
        plan.record_recompute(generation.recomputed)
    return generation


def computes_preambles(executor: Executor) -> bool:
    """Whether ``executor`` computes a plan's preamble before injecting its pieces (``Executor.computes_preambles``)."""
    return bool(getattr(executor, "computes_preambles", False))


def _options(keep_logprobs: bool, on_token: OnToken | None) -> dict:
    """The optional ``Executor.generate`` arguments that are set (executors without them keep working)."""
    options: dict = {"keep_logprobs": True} if keep_logprobs else {}
    if on_token is not None:
        options["on_token"] = on_token
    return options


def dense_provenance(prompt: Prompt, ttft_s: float | None, cached_tokens: int = 0) -> Provenance:
    """The provenance of a call computed densely without an engine (``cached_tokens``: those of
    its prompt tokens the runtime's own prefix cache served, ``Generation.cached_tokens``)."""
    shared = sum(len(s) for s in prompt.segments if s.is_shared)
    return Provenance(len(prompt), 0, 0, len(prompt), shared, 0, False, "dense", ttft_s, cached_tokens=cached_tokens)


def run_row(
    spec: PipelineSpec, row_index: int, executor: Executor, engine: ReuseEngine | None,
    on_call: Callable[[AgentCall], None] | None = None, keep_logprobs: bool = False, calibrate: bool = False,
    step: Callable[..., tuple[Generation, Provenance]] = run_agent,
) -> list[AgentCall]:
    """Run every agent, in order, on input row ``row_index``; ``keep_logprobs`` fills each
    call's ``prompt_logprobs``; ``calibrate`` goes to every call; ``step`` runs one agent call
    (``run_agent``, or e.g. a quality guard's ``QualityGuard.run_agent``)."""
    row = spec.inputs[row_index]
    shared: dict[str, Segment | None] = {name: _content(executor, row[name]) for name in spec.input_slots}
    calls = []
    for agent in spec.agents:
        prompt = build_prompt(executor, agent, shared)
        generation, provenance = step(executor, engine, prompt, spec.max_new_tokens, keep_logprobs, calibrate=calibrate)
        reply_ids = generation.reply_ids
        shared[agent.name] = Segment(reply_ids, slot="_") if reply_ids else None
        logprobs = generation.prompt_logprobs if keep_logprobs else None
        call = AgentCall(agent.name, row_index, prompt.token_ids, reply_ids, executor.decode(reply_ids), provenance, logprobs)
        calls.append(call)
        if on_call is not None:
            on_call(call)
    return calls
