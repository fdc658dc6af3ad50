"""Server-side planning of annotated requests (the path `kvcomm serve` uses), driven
through the in-process engine with ``kv_transfer_params`` exactly as an OpenAI client sends them."""

from __future__ import annotations

import pytest

from kvcomm.reuse.pipeline import load_demo_pipeline
from kvcomm.reuse.runner import build_prompt, _content
from kvcomm.core.segments import Segment

pytestmark = pytest.mark.slow


def _annotations(prompt, tenant: str) -> dict:
    spans = [{"start": start, "end": start + len(segment), "slot": segment.slot}
             for segment, start in zip(prompt.segments, prompt.starts) if segment.is_shared]
    return {"kvcomm": {"template": prompt.template_id, "tenant": tenant, "segments": spans}}


def _serve(llm, prompt, max_tokens, salt, tenant: str, detect=False):
    """One greedy request in ``tenant``; ``salt``: its cache_salt (None: no salt, which
    limits it to exact reuse); ``detect``: no annotations, shared runs are detected."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=list(prompt.token_ids))
    if salt:
        request["cache_salt"] = salt
    options = {"kvcomm": {"tenant": tenant}} if detect else _annotations(prompt, tenant)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args={"kv_transfer_params": options})
    return llm.generate([request], params, use_tqdm=False)[0]


def _reply(executor, output) -> Segment | None:
    reply = [t for t in output.outputs[0].token_ids if t != executor.tokenizer.eos_token_id]
    return Segment(tuple(reply), slot="_") if reply else None


def test_annotated_pipeline_is_planned_and_learned_server_side(vllm_llm, vllm_executor, own_tenant):
    spec = load_demo_pipeline()
    summaries = []
    for row in range(3):
        shared = {name: _content(vllm_executor, spec.inputs[row][name]) for name in spec.input_slots}
        for agent in spec.agents:
            prompt = build_prompt(vllm_executor, agent, shared)
            output = _serve(vllm_llm, prompt, 12, salt=own_tenant, tenant=own_tenant)
            summary = output.kv_transfer_params["kvcomm"]
            assert "error" not in summary, summary
            assert summary["exact_tokens"] + summary["estimated_tokens"] + summary["computed_tokens"] == len(prompt)
            assert output.num_cached_tokens >= summary["exact_tokens"] + summary["estimated_tokens"]
            summaries.append(summary)
            shared[agent.name] = _reply(vllm_executor, output)
    estimated = sum(s["estimated_tokens"] for s in summaries)
    exact = sum(s["exact_tokens"] for s in summaries)
    print(f"\nserver-side: {len(summaries)} calls, exact {exact}, estimated {estimated}, "
          f"computed {sum(s['computed_tokens'] for s in summaries)}; notes {[s['note'] for s in summaries]}")
    assert exact > 0 and estimated > 0
    # The same prompt without annotations: shared runs are detected, and reused again.
    detected = _serve(vllm_llm, prompt, 4, salt=own_tenant, tenant=own_tenant, detect=True).kv_transfer_params["kvcomm"]
    print(f"unannotated repeat of the last prompt: {detected}")
    assert "error" not in detected and detected["exact_tokens"] + detected["estimated_tokens"] > 0


def test_annotated_request_without_salt_gets_exact_reuse_only(vllm_llm, vllm_executor, own_tenant):
    """Two tenants learn the same thing (the same salted requests, in the same order); then
    both send a prompt they have not seen, whose shared segments the anchors can estimate.
    With a salt it is estimated (the control: estimation was possible); without one the
    other tenant gets exact reuse only, for the same prompt in the same state."""
    spec = load_demo_pipeline()
    analyst, planner = spec.agents[0], spec.agents[1]
    tenants = {"salted": own_tenant + ":salted", "unsalted": own_tenant + ":unsalted"}

    def teach(tenant: str, row: int) -> dict:
        """The analyst on ``row`` (its task becomes known content), salted; then the planner's
        prompt for the row, filled with the analyst's reply."""
        shared = {"task": _content(vllm_executor, spec.inputs[row]["task"])}
        shared["analyst"] = _reply(vllm_executor, _serve(vllm_llm, build_prompt(vllm_executor, analyst, shared), 12, tenant, tenant))
        return shared

    for row in range(3):  # the planner's pools get anchors
        for tenant in tenants.values():
            shared = teach(tenant, row)
            _serve(vllm_llm, build_prompt(vllm_executor, planner, shared), 4, tenant, tenant)
    new = {name: teach(tenant, 3) for name, tenant in tenants.items()}
    assert new["salted"] == new["unsalted"]  # same replies: the two tenants are in the same state
    prompt = build_prompt(vllm_executor, planner, new["salted"])
    salted = _serve(vllm_llm, prompt, 4, salt=tenants["salted"], tenant=tenants["salted"]).kv_transfer_params["kvcomm"]
    plain = _serve(vllm_llm, prompt, 4, salt=None, tenant=tenants["unsalted"]).kv_transfer_params["kvcomm"]
    print(f"\nthe same new planner prompt ({len(prompt)} tokens): salted {salted}; unsalted {plain}")
    assert "error" not in salted and "error" not in plain
    assert salted["estimated_tokens"] > 0  # the control: with a salt, these anchors estimate it
    assert plain["estimated_tokens"] == 0 and plain["note"] == "no cache_salt: exact reuse only"
    assert plain["exact_tokens"] > 0  # exact reuse still works without a salt (the template's front)
    assert plain["exact_tokens"] + plain["computed_tokens"] == len(prompt)
