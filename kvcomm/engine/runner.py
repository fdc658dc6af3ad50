"""Run a declarative pipeline on an executor, densely or with reuse, and record provenance."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from kvcomm.engine.engine import ReuseEngine
from kvcomm.engine.executor import Executor, OnToken
from kvcomm.core.kv import to_position_free
from kvcomm.engine.pipeline import AgentSpec, PipelineSpec, Slot
from kvcomm.engine.plan import Provenance
from kvcomm.core.segments import Prompt, Segment

if TYPE_CHECKING:
    from kvcomm.services.quality_guard import QualityGuard


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
    on_token: OnToken | None = None, guard: QualityGuard | None = None, calibrate: bool = False,
):
    """One call: plan and materialize (with an engine), generate, learn. Returns (Generation, Provenance).

    keep_logprobs: ask the executor for ``Generation.prompt_logprobs`` (computed positions only).
    on_token: passed to the executor (streaming, cancellation; see ``OnToken``).
    guard: a quality guard (shadow mode): it cuts reuse of slots it disabled and, for the
    requests it samples, also runs the dense prefill and records the first-token KL.
    calibrate: compute the prompt densely and learn everything from it
    (``ReuseEngine.calibration_plan``; the guard is not consulted).
    """
    started = time.perf_counter()
    options: dict = {"keep_logprobs": True} if keep_logprobs else {}
    if on_token is not None:
        options["on_token"] = on_token
    if engine is None:
        generation = executor.generate(prompt.token_ids, None, max_new_tokens, started, **options)
        shared = sum(len(s) for s in prompt.segments if s.is_shared)
        return generation, Provenance(len(prompt), 0, 0, len(prompt), shared, 0, False, "dense", generation.ttft_s)
    provider = executor.base_kv if engine.config.base_source == "standalone" else None
    plan = engine.calibration_plan(prompt, provider) if calibrate else engine.plan(prompt, provider)
    shadow = ()
    if guard is not None and not calibrate:
        guard.restrict(engine, plan)
        shadow = guard.sample(plan)
        if shadow:
            options["keep_logprobs"] = True
    if plan.blend is not None:
        options["blend"] = plan.blend
    with engine.materialized(plan) as prefix:  # executors copy the prefix into their own cache
        generation = executor.generate(prompt.token_ids, prefix, max_new_tokens, started, **options)
    if plan.blend is not None:
        plan.recompute = tuple(generation.recomputed)
    engine.learn(plan, generation.computed)
    if (generation.reply_kv is not None and engine.uses_bases and engine.learns_reply_from(plan)
            and engine.learns_at(len(prompt) + generation.reply_kv.length)):
        reply = Segment(generation.reply_ids, slot="_")
        engine.register_base(reply, to_position_free(generation.reply_kv, engine.rotary, len(prompt)))
    if shadow:
        guard.shadow(executor, engine, prompt, generation.prompt_logprobs[-1], shadow)
    return generation, plan.provenance(generation.ttft_s)


def run_row(
    spec: PipelineSpec, row_index: int, executor: Executor, engine: ReuseEngine | None,
    on_call: Callable[[AgentCall], None] | None = None, keep_logprobs: bool = False,
    guard: QualityGuard | None = None, calibrate: bool = False,
) -> list[AgentCall]:
    """Run every agent, in order, on input row ``row_index``; ``keep_logprobs`` fills each
    call's ``prompt_logprobs``; ``guard`` and ``calibrate`` go to every ``run_agent``."""
    row = spec.inputs[row_index]
    shared: dict[str, Segment | None] = {name: _content(executor, row[name]) for name in spec.input_slots}
    calls = []
    for agent in spec.agents:
        prompt = build_prompt(executor, agent, shared)
        generation, provenance = run_agent(executor, engine, prompt, spec.max_new_tokens, keep_logprobs, guard=guard,
                                           calibrate=calibrate)
        reply_ids = generation.reply_ids
        shared[agent.name] = Segment(reply_ids, slot="_") if reply_ids else None
        logprobs = generation.prompt_logprobs if keep_logprobs else None
        call = AgentCall(agent.name, row_index, prompt.token_ids, reply_ids, executor.decode(reply_ids), provenance, logprobs)
        calls.append(call)
        if on_call is not None:
            on_call(call)
    return calls
