"""Server-side planning of annotated requests (the path `kvcomm serve` uses), driven
through the in-process engine with ``kv_transfer_params`` exactly as an OpenAI client sends them."""

from __future__ import annotations

import dataclasses

import pytest

from kvcomm.pipeline import load_demo_pipeline
from kvcomm.runner import build_prompt, _content
from kvcomm.segments import Segment

pytestmark = pytest.mark.slow


def _annotations(prompt) -> dict:
    spans = [{"start": start, "end": start + len(segment), "slot": segment.slot}
             for segment, start in zip(prompt.segments, prompt.starts) if segment.is_shared]
    return {"kvcomm": {"template": prompt.template_id, "segments": spans}}


def _serve(llm, prompt, max_tokens, salt, detect=False):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=list(prompt.token_ids))
    if salt:
        request["cache_salt"] = salt
    options = {"kvcomm": {}} if detect else _annotations(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args={"kv_transfer_params": options})
    return llm.generate([request], params, use_tqdm=False)[0]


def test_annotated_pipeline_is_planned_and_learned_server_side(vllm_llm, vllm_executor):
    spec = load_demo_pipeline()
    summaries = []
    for row in range(3):
        shared = {name: _content(vllm_executor, spec.inputs[row][name]) for name in spec.input_slots}
        for agent in spec.agents:
            prompt = build_prompt(vllm_executor, agent, shared)
            output = _serve(vllm_llm, prompt, 12, salt="tenant-a")
            summary = output.kv_transfer_params["kvcomm"]
            assert "error" not in summary, summary
            assert summary["exact_tokens"] + summary["estimated_tokens"] + summary["computed_tokens"] == len(prompt)
            assert output.num_cached_tokens >= summary["exact_tokens"] + summary["estimated_tokens"]
            summaries.append(summary)
            reply = [t for t in output.outputs[0].token_ids if t != vllm_executor.tokenizer.eos_token_id]
            shared[agent.name] = Segment(tuple(reply), slot="_") if reply else None
    estimated = sum(s["estimated_tokens"] for s in summaries)
    exact = sum(s["exact_tokens"] for s in summaries)
    print(f"\nserver-side: {len(summaries)} calls, exact {exact}, estimated {estimated}, "
          f"computed {sum(s['computed_tokens'] for s in summaries)}; notes {[s['note'] for s in summaries]}")
    assert exact > 0 and estimated > 0
    # The same prompt without annotations: shared runs are detected, and reused again.
    detected = _serve(vllm_llm, prompt, 4, salt="tenant-a", detect=True).kv_transfer_params["kvcomm"]
    print(f"unannotated repeat of the last prompt: {detected}")
    assert "error" not in detected and detected["exact_tokens"] + detected["estimated_tokens"] > 0


def test_annotated_request_without_salt_gets_exact_reuse_only(vllm_llm, vllm_executor):
    spec = load_demo_pipeline()
    shared = {"task": _content(vllm_executor, spec.inputs[0]["task"])}
    agent = dataclasses.replace(spec.agents[0])
    prompt = build_prompt(vllm_executor, agent, shared)
    for _ in range(2):
        summary = _serve(vllm_llm, prompt, 4, salt=None).kv_transfer_params["kvcomm"]
        assert summary["estimated_tokens"] == 0
