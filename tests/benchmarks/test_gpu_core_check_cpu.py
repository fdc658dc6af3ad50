"""``benchmarks/gpu_core_check.py`` (the core on a GPU without vLLM) runs its steps on the CPU:
the self-check of every RoPE variant in three dtypes with its failing control, exact injection,
the device-agreement check (trivially the same device here), the fused kernels under Triton's
interpreter and the TTFT step on the tiny model. It runs as on the lent GPU machine: in a
subprocess where only torch, Triton, transformers and numpy (and their own requirements) can be
imported, every other installed distribution (faiss, platformdirs, gguf, vLLM, pytest, ...)
hidden, and kvcomm not installed, so an import added anywhere on its path fails here first.
A GPU machine runs the same script with ``--device cuda``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.import_closure import PRELUDE

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_core_check.py"
GPU_MACHINE = "torch,triton,transformers,numpy"


def _run_hidden(args: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCOMM_ALLOWED_DISTRIBUTIONS": GPU_MACHINE, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    env.pop("KVCOMM_TRITON", None)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", PRELUDE, *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_hidden_distributions_cannot_be_imported(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.util\n"
                     "for name in ('faiss', 'platformdirs', 'gguf', 'vllm', 'pytest', 'kvcomm', 'torch', 'transformers'):\n"
                     "    print(name, importlib.util.find_spec(name) is not None)\n"
                     "import faiss\n")
    done = _run_hidden([probe], tmp_path, 120)
    found = dict(line.split() for line in done.stdout.splitlines() if not line.startswith("HIDDEN"))
    assert found == {"faiss": "False", "platformdirs": "False", "gguf": "False", "vllm": "False", "pytest": "False",
                     "kvcomm": "False", "torch": "True", "transformers": "True"}, done.stdout + done.stderr
    assert done.returncode != 0 and "ModuleNotFoundError: import of faiss halted" in done.stderr


def test_every_step_holds_on_the_cpu_with_the_gpu_machines_packages_only(tmp_path):
    done = _run_hidden([SCRIPT, "--device", "cpu", "--ttft", "tiny:fp32", "--json", tmp_path / "rows.json"], tmp_path, 1500)
    out = done.stdout
    print(out, done.stderr)
    lines = out.splitlines()
    passed = [line for line in lines if line.startswith("PASS")]
    assert sum("selfcheck[" in line for line in passed) == 27  # 9 RoPE variants x fp32, bf16, fp16
    assert sum("control[" in line for line in passed) == 3
    assert sum("exact[" in line for line in passed) == 3
    assert {line.split()[1] for line in passed if "cpu=device[" in line} == {
        "cpu=device[realign]", "cpu=device[kvcomm]", "cpu=device[cacheblend]"}
    assert sum("fused[" in line for line in passed) == 12  # 4 paged layouts x 3 dtypes
    assert any(line.startswith("INFO") and "ttft[tiny:fp32]" in line and "estimated" in line for line in lines)
    assert done.returncode == 0 and "ALL CHECKS HOLD" in out and not any(line.startswith("FAIL") for line in lines)
    summary = json.loads(next(line for line in lines if line.startswith("SUMMARY "))[len("SUMMARY "):])
    assert summary["ok"] and summary["failed"] == [] and summary["verdicts"]["PASS"] == len(passed)
    assert summary["triton_interpreter"] and summary["ttft"]["tiny:fp32"]["total_ttft_reuse_s"] > 0
    assert json.loads((tmp_path / "rows.json").read_text())["summary"] == summary


def _main():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_core_check import main
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return main


def test_the_check_tokenizer_is_the_same_on_every_run_and_encodes_any_text():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_core_check import check_tokenizer
    finally:
        sys.path.remove(str(SCRIPT.parent))
    one, two = check_tokenizer(), check_tokenizer()
    assert one.get_vocab() == two.get_vocab() and len(one) > 1000
    text = "Zürich's ferry 🚢 left at 07:45; crates: 12."
    assert one.decode(one.encode(text, add_special_tokens=False)) == text
    chat = one.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and one.eos_token == "<|im_end|>"
    assert one.convert_tokens_to_ids("<|im_end|>") == one.eos_token_id


def test_a_device_torch_cannot_see_is_refused_with_exit_status_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVCOMM_TRITON", raising=False)
    assert _main()(["--device", "cuda"]) == 2
    assert "torch sees 0 CUDA device(s)" in capsys.readouterr().err


def test_a_gpu_run_never_inherits_the_triton_interpreter(capsys, monkeypatch):
    import triton  # noqa: F401 (imported while TRITON_INTERPRET is set, as in this test process)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVCOMM_TRITON", "0")
    assert _main()(["--device", "cuda"]) == 2
    assert "Triton was imported with TRITON_INTERPRET set" in capsys.readouterr().err
    assert "TRITON_INTERPRET" not in os.environ and "KVCOMM_TRITON" not in os.environ
