"""Reply agreement's precision floor (``kvcomm.eval.precision_floor``): the dense calls'
prompts replayed densely in another dtype, replies compared token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcomm.eval.precision_floor import OTHER_DTYPE, PrecisionFloor, replay

TEXTS = ["The river Seine flows through Paris.", "Name three fruits.", "Why is the sky blue?", "Count to five."]


def _generate(executor):
    def generate(prompt, budget):
        return executor.generate(list(prompt), None, budget).reply_ids
    return generate


def test_replay_counts_replies_equal_to_the_runs_own(tiny_executor):
    prompts = [tiny_executor.encode(t) for t in TEXTS]
    replies = [tiny_executor.generate(p, None, 5).reply_ids for p in prompts]
    same = replay(_generate(tiny_executor), prompts, replies, 5, "float32", "float32", progress=False)
    assert (same.equal, same.calls, same.rate) == (4, 4, 1.0)
    assert len(set(replies)) > 1  # so a comparison against the wrong call's reply can fail
    shifted = replay(_generate(tiny_executor), prompts, replies[1:] + replies[:1], 5, "float32", "float32", progress=False)
    assert shifted.equal < 4

    from kvcomm.integrations.transformers.executor import TransformersExecutor

    bf16 = TransformersExecutor(copy.deepcopy(tiny_executor.model).to(torch.bfloat16), tiny_executor.tokenizer)
    floor = replay(_generate(bf16), prompts, replies, 5, "bfloat16", "float32", progress=False)
    expected = sum(bf16.generate(p, None, 5).reply_ids == r for p, r in zip(prompts, replies))
    assert floor.equal == expected and floor.calls == 4
    assert floor.to_json() == {"dtype": "bfloat16", "reference_dtype": "float32", "equal": expected, "calls": 4,
                               "reply_agreement_rate": expected / 4}
    assert floor.words() == f"dense bfloat16 vs dense float32 on the same calls: {expected}/4"


def test_the_floor_compares_the_same_calls_only():
    with pytest.raises(ValueError, match="2 prompts for 1 replies"):
        replay(lambda p, b: (), [[1], [2]], [()], 3, "bfloat16", "float32", progress=False)
    assert OTHER_DTYPE == {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}
    assert PrecisionFloor("bfloat16", "float32", 0, 0).rate == 0.0
