"""The CPU part of the prepared device check (``benchmarks/gpu_check.py --cpu``) holds:
stock-equal plain requests, exact-prefix injection at cuts 1, 37, 64 and n-1 reproducing the
dense reply, garbage KV changing the output, in fp32 and bf16, with 16-token blocks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.parametrize("config", ["cpu-fp32", "cpu-bf16"])
def test_gpu_check_cpu_part_holds(config):
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--configs", config], capture_output=True, text=True,
                          timeout=1200)
    print(done.stdout)
    lines = done.stdout.splitlines()
    for check in ("stock[question]", "stock[document]", "exact[cut=1]", "exact[cut=37]", "exact[cut=64]", "garbage"):
        assert any(line.startswith("PASS") and check in line for line in lines), (check, done.stdout, done.stderr[-3000:])
    assert any(line.startswith("N/A") and "graphs" in line for line in lines)
    assert sum(line.startswith("PASS") and "exact[cut=" in line for line in lines) == 4
    assert done.returncode == 0 and "ALL CHECKS HOLD" in done.stdout, done.stdout
