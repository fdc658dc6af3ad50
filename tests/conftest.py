"""Shared fixtures: the embedded SmolLM2 (loaded once per session) and tiny random models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32, converted on first use."""
    from kvcomm.integrations.embedded import load_model_and_tokenizer

    torch.manual_seed(0)
    return load_model_and_tokenizer()


@pytest.fixture(scope="session")
def smol_executor(smol):
    from kvcomm.integrations.transformers_executor import TransformersExecutor

    return TransformersExecutor(*smol)


@pytest.fixture(scope="session")
def tiny_executor(smol):
    """A 2-layer random Llama with SmolLM2's tokenizer (and chat template): fast engine tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers_executor import TransformersExecutor

    _, tokenizer = smol
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return TransformersExecutor(LlamaForCausalLM(config).eval(), tokenizer)


@pytest.fixture(scope="session")
def vllm_llm():
    """One in-process ``vllm.LLM`` with the kvcomm connector on the embedded model, fp32,
    prefix caching on with 32-token blocks, chunked prefill with 64-token chunks (so real
    prompts span several blocks and chunks), server-side planning of annotated requests on."""
    pytest.importorskip("vllm")
    from kvcomm.integrations.vllm_engine import make_llm, transfer_config

    import os

    block_size = int(os.environ.get("KVCOMM_TEST_BLOCK_SIZE", "32"))  # CPU_ATTN: multiples of 32; see docs/vllm-plugin.md
    return make_llm(max_num_batched_tokens=64, max_num_seqs=8, block_size=block_size, kv_transfer_config=transfer_config(extra={"plan": True, "gamma": 1.0}))


@pytest.fixture(scope="session")
def vllm_executor(vllm_llm, smol):
    from kvcomm.integrations.vllm_executor import VllmExecutor

    return VllmExecutor(vllm_llm, *smol)


SERVER_KEYS = ("kvcomm-test-key-a", "kvcomm-test-key-b")
"""API keys of the ``kvcomm_server`` fixture; each is its own tenant."""


@pytest.fixture(scope="session")
def kvcomm_server(tmp_path_factory):
    """A `kvcomm serve` subprocess on a free port (embedded model, gamma 1, 32-token blocks,
    ``--max-model-len 1024``, API keys ``SERVER_KEYS``), up once per session (~70 s) and only
    for tests that ask for it. Yields ``serve_client.Server`` (base_url, keys, model, log)."""
    pytest.importorskip("vllm")
    from serve_client import start_server

    server = start_server(tmp_path_factory.mktemp("kvcomm-serve") / "server.log", SERVER_KEYS)
    try:
        yield server
    finally:
        server.stop()
