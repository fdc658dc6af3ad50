"""``benchmarks/gpu_core_check.py`` (the core on a GPU without vLLM) runs its steps on the CPU:
the self-check of every RoPE variant in three dtypes with its failing control, exact injection,
the device-agreement check (trivially the same device here) and the TTFT step on the tiny model.
A GPU machine runs the same script with ``--device cuda``."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _main():
    sys.path.insert(0, str(SCRIPT_DIR))
    try:
        from gpu_core_check import main
    finally:
        sys.path.remove(str(SCRIPT_DIR))
    return main


def test_every_step_holds_on_the_cpu(capsys, tmp_path):
    rc = _main()(["--device", "cpu", "--ttft", "tiny:fp32", "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    print(out)
    lines = out.splitlines()
    passed = [line for line in lines if line.startswith("PASS")]
    assert sum("selfcheck[" in line for line in passed) == 27  # 9 RoPE variants x fp32, bf16, fp16
    assert sum("control[" in line for line in passed) == 3
    assert sum("exact[" in line for line in passed) == 3
    assert {line.split()[1] for line in passed if "cpu=device[" in line} == {
        "cpu=device[realign]", "cpu=device[kvcomm]", "cpu=device[cacheblend]"}
    assert any(line.startswith("INFO") and "ttft[tiny:fp32]" in line and "estimated" in line for line in lines)
    assert rc == 0 and "ALL CHECKS HOLD" in out and not any(line.startswith("FAIL") for line in lines)
    assert (tmp_path / "rows.json").is_file()


def test_a_device_torch_cannot_see_is_refused_with_exit_status_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _main()(["--device", "cuda"]) == 2
    assert "torch sees 0 CUDA device(s)" in capsys.readouterr().err
