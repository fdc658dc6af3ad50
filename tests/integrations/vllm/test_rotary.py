"""The served model's Rotary comes from vLLM's own rotary module: equal to transformers' where
the two agree, vLLM's where they differ, self-checked against vLLM's keys, and a rotary type
kvcomm cannot represent refuses the connector at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvcomm.core.rope import RopeError  # noqa: E402
from kvcomm.integrations.transformers.rotary import rotary_from_model  # noqa: E402
from kvcomm.integrations.vllm.connector.rotary import rotary_from_vllm, self_check, served_rotary  # noqa: E402

HEAD_DIM = 16
MAX_POSITIONS = 2048

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
}


@pytest.fixture(scope="module", autouse=True)
def vllm_context():
    """vLLM's custom ops (its rotary modules) are built under a current engine config."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _vllm_module(rope: dict, head_dim: int = HEAD_DIM, neox: bool = True, dtype=torch.float32):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head_dim, MAX_POSITIONS, neox, dict(rope), dtype)


def _hf_rotary(rope: dict):
    """The Rotary transformers reads from a tiny random Llama with SmolLM2's attention shape per head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=4 * HEAD_DIM, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters=dict(rope))
    return rotary_from_model(LlamaForCausalLM(config).eval())[0]


@pytest.mark.parametrize("name", sorted(ROPES))
def test_the_rotary_from_vllm_equals_transformers(name):
    module = _vllm_module(ROPES[name])
    ours, theirs = rotary_from_vllm(module), _hf_rotary(ROPES[name])
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling, rel=1e-6)
    assert (ours.head_dim, ours.rotary_dim, ours.interleaved, ours.max_exact_length) == (
        theirs.head_dim, theirs.rotary_dim, theirs.interleaved, theirs.max_exact_length)
    assert self_check(module, ours, torch.float32, MAX_POSITIONS).passed


def test_default_rope_numbers_are_bit_identical_so_saved_fingerprints_hold():
    from kvcomm.core.fingerprint import rope_digest

    rope = ROPES["default"]
    assert rope_digest(rotary_from_vllm(_vllm_module(rope))) == rope_digest(_hf_rotary(rope))


def test_vllm_dynamic_ntk_is_static_and_its_numbers_are_the_ones_used():
    """With a trained context shorter than its maximum, vLLM enlarges the base once, for every
    position; transformers keeps the original frequencies up to its maximum context and
    switches beyond. The cache holds vLLM's numbers, so those are realigned, at any length."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "max_trained_positions": 1024}
    module = _vllm_module(rope)
    ours, theirs = rotary_from_vllm(module), _hf_rotary(rope)
    assert ours.max_exact_length is None and theirs.max_exact_length == MAX_POSITIONS - 1
    assert not torch.allclose(ours.inv_freq, theirs.inv_freq)
    assert self_check(module, ours, torch.float32, MAX_POSITIONS).passed
    assert not self_check(module, replace(theirs, max_exact_length=None), torch.float32, MAX_POSITIONS).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
def test_both_pairings_and_partial_rotary_pass_against_vllm_keys(neox, dtype):
    module = _vllm_module({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 32, neox, dtype)
    rotary = rotary_from_vllm(module)
    assert (rotary.head_dim, rotary.rotary_dim, rotary.interleaved) == (32, 16, not neox)
    assert self_check(module, rotary, dtype, MAX_POSITIONS).passed


@pytest.mark.parametrize("change", ["pairing", "frequency", "scaling"])
def test_the_self_check_catches_a_wrong_rotary(change):
    module = _vllm_module(ROPES["yarn"])
    right = rotary_from_vllm(module)
    wrong = {"pairing": replace(right, interleaved=True), "frequency": replace(right, inv_freq=right.inv_freq * 1.001),
             "scaling": replace(right, attention_scaling=1.0)}[change]
    assert self_check(module, right, torch.float32, MAX_POSITIONS).passed
    assert not self_check(module, wrong, torch.float32, MAX_POSITIONS).passed


@pytest.mark.parametrize("rope, what", [
    ({"rope_type": "ntk", "rope_theta": 10000.0, "factor": 2.0}, "NTKScalingRotaryEmbedding"),
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 2.0}, "DynamicNTKAlphaRotaryEmbedding"),
])
def test_a_rotary_kvcomm_cannot_represent_is_refused_with_what_to_do(rope, what):
    with pytest.raises(RopeError, match=f"{what} is not supported") as error:
        rotary_from_vllm(_vllm_module(rope))
    assert "Serve a model with" in str(error.value)


