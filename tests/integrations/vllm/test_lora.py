"""Reuse under LoRA adapters, through vLLM with two real adapters on the embedded model
(``support.lora``: rank 8 on every layer's q/k/v projections, non-zero B, so each changes the
KV): a tenant's requests under one adapter reuse each other's KV, never another adapter's or
the base model's, and a reply built on reused exact KV equals the dense reply under the same
adapter. The engine runs in processes of its own, as under `kvcomm serve`."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

HEAD = "You are a careful reviewer. Read the shared report below and answer briefly.\n"
SHARED = ("Report: the pump station failed twice in March because the backup generator was not tested; "
          "the team replaced the fuel filter and wrote a new weekly test schedule.\n")


@pytest.fixture(scope="module")
def lora_llm(tmp_path_factory, smol_tokenizer):
    from vllm.lora.request import LoRARequest

    from kvcomm.integrations.transformers.embedded import resolve_model_dir
    from kvcomm.integrations.vllm.inprocess.llm import make_llm, shutdown_llm
    from kvcomm.integrations.vllm.wire.config import transfer_config
    from support.lora import write_adapter

    folder, model = tmp_path_factory.mktemp("adapters"), resolve_model_dir(None)
    adapters = {name: LoRARequest(name, n, str(write_adapter(folder / name, seed=n, model_dir=model, scale=0.15)))
                for n, name in enumerate(("critic", "writer"), start=1)}
    llm = make_llm(in_process=False, max_num_batched_tokens=64, max_num_seqs=8, block_size=32, enable_lora=True,
                   max_lora_rank=8, max_loras=2, kv_transfer_config=transfer_config(extra={"plan": True, "gamma": 1.0}))
    yield llm, adapters
    shutdown_llm(llm)


def _ask(llm, tokenizer, tail: str, lora, salt: str, tenant: str | None = "lora-test"):
    """One greedy request; ``tenant`` None: not opted in (vLLM alone, the dense reference).
    Every request has a salt of its own, so vLLM's prefix cache never serves it: what it
    reuses is kvcomm's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    head, shared = tokenizer.encode(HEAD), tokenizer.encode(SHARED)
    spans = [{"start": len(head), "end": len(head) + len(shared), "slot": "report"}]
    extra = None if tenant is None else {"kv_transfer_params": {"kvcomm": {"tenant": tenant, "template": "review",
                                                                           "segments": spans}}}
    prompt = TokensPrompt(prompt_token_ids=head + shared + tokenizer.encode(tail), cache_salt=salt)
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra),
                          lora_request=lora, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), (output.kv_transfer_params or {}).get("kvcomm")


def test_kv_is_reused_within_an_adapter_and_never_across_adapters_or_the_base_model(lora_llm, smol_tokenizer):
    llm, adapters = lora_llm
    critic, writer = adapters["critic"], adapters["writer"]
    first, second = "Question: what failed?", "Question: what was replaced?"
    dense = {name: _ask(llm, smol_tokenizer, second, lora, f"dense-{name}", tenant=None)[0]
             for name, lora in (("critic", critic), ("writer", writer), ("base", None))}
    assert dense["critic"] != dense["writer"] != dense["base"]  # the adapters change what the model computes

    _, learned = _ask(llm, smol_tokenizer, first, critic, "c1")
    assert learned["exact_tokens"] == learned["estimated_tokens"] == 0
    reply, reused = _ask(llm, smol_tokenizer, second, critic, "c2")
    assert reused["exact_tokens"] > 0 and reply == dense["critic"]  # the critic's own KV, exact: the dense reply

    reply, other = _ask(llm, smol_tokenizer, second, writer, "w1")
    assert other["exact_tokens"] == other["estimated_tokens"] == 0 and reply == dense["writer"]
    reply, base = _ask(llm, smol_tokenizer, second, None, "b1")
    assert base["exact_tokens"] == base["estimated_tokens"] == 0 and reply == dense["base"]
    _, again = _ask(llm, smol_tokenizer, first, writer, "w2")
    assert again["exact_tokens"] > 0  # the writer reuses what the writer computed
    print(f"\nLoRA: critic reused {reused['exact_tokens']} exact tokens of its own; writer 0 and base 0 of the "
          f"critic's; writer then {again['exact_tokens']} of its own; replies equal to dense")
