"""A ``vllm.LLM`` (or vLLM engine arguments) with the kvcomm connector enabled."""

from __future__ import annotations

import os
from typing import Any

CONNECTOR = "KvcommConnector"
CONNECTOR_MODULE = "kvcomm.integrations.vllm.connector"

DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
}
"""Engine settings for CPU machines; every key can be overridden."""


def transfer_config(engine_id: str | None = None, extra: dict[str, Any] | None = None):
    """The ``KVTransferConfig`` that loads kvcomm's connector (``kv_role="kv_both"``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR, kv_role="kv_both", kv_connector_module_path=CONNECTOR_MODULE,
        engine_id=engine_id, kv_connector_extra_config=dict(extra or {}),
    )


def make_llm(model: str | None = None, in_process: bool = True, **overrides: Any):
    """``vllm.LLM`` on ``model`` (default: the embedded SmolLM2) with the plugin enabled.

    in_process: run the engine core and its worker in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which ``VllmExecutor`` needs to exchange KV with
    the connector; False keeps vLLM's default (engine core and worker in processes of their
    own), where annotated requests (``plan`` on) are served as well. Call from under an
    ``if __name__ == "__main__":`` guard in scripts. ``VLLM_CPU_KVCACHE_SPACE`` (GiB) defaults
    to 1 here, and vLLM logs to stderr unless ``VLLM_LOGGING_STREAM`` says otherwise (set
    before vLLM is first imported).
    """
    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    if in_process:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING is set to a non-zero value; unset it or pass in_process=False")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for results (--json)
    from vllm import LLM

    settings = {**DEFAULTS, **overrides}
    settings.setdefault("kv_transfer_config", transfer_config())
    return LLM(model=str(resolve_model_dir(model)), **settings)
