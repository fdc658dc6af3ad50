"""Requests that do not opt in behave like stock vLLM; bad options fail that request only."""

from __future__ import annotations

import pytest
import torch

from kvcomm.core.kv import KV
from kvcomm.integrations.vllm.wire.channel import Injection, Order

pytestmark = pytest.mark.slow

PROMPT = ("Here is a shopping list: apples, bread, milk, eggs, rice, beans, tea, coffee, butter, cheese, "
          "tomatoes, onions, garlic, lemons and honey. List three colours of the rainbow, then name a "
          "fruit of each colour, using the shopping list where you can.")


def _ids(executor) -> list[int]:
    text = executor.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = executor.encode(text)
    assert len(ids) > 64  # at least two full 32-token blocks: prefix caching has something to cache
    return ids


def _plain(llm, prompts, params=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = [None] * len(prompts) if params is None else params
    sampling = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, extra_args=None if p is None else {"kv_transfer_params": p})
                for p in extra]
    return llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling, use_tqdm=False)


def _logprobs(output) -> list[dict]:
    return [{k: v.logprob for k, v in step.items()} for step in output.outputs[0].logprobs]


def _garbage(executor, ids) -> KV:
    layers, heads, dim = 30, 3, 64
    generator = torch.Generator().manual_seed(0)
    return KV(torch.randn(layers, heads, len(ids) - 1, dim, generator=generator),
              torch.randn(layers, heads, len(ids) - 1, dim, generator=generator))


def test_no_opt_in_gets_stock_output_after_approximate_reuse(vllm_llm, vllm_executor):
    ids = _ids(vllm_executor)
    vllm_llm.reset_prefix_cache()
    first = _plain(vllm_llm, [ids])[0]
    again = _plain(vllm_llm, [ids])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # prefix caching is on
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    wrong = vllm_executor.generate(ids, _garbage(vllm_executor, ids), 16)  # approximate (here: wrong) KV
    assert list(wrong.reply_ids) != list(first.outputs[0].token_ids[: len(wrong.reply_ids)])
    after = _plain(vllm_llm, [ids])[0]
    assert after.outputs[0].token_ids == first.outputs[0].token_ids
    assert _logprobs(after) == _logprobs(again)
    assert after.kv_transfer_params is None


def test_without_the_salt_injected_blocks_would_leak(vllm_llm, vllm_executor):
    """Control for the test above: it can fail. Unsalted injected blocks are served to a
    plain request as prefix hits and change its output."""
    ids = _ids(vllm_executor)
    vllm_llm.reset_prefix_cache()
    clean = _plain(vllm_llm, [ids])[0]
    vllm_llm.reset_prefix_cache()
    try:
        vllm_executor._run(ids, Order(Injection.of_kv(_garbage(vllm_executor, ids)), len(ids) - 1, len(ids)), 1, salted=False)
        leaked = _plain(vllm_llm, [ids])[0]
        assert leaked.num_cached_tokens > 0 and leaked.outputs[0].token_ids != clean.outputs[0].token_ids
    finally:
        vllm_llm.reset_prefix_cache()


BAD = [
    ({"kvcomm": "yes"}, "must be a JSON object"),
    ({"kvcomm": {"segments": [{"start": 0, "end": 5, "slot": "task"}, {"start": 3, "end": 8, "slot": "task"}]}}, "overlaps"),
    ({"kvcomm": {"segments": [{"start": 0, "end": 9999, "slot": "task"}]}}, "need 0 <= start < end"),
    ({"kvcomm": {"segments": [{"start": "0", "end": 5, "slot": "task"}]}}, "must be an integer"),
    ({"kvcomm": {}, "kvcomm_server": {"handle": "not-a-real-handle"}}, "names no pending order"),
]


def test_bad_kv_transfer_params_fail_only_their_request(vllm_llm, vllm_executor):
    ids = _ids(vllm_executor)
    reference = _plain(vllm_llm, [ids])[0].outputs[0].token_ids
    outputs = _plain(vllm_llm, [ids] * (len(BAD) + 1), [None] + [params for params, _ in BAD])
    assert outputs[0].outputs[0].token_ids == reference and outputs[0].kv_transfer_params is None
    for output, (_, message) in zip(outputs[1:], BAD):
        assert message in output.kv_transfer_params["kvcomm"]["error"]
        assert output.outputs[0].token_ids == reference  # served densely, like stock vLLM
    assert _plain(vllm_llm, [ids])[0].outputs[0].token_ids == reference  # the engine keeps serving
