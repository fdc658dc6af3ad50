"""`kvcomm demo`: a pipeline run through kvcomm and through the baseline it replaces, call by call.

The two systems run the same agents on the same input rows in one process, on one model:

- baseline ("dense" in the records): with ``backend="vllm"``, stock vLLM with its prefix cache
  on: the same ``vllm.LLM`` as kvcomm, with requests that do not opt in to the kvcomm connector
  (the connector neither claims, loads nor captures anything for them); with
  ``backend="transformers"``, the transformers executor prefilling every prompt in full.
- kvcomm ("reuse"): ``run_agent`` with one ``ReuseEngine`` across all rows, on the executor
  in a prefix-cache namespace of its own (``namespaced``).

Neither system is served vLLM prefix-cache blocks the other computed (the baseline's requests
carry their own ``cache_salt``, kvcomm's theirs); each keeps vLLM's prefix caching among its own
calls, and each call records how many prompt tokens that cache served it.

Calls alternate between the systems agent by agent (which one goes first alternates too), so
both see the same machine load. Each system feeds its own replies to its later agents.

TTFT of a call, for both systems alike: seconds from the start of the call (for kvcomm:
before planning, so base-KV prefills, estimation and KV injection count) to the first reply
token handed to the caller. A call whose reply is empty (the first token ends the turn) falls
back to the executor's own TTFT.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Sequence

from tqdm import tqdm

from kvcomm.reuse.config import ReuseConfig

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.executor import namespaced
from kvcomm.eval.demo_report import DemoCall
from kvcomm.reuse.pipeline import PipelineSpec
from kvcomm.reuse.runner import build_prompt, run_agent
from kvcomm.core.segments import Segment

BASELINE_SALT = "kvcomm-demo-baseline"
"""``cache_salt`` of every baseline request: they share vLLM's prefix cache with each other
and with no kvcomm request, so neither system is served blocks the other computed."""


@dataclass(frozen=True)
class Reply:
    """One call's outcome. reply_ids: generated tokens up to (not including) the first stop
    token. ttft_s: see the module docstring. cached_tokens: prompt tokens vLLM's prefix cache
    served (for kvcomm: beyond what kvcomm injected)."""

    reply_ids: tuple[int, ...]
    ttft_s: float
    cached_tokens: int = 0


class FirstToken:
    """An ``OnToken`` callback that records when the first token arrives (``perf_counter``)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, token: int) -> None:
        if self.at is None:
            self.at = time.perf_counter()


class StockVllm:
    """The vLLM baseline: greedy requests on ``llm`` that carry no ``kv_transfer_params``.

    stop_ids: the tokens that end a reply (``VllmExecutor.stop_ids``). Runs one request at a
    time and raises RuntimeError if the engine has unfinished requests.
    """

    name = "stock vLLM"

    def __init__(self, llm, stop_ids: set[int], salt: str = BASELINE_SALT) -> None:
        self.llm = llm
        self.stop_ids = set(stop_ids)
        self.salt = salt
        self._count = 0

    def __call__(self, token_ids: Sequence[int], max_new_tokens: int) -> Reply:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the baseline runs one request at a time; the LLM has unfinished requests")
        self._count += 1
        request_id = f"{self.salt}-{self._count}"
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=sorted(self.stop_ids),
                                detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=self.salt)
        started = time.perf_counter()
        first: float | None = None
        tokens: list[int] = []
        cached = 0
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                cached = output.num_cached_tokens or 0
                tokens = [int(t) for t in output.outputs[0].token_ids]
                if tokens and first is None:
                    first = time.perf_counter()
        reply: list[int] = []
        for token in tokens[:max_new_tokens]:
            if token in self.stop_ids:
                break
            reply.append(token)
        if first is None:
            raise RuntimeError("stock vLLM returned no token for a demo request")
        return Reply(tuple(reply), first - started, cached)


class DenseTransformers:
    """The transformers baseline: ``run_agent`` without an engine (every prompt prefilled in full)."""

    name = "dense"

    def __init__(self, executor) -> None:
        self.executor = executor

    def __call__(self, token_ids: Sequence[int], max_new_tokens: int) -> Reply:
        first = FirstToken()
        started = time.perf_counter()
        generation = self.executor.generate(token_ids, None, max_new_tokens, started, on_token=first)
        ttft = generation.ttft_s if first.at is None else first.at - started
        return Reply(tuple(generation.reply_ids), ttft, generation.cached_tokens)


def _content(executor, text: str) -> Segment | None:
    ids = executor.encode(text)
    return Segment(tuple(ids), slot="_") if ids else None


def run_demo(spec: PipelineSpec, executor, baseline, config: ReuseConfig | None = None,
             progress: bool = True, dense_calls: list | None = None) -> tuple[list[DemoCall], ReuseEngine]:
    """Run every row of ``spec`` through ``baseline`` (a :class:`StockVllm` or
    :class:`DenseTransformers`) and through kvcomm on ``executor``; return one
    :class:`DemoCall` per agent call, in run order, and the kvcomm engine.

    config: the engine's ``ReuseConfig`` (default: ``ReuseConfig()``). progress: a tqdm bar on
    stderr counting agent calls of both systems. dense_calls: when given, each baseline call's
    ``(prompt ids, reply ids)`` is appended to it, in the order of the returned calls (what the
    precision floor replays: ``eval.precision_floor``).
    """
    engine = ReuseEngine(executor.rotary, config or ReuseConfig())
    kvcomm = namespaced(executor, "demo-kvcomm")
    calls: list[DemoCall] = []
    bar = tqdm(total=2 * len(spec.inputs) * len(spec.agents), desc="agent calls", unit="call",
               disable=not progress, file=sys.stderr)
    turn = 0
    for row_index, row in enumerate(spec.inputs):
        texts = {name: _content(executor, row[name]) for name in spec.input_slots}
        shared = {"dense": dict(texts), "reuse": dict(texts)}
        for agent in spec.agents:
            results = {}
            order = ("dense", "reuse") if turn % 2 == 0 else ("reuse", "dense")
            turn += 1
            for system in order:
                prompt = build_prompt(executor, agent, shared[system])
                if system == "dense":
                    reply = baseline(prompt.token_ids, spec.max_new_tokens)
                    results[system] = (prompt, reply, None)
                else:
                    first = FirstToken()
                    started = time.perf_counter()
                    generation, provenance = run_agent(kvcomm, engine, prompt, spec.max_new_tokens, on_token=first)
                    ttft = provenance.ttft_s if first.at is None else first.at - started
                    results[system] = (prompt, Reply(tuple(generation.reply_ids), ttft, provenance.cached_tokens), provenance)
                ids = results[system][1].reply_ids
                shared[system][agent.name] = Segment(ids, slot="_") if ids else None
                bar.update()
            (dense_prompt, dense, _), (prompt, reuse, p) = results["dense"], results["reuse"]
            if dense_calls is not None:
                dense_calls.append((dense_prompt.token_ids, dense.reply_ids))
            calls.append(DemoCall(
                agent.name, row_index, p.prompt_tokens, p.exact_tokens, p.estimated_tokens, p.computed_tokens,
                p.recomputed_tokens, p.reused, p.fallback, dense.ttft_s, reuse.ttft_s,
                dense.reply_ids == reuse.reply_ids, p.note, p.reason,
                executor.decode(dense.reply_ids), executor.decode(reuse.reply_ids),
                len(dense_prompt), dense.cached_tokens, reuse.cached_tokens,
            ))
    bar.close()
    return calls, engine
