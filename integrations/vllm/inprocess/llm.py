"""A ``vllm.LLM`` (or vLLM engine arguments) with the kvcomm connector enabled."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Any

from kvcomm.integrations.vllm.wire.config import (CONNECTOR, WORKER_SHUTDOWN_ENV, WORKER_SHUTDOWN_S, ConnectorConfig,
                                                 transfer_config)

DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
}
"""Engine settings for CPU machines; every key can be overridden."""


def make_llm(model: str | None = None, in_process: bool = True, **overrides: Any):
    """``vllm.LLM`` on ``model`` (default: the embedded SmolLM2) with the plugin enabled.

    in_process: run the engine core and its worker in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which ``VllmExecutor`` needs to exchange KV with
    the connector; False keeps vLLM's default (engine core and worker in processes of their
    own), where annotated requests (``plan`` on) are served as well. Call from under an
    ``if __name__ == "__main__":`` guard in scripts. ``VLLM_CPU_KVCACHE_SPACE`` (GiB) defaults
    to 1 here, and vLLM logs to stderr unless ``VLLM_LOGGING_STREAM`` says otherwise (set
    before vLLM is first imported).

    In process, one engine with a KV connector at a time: vLLM keeps a single worker-side
    connector per process and hands it to every later engine, so a second engine would run
    with the first's connector (its layers, its channel). Refused while an earlier one is
    alive; ``shutdown_llm`` (or ``VllmExecutor.close``) ends one.
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
    transfer = settings["kv_transfer_config"]
    if transfer is not None and transfer.kv_connector == CONNECTOR:
        if ConnectorConfig.from_transfer(transfer).state_dir:  # a bad setting is refused here, before vLLM starts
            os.environ.setdefault(WORKER_SHUTDOWN_ENV, str(WORKER_SHUTDOWN_S))  # inherited by the worker processes
    if in_process and settings["kv_transfer_config"] is not None:
        _refuse_a_second_connector()
    if in_process:
        return LLM(model=str(resolve_model_dir(model)), **settings)
    with _multiprocessing():
        return LLM(model=str(resolve_model_dir(model)), **settings)


@contextmanager
def _multiprocessing():
    """``VLLM_ENABLE_V1_MULTIPROCESSING=1`` while an engine is built, the earlier value after.
    An in-process engine set it to 0 for this process, and vLLM caches its environment once an
    engine has started (``vllm.envs.enable_envs_cache``), so without this a later engine asked
    for processes of its own would run in this one beside the first, and tear down the
    first's distributed state when it shuts down."""
    import vllm.envs as envs

    previous = os.environ.get(MULTIPROCESSING_ENV)
    os.environ[MULTIPROCESSING_ENV] = "1"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(MULTIPROCESSING_ENV, None)
        else:
            os.environ[MULTIPROCESSING_ENV] = previous
        envs.disable_envs_cache()


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def shutdown_llm(llm) -> None:
    """Shut down ``llm``'s engine core and its worker now, which removes the worker's KV
    connector from this process (vLLM does so only then, or when the engine is garbage
    collected), and drop its kvcomm channel. ``llm`` serves nothing afterwards; a second call
    does nothing."""
    from kvcomm.integrations.vllm.wire.channel import drop_channel

    llm.llm_engine.engine_core.shutdown()
    transfer = llm.llm_engine.vllm_config.kv_transfer_config
    if transfer is not None:
        drop_channel(str(transfer.engine_id))


def _refuse_a_second_connector() -> None:
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    if has_kv_transfer_group():
        gc.collect()  # an engine dropped in a reference cycle still holds it until collected
    if has_kv_transfer_group():
        raise RuntimeError(
            "an earlier in-process vLLM engine with a KV connector is still running in this process; vLLM keeps "
            "one worker-side KV connector per process and would give the new engine the old one. Shut the "
            "earlier engine down first (kvcomm.integrations.vllm.inprocess.llm.shutdown_llm(llm) or "
            "VllmExecutor.close()), or pass in_process=False to run the new one in processes of its own"
        )
