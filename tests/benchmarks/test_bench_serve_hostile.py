"""``benchmarks/bench_serve_hostile.py`` at small counts, end to end through a real `kvcomm
serve` (issue 39's must-shows 2 and 3; the benchmark runs the same code at >= 2,000 hostile and
>= 5,000 soak requests): no engine crash, every hostile request answered 200 or 4xx, no
cross-tenant hit, log growth bounded per request; the soak (16 clients, 4 tenants) without an
error, every tenant's bytes within its cap at every sample, the server's RSS flat after warm-up.
kvcomm's own time per engine step is read from the server's metrics for every side (worker,
scheduler, RPCs to the workers); its bound (issue 39: under 200 ms) and the canary's longest gap with and
without planning are printed, not asserted: on a shared 2-core CPU they hold the machine's other
load."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve_hostile.py"
MAX_LOG_BYTES_PER_REQUEST = 4096


def test_hostile_fuzz_and_soak_at_small_counts():
    run = subprocess.run([sys.executable, str(SCRIPT), "--fuzz", "80", "--soak", "96", "--clients", "16", "--tenants", "4",
                          "--max-tenant-bytes", "4000000", "--json"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    fuzz, soak, baseline = result["fuzz"], result["soak"], result["fuzz_without_planning"]
    steps = fuzz["kvcomm_step"]
    print(f"\nfuzz: {fuzz['requests']} hostile requests, {fuzz['engine_crashes']} engine crashes, longest kvcomm work "
          f"in one engine step {fuzz['kvcomm_longest_step_ms']:.1f} ms ({steps}), longest canary gap "
          f"{fuzz['longest_gap_ms']:.0f} ms ({baseline['longest_gap_ms']:.0f} ms without planning), "
          f"{fuzz['cross_tenant_hits']} cross-tenant hits, {fuzz['log_bytes_per_request']:.0f} log bytes per request; "
          f"soak: {soak['requests']} requests, {soak['errors']} errors, {soak['approximate_notes']} of "
          f"{soak['planned']} planned learned nothing (approximate blocks), {soak['over_cap_samples']} samples over "
          f"the cap (max {soak['max_tenant_bytes_seen']:.0f} of {soak['cap']}), RSS drift {100 * soak['rss_drift']:+.1f}%")
    assert 0 < fuzz["kvcomm_longest_step_ms"] < math.inf, fuzz
    for side, figures in steps.items():  # every side exported; the worker and the scheduler step with the engine
        assert 0 <= figures["longest_ms"] < math.inf and figures["p99_ms_at_most"] <= 5000, (side, figures)
        assert fuzz["kvcomm_step_cpu"][side]["longest_ms"] <= figures["longest_ms"] + 1, (side, fuzz["kvcomm_step_cpu"])
    assert steps["worker"]["steps"] > fuzz["canary_gaps"] and steps["scheduler"]["steps"] > fuzz["canary_gaps"], steps
    assert steps["worker"]["longest_ms"] > 0 and steps["scheduler"]["longest_ms"] > 0, steps
    assert steps["rpc"]["steps"] > 0 and steps["rpc"]["longest_ms"] > 0, steps
    assert baseline["engine_crashes"] == baseline["non_4xx_failures"] == 0 and baseline["canary_gaps"] > 0, baseline
    assert baseline["cross_tenant_hits"] == 0, baseline  # --no-plan keeps tenants apart too
    assert baseline["kvcomm_step"]["rpc"]["steps"] == 0, baseline["kvcomm_step"]
    assert 0 <= soak["approximate_notes"] <= soak["planned"] == soak["requests"] - soak["errors"], soak
    assert fuzz["engine_crashes"] == fuzz["non_4xx_failures"] == fuzz["cross_tenant_hits"] == 0, fuzz
    assert set(fuzz["statuses"]) <= {"200", "400", "404", "413", "422"} and "400" in fuzz["statuses"], fuzz
    assert fuzz["log_bytes_per_request"] <= MAX_LOG_BYTES_PER_REQUEST and fuzz["canary_gaps"] > 0, fuzz
    assert soak["errors"] == 0, soak["first_errors"]
    assert soak["samples"] > 0 and soak["over_cap_samples"] == 0 and soak["max_tenant_bytes_seen"] > 0, soak
    assert abs(soak["rss_drift"]) < 0.10, soak
