"""Loading a runtime by name: the transformers reference or vLLM with the kvcomm connector.
Shared by the `kvcomm` command (``cli``) and `kvcomm eval` (``kvcomm.eval.cli_eval``)."""

from __future__ import annotations

BACKENDS = ("transformers", "vllm")


def load_executor(model: str | None, backend: str = "transformers", dtype: str = "float32"):
    """(executor, model path) for ``model`` or the embedded model: the transformers
    reference, or vLLM in-process with the kvcomm connector (``backend="vllm"``).

    dtype: the model dtype (``embedded.DTYPES``). With vLLM, the engine runs in it and the
    transformers copy that only checks RoPE and renders prompts stays float32."""
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, parse_dtype, resolve_model_dir
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    parse_dtype(dtype)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    path = resolve_model_dir(model)
    hf_model, tokenizer = load_model_and_tokenizer(str(path), "float32" if backend == "vllm" else dtype)
    if backend == "vllm":
        from kvcomm.integrations.vllm.engine import make_llm
        from kvcomm.integrations.vllm.executor import VllmExecutor

        return VllmExecutor(make_llm(str(path), dtype=dtype), hf_model, tokenizer), str(path)
    return TransformersExecutor(hf_model, tokenizer), str(path)
