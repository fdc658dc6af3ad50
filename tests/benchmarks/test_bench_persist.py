"""``benchmarks/bench_persist.py`` at CI size: a few MB of state learned by a tiny random Llama
through the transformers executor, saved, one anchor learned, saved again, loaded. Run as a
subprocess (the script sets torch's thread count for its process). What is checked is what
the benchmark must show: the second save writes the new anchor and not much more (here the
manifest, which names every object, is a visible share of so small a save), and the first
writes the whole state; timings are the benchmark's business."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_persist.py"


def test_a_save_after_one_new_anchor_writes_about_that_anchor(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--gb", "0.004", "--layers", "4", "--kv-heads", "2",
                          "--head-dim", "16", "--tokens", "64", "--threads", "1", "--json", str(out),
                          "--dir", str(tmp_path / "save")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["format_version"] == 3 and results["state_bytes"] >= 4e6
    first, second = results["save_1"], results["save_2"]
    assert first["write_syscall_bytes"] >= results["state_bytes"] * 0.9  # the first save writes everything
    assert second["write_syscall_bytes"] == second["new_or_replaced_file_bytes"]
    assert results["new_anchor_bytes"] <= second["write_syscall_bytes"] < 0.1 * second["save_bytes"]
    assert results["loaded_bytes"] >= results["state_bytes"] and results["anchors"] > 5
    assert "learning:" in run.stderr and "save 2" in run.stderr
