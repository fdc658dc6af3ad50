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