def test_linear_scaling_with_several_factors_is_refused():
    from vllm.model_executor.layers.rotary_embedding import LinearScalingRotaryEmbedding

    module = LinearScalingRotaryEmbedding(HEAD_DIM, HEAD_DIM, 64, 10000.0, True, [1.0, 2.0], torch.float32)
    with pytest.raises(RopeError, match="several scaling factors"):
        rotary_from_vllm(module)


def _config(head_dim: int, rope: dict):
    text = SimpleNamespace(rope_parameters=rope)
    return SimpleNamespace(model_config=SimpleNamespace(
        get_head_size=lambda: head_dim, hf_text_config=text, dtype=torch.float32, max_model_len=MAX_POSITIONS))


def test_the_served_rotary_is_found_in_vllms_rope_cache_and_a_failing_check_refuses(monkeypatch):
    from kvcomm.integrations.vllm.connector import rotary as vllm_rotary

    rope = {"rope_type": "default", "rope_theta": 5000.0}
    module = _vllm_module(rope, head_dim=24)
    rotary, check = served_rotary(_config(24, rope))
    assert torch.equal(rotary.inv_freq, rotary_from_vllm(module).inv_freq) and check.passed
    monkeypatch.setattr(vllm_rotary, "rotary_from_vllm", lambda m: replace(rotary_from_vllm(m), interleaved=True))
    with pytest.raises(RopeError, match="RoPE self-check failed against vLLM's RotaryEmbedding"):
        served_rotary(_config(24, rope))
    with pytest.raises(RopeError, match="no rotary embedding with head size 40"):
        served_rotary(_config(40, rope))


def test_the_engine_reads_the_embedded_models_rotary_from_vllm(vllm_llm, smol):
    """In a running engine, the connector's Rotary (vLLM's module, self-checked at start-up)
    equals the one transformers reads from the same checkpoint."""
    from kvcomm.core.fingerprint import rope_digest
    from kvcomm.integrations.vllm.wire.channel import channel

    served = channel(str(vllm_llm.llm_engine.vllm_config.kv_transfer_config.engine_id))
    assert served.refusal is None and served.rope_check.passed
    assert rope_digest(served.rotary) == rope_digest(rotary_from_model(smol[0])[0])


_UNSUPPORTED_ROPE_ENGINE = r"""
import json, sys
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from kvcomm.integrations.vllm.inprocess.llm import make_llm
from kvcomm.integrations.vllm.wire.config import transfer_config
strict = sys.argv[1] == "strict"
rope = {"rope_type": "dynamic", "alpha": 2.0, "rope_theta": 100000.0}
try:
    llm = make_llm(block_size=32, max_num_batched_tokens=64, hf_overrides={"rope_parameters": rope},
                   kv_transfer_config=transfer_config(extra={"strict": strict}))
except Exception as error:
    print(json.dumps({"started": False, "error": str(error)}))
    raise SystemExit(0)
params = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"kv_transfer_params": {"kvcomm": {}}})
out = llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 180)))], [params], use_tqdm=False)
print(json.dumps({"started": True, "tokens": len(out[0].outputs[0].token_ids), "params": out[0].kv_transfer_params}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lenient", "strict"])
def test_an_engine_with_an_unsupported_rotary_is_refused_at_start_up(mode):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", _UNSUPPORTED_ROPE_ENGINE, mode], capture_output=True, text=True,
                          timeout=600, env=env, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    reason = "DynamicNTKAlphaRotaryEmbedding is not supported by kvcomm's realignment"
    if mode == "strict":
        assert not result["started"] and reason in result["error"]
    else:
        assert result["started"] and result["tokens"] == 4
        assert "kvcomm is off in this engine" in result["params"]["kvcomm"]["error"]
        assert reason in result["params"]["kvcomm"]["error"]
