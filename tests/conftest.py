"""Shared fixtures (the embedded SmolLM2, loaded once per session; tiny random models; one
in-process vLLM engine; one `kvcomm serve` subprocess) and the suite's two policies:

- **No silent skips in CI.** With ``CI`` set to ``true``/``1`` or ``KVCOMM_NO_SKIPS=1``, every
  skip (a missing package behind ``importorskip``, a ``pytest.skip`` call, a skipped module)
  is reported as a failure naming its reason (``support/skip_policy.py``): a broken install
  must not pass as "skipped".
- **``-m "not slow"`` leaves out every test that loads SmolLM2.** A test is marked ``slow``
  automatically when it uses, directly or through another fixture, one of ``SMOL_FIXTURES``.
  ``tiny_executor`` needs only SmolLM2's tokenizer, which loads without the weights.
"""

from __future__ import annotations

import itertools
import os

# Triton's interpreter runs kvcomm's kernels on this CPU (tests that set KVCOMM_TRITON=1). Triton
# fixes its mode when it is first imported, so the switch is set before anything imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from support.skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

SMOL_FIXTURES = frozenset({"smol", "smol_executor", "vllm_llm", "vllm_executor", "kvcomm_server", "kvcomm_server_mp"})
"""Fixtures that load the embedded SmolLM2 weights (in this process or in a server process)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SMOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32, converted on first use."""
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer

    torch.manual_seed(0)
    return load_model_and_tokenizer()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer (with its ChatML chat template and ``<|im_end|>`` as eos), without
    loading the model: see ``support.tokenizer.embedded_tokenizer``."""
    from support.tokenizer import embedded_tokenizer

    return embedded_tokenizer()


@pytest.fixture(scope="session")
def smol_executor(smol):
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    return TransformersExecutor(*smol)


@pytest.fixture(scope="session")
def tiny_executor(smol_tokenizer):
    """A 2-layer random Llama with SmolLM2's tokenizer (and chat template): fast engine tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers.executor import TransformersExecutor

    tokenizer = smol_tokenizer
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
    prompts span several blocks and chunks), server-side planning of annotated requests on.
    Tests that send annotated requests name their own tenant (``own_tenant``)."""
    pytest.importorskip("vllm")
    from kvcomm.integrations.vllm.inprocess.llm import make_llm, shutdown_llm
    from kvcomm.integrations.vllm.wire.config import transfer_config

    import os

    block_size = int(os.environ.get("KVCOMM_TEST_BLOCK_SIZE", "32"))  # CPU_ATTN: multiples of 32; see docs/vllm-plugin.md
    llm = make_llm(max_num_batched_tokens=64, max_num_seqs=8, block_size=block_size, kv_transfer_config=transfer_config(extra={"plan": True, "gamma": 1.0}))
    yield llm
    shutdown_llm(llm)


@pytest.fixture(scope="session")
def vllm_executor(vllm_llm, smol_tokenizer):
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

    return VllmExecutor(vllm_llm, smol_tokenizer)


@pytest.fixture
def own_tenant(request) -> str:
    """A tenant key of this test alone (its node id), so that nothing an earlier test taught
    a shared engine reaches it."""
    return "test:" + request.node.nodeid[-200:]


SERVER_KEYS = ("kvcomm-test-key-a", "kvcomm-test-key-b")
"""The first API keys of the ``kvcomm_server`` fixture; each key is its own tenant."""
SPARE_KEYS = tuple(f"kvcomm-test-key-{n:02d}" for n in range(24))
"""More keys the server accepts, handed out one per request of ``fresh_key``."""
_spare = itertools.count()
MP_SERVER_KEYS = ("kvcomm-test-mp-key-a", "kvcomm-test-mp-key-b", "kvcomm-test-mp-key-c", "kvcomm-test-mp-key-d")
"""The API keys of ``kvcomm_server_mp``, each its own tenant: the first for the HTTP
learn-and-reuse test, the next two for the stress test, the fourth for the first-task team
(``vllm/test_first_task_serve.py``)."""


@pytest.fixture(scope="session")
def kvcomm_server(tmp_path_factory):
    """A `kvcomm serve` subprocess on a free port (embedded model, gamma 1, 32-token blocks,
    ``--max-model-len 1024``, API keys ``SERVER_KEYS`` + ``SPARE_KEYS``), up once per session
    (~70 s) and only for tests that ask for it. Yields ``serve_client.Server`` (base_url,
    keys = ``SERVER_KEYS``, model, log). Tests that must start from an empty tenant take
    keys from ``fresh_key``. Its worker runs in the engine-core process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``kvcomm_server_mp`` is vLLM's default engine."""
    pytest.importorskip("vllm")
    from support.serve_client import start_server

    server = start_server(tmp_path_factory.mktemp("kvcomm-serve") / "server.log", SERVER_KEYS + SPARE_KEYS)
    server.keys = SERVER_KEYS
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kvcomm_server_mp(tmp_path_factory):
    """Like ``kvcomm_server`` (keys ``MP_SERVER_KEYS``), under vLLM's default multiprocess
    engine: API server, engine core and worker in three processes, no environment variable."""
    pytest.importorskip("vllm")
    from support.serve_client import start_server

    server = start_server(tmp_path_factory.mktemp("kvcomm-serve-mp") / "server.log", MP_SERVER_KEYS, multiprocess=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_key(kvcomm_server):
    """``fresh_key()`` returns an API key of ``kvcomm_server`` that no other test has used:
    its tenant starts empty."""

    def take() -> str:
        n = next(_spare)
        if n >= len(SPARE_KEYS):
            raise RuntimeError(f"all {len(SPARE_KEYS)} spare API keys of kvcomm_server are taken; add more to SPARE_KEYS")
        return SPARE_KEYS[n]

    return take
