"""``benchmarks/bench_reuse.py --quick`` runs every section to the end on SmolLM2 and writes the
numbers its tables print. Run as a subprocess: the script sets torch's and faiss' thread counts
for its whole process. What is checked is that each section measured what it says (a section-3
plan reuses the whole segment from 2, 4 and 8 anchors; the miss section timed all three
ways; a first call computes its preamble and serves the text after it), not how fast: timings are the benchmark's business, on a quiet machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_reuse.py"


@pytest.mark.slow
def test_quick_run_measures_every_section(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["demo"]["overall"]
    miss = results["miss"]
    assert all(miss[f"ttft_{way}_s"] > 0 for way in ("dense", "standalone", "first_use"))
    segment = results["segment"]
    assert [key for key in segment if key.endswith("_anchors")] == ["2_anchors", "4_anchors", "8_anchors"]
    for anchors in ("2_anchors", "4_anchors", "8_anchors"):
        row = segment[anchors]
        assert row["estimated_tokens"] > 0.9 * 128, row  # the 128-token segment estimated, not recomputed
        assert len(row["admission_p"]) == int(anchors.split("_")[0])
    assert set(results["decide"]) >= {"10", "100"}
    assert results["embedders"]["anchors"] == 10
    preamble = results["preamble"]
    for tokens in (str(preamble["min_reuse"]), "256"):  # a first call's preamble computed, the whole shared text served
        assert preamble[tokens]["preamble_tokens"] > 0 and preamble[tokens]["served_tokens"] >= int(tokens), preamble[tokens]
    assert "[section 3 took" in run.stdout and "== 3. Reuse-path work" in run.stdout
