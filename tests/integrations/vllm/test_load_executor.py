"""`kvcomm eval --backend vllm` (and `run`, `demo`) load the model once, in vLLM: on that path
no transformers model is loaded (``AutoModelForCausalLM.from_pretrained`` is made to fail), and
the executor's stop tokens come from the tokenizer and the generation config vLLM read."""

from __future__ import annotations

import pytest


def _forbid_transformers_model(monkeypatch) -> None:
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the vLLM backend loaded a transformers model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_eval_vllm_backend_builds_its_executor_from_a_tokenizer_alone(monkeypatch):
    from kvcomm.eval import cli_eval
    from kvcomm.integrations.vllm.inprocess import executor, llm

    built = {}

    class FakeExecutor:
        def __init__(self, llm, tokenizer):
            built.update(llm=llm, tokenizer=tokenizer)

    _forbid_transformers_model(monkeypatch)
    monkeypatch.setattr(llm, "make_llm", lambda path, dtype: ("llm", path, dtype))
    monkeypatch.setattr(executor, "VllmExecutor", FakeExecutor)
    loaded, path = cli_eval.load_executor(None, "vllm", "bfloat16")
    assert isinstance(loaded, FakeExecutor)
    assert built["llm"] == ("llm", path, "bfloat16")
    assert built["tokenizer"].chat_template  # the served checkpoint's tokenizer, chat template included


def test_vllm_executor_stop_tokens_without_a_transformers_model(monkeypatch, vllm_llm):
    from transformers import GenerationConfig

    from kvcomm.integrations.transformers.embedded import embedded_model_dir, load_tokenizer
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

    _forbid_transformers_model(monkeypatch)
    tokenizer = load_tokenizer()
    executor = VllmExecutor(vllm_llm, tokenizer)
    eos = GenerationConfig.from_pretrained(embedded_model_dir()).eos_token_id
    expected = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    assert executor.stop_ids == expected
    reply = executor.generate(executor.encode("Say hi, then stop."), None, 4)
    assert not set(reply.reply_ids) & expected


@pytest.mark.parametrize("eos", [7, [7, 9]])
def test_generation_config_eos_is_a_stop_token(monkeypatch, vllm_llm, eos):
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

    model_config = vllm_llm.llm_engine.vllm_config.model_config
    monkeypatch.setattr(type(model_config), "try_get_generation_config", lambda self: {"eos_token_id": eos})
    tokenizer = load_tokenizer()
    assert VllmExecutor(vllm_llm, tokenizer).stop_ids == {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
