"""Reply agreement's precision floor: how many greedy replies change when only the precision does.

A reuse run's "replies equal to dense: 13/20" mixes two causes: what reuse changed, and what
any change of numerics changes in a small model's greedy replies (a near tie between two
tokens flips). The floor is the same figure for a change that has nothing to do with reuse:
the same calls' prompts, token for token, run densely by the same checkpoint in another dtype
(bf16 against fp32, or fp32 against bf16/fp16), each reply compared with the dense reply of
the run. Where reuse's agreement is near the floor, its disagreement is numerics' size.

The prompts are the dense run's own (each agent's prompt holds the earlier agents' dense
replies), so every call is a one-step comparison: no reply diverges because an earlier one did.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from tqdm import tqdm

OTHER_DTYPE = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}
"""The dtype a run in each dtype is compared with: fp32 against bf16 (the usual serving
precision), bf16 and fp16 against fp32."""


@dataclass(frozen=True)
class PrecisionFloor:
    """dtype: the precision the prompts were replayed in; reference_dtype: the run's. equal:
    calls whose replay reply equals the run's dense reply, of ``calls``."""

    dtype: str
    reference_dtype: str
    equal: int
    calls: int

    @property
    def rate(self) -> float:
        return self.equal / self.calls if self.calls else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "reply_agreement_rate": self.rate}

    def words(self) -> str:
        """"dense bfloat16 vs dense float32 on the same calls: 17/20"."""
        return f"dense {self.dtype} vs dense {self.reference_dtype} on the same calls: {self.equal}/{self.calls}"


def replay(generate: Callable[[Sequence[int], int], Sequence[int]], prompts: Sequence[Sequence[int]],
           replies: Sequence[Sequence[int]], max_new_tokens: int, dtype: str, reference_dtype: str,
           progress: bool = True) -> PrecisionFloor:
    """Run every prompt through ``generate(prompt_ids, max_new_tokens) -> reply ids`` (a dense
    greedy call in ``dtype``) and count replies equal to ``replies`` (the run's dense replies,
    in ``reference_dtype``), token for token."""
    if len(prompts) != len(replies):
        raise ValueError(f"{len(prompts)} prompts for {len(replies)} replies: the floor compares the same calls")
    equal = 0
    for prompt, reply in tqdm(list(zip(prompts, replies)), desc=f"precision floor ({dtype})", unit="call",
                              disable=not progress, file=sys.stderr):
        equal += tuple(generate(prompt, max_new_tokens)) == tuple(reply)
    return PrecisionFloor(dtype, reference_dtype, equal, len(prompts))


def precision_floor(model: str | None, backend: str, dtype: str, prompts: Sequence[Sequence[int]],
                    replies: Sequence[Sequence[int]], max_new_tokens: int, *, device: str | None = None,
                    stock_vllm: bool = False, progress: bool = True) -> PrecisionFloor:
    """Load ``model`` on ``backend`` in ``OTHER_DTYPE[dtype]`` (after the run's own engine is
    closed: one in-process vLLM engine at a time), replay ``prompts`` densely and compare with
    ``replies`` (``replay``). stock_vllm: replay as `kvcomm demo`'s baseline does (plain vLLM
    requests, ``eval.demo.StockVllm``) instead of the executor's dense ``generate`` (what
    `kvcomm run`'s dense side runs)."""
    from kvcomm.integrations.runtimes import close_executor, load_executor

    if dtype not in OTHER_DTYPE:
        raise ValueError(f"no precision floor for dtype {dtype!r}; choose one of {', '.join(OTHER_DTYPE)}")
    other = OTHER_DTYPE[dtype]
    executor, _ = load_executor(model, backend, other, device)
    try:
        if stock_vllm:
            from kvcomm.eval.demo import StockVllm

            stock = StockVllm(executor.llm, executor.stop_ids, salt="kvcomm-precision-floor")

            def generate(prompt, budget):
                return stock(prompt, budget).reply_ids
        else:
            def generate(prompt, budget):
                return executor.generate(list(prompt), None, budget).reply_ids

        return replay(generate, prompts, replies, max_new_tokens, other, dtype, progress)
    finally:
        close_executor(executor)
