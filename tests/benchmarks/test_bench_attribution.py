"""``benchmarks/bench_attribution.py`` on one calibrated MMLU row with SmolLM2 (a subprocess, as
the script sets torch's thread count for its process). Checked: the kinds tile the reused
tokens, and giving every reused token its dense KV reproduces dense (the harness swaps KV
where it says it does); how much each kind matters is the benchmark's finding, not a law."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attribution.py"


@pytest.mark.slow
def test_one_row_attributes_every_reusing_call(tmp_path):
    out = tmp_path / "attribution.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--limit", "1", "--warm-items", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    records = json.loads(out.read_text())["records"]
    assert {r["agent"] for r in records} == {"agent2", "decider"}  # agent1 computes the new task
    for r in records:
        tokens, kl = r["tokens"], r["kl"]
        parts = tokens["task"] + tokens["replies"] + tokens["fixed text between"] + tokens["fixed text after"]
        assert parts == r["reused"] == tokens["all dense"] and tokens["task"] > 0
        assert tokens["all but the task"] == r["reused"] - tokens["task"]
        assert kl["all dense"] < 1e-8 < kl["served"], kl
    assert "all but the task" in run.stdout and "KL removed" in run.stdout
