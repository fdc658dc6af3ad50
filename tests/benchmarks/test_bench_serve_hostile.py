"""``benchmarks/bench_serve_hostile.py`` at small counts, end to end through a real `kvcomm
serve` (issue 39's must-shows 2 and 3; the benchmark runs the same code at >= 2,000 hostile and
>= 5,000 soak requests): no engine crash, every hostile request answered 200 or 4xx, no
cross-tenant hit, log growth bounded per request; the soak (16 clients, 4 tenants) without an
error, every tenant's bytes within its cap at every sample, the server's RSS flat after warm-up.
The longest engine step is printed, not asserted: on a shared 2-core CPU it is mostly vLLM's own
step time and the machine's other load."""

from __future__ import annotations

import json
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
    fuzz, soak = result["fuzz"], result["soak"]
    print(f"\nfuzz: {fuzz['requests']} hostile requests, {fuzz['engine_crashes']} engine crashes, longest engine step "
          f"{fuzz['longest_step_ms']:.0f} ms (median {fuzz['median_step_ms']:.0f}), {fuzz['cross_tenant_hits']} "
          f"cross-tenant hits, {fuzz['log_bytes_per_request']:.0f} log bytes per request; soak: {soak['requests']} "
          f"requests, {soak['errors']} errors, {soak['over_cap_samples']} samples over the cap (max "
          f"{soak['max_tenant_bytes_seen']:.0f} of {soak['cap']}), RSS drift {100 * soak['rss_drift']:+.1f}%")
    assert fuzz["engine_crashes"] == fuzz["non_4xx_failures"] == fuzz["cross_tenant_hits"] == 0, fuzz
    assert set(fuzz["statuses"]) <= {"200", "400", "404", "413", "422"} and "400" in fuzz["statuses"], fuzz
    assert fuzz["log_bytes_per_request"] <= MAX_LOG_BYTES_PER_REQUEST and fuzz["canary_gaps"] > 0, fuzz
    assert soak["errors"] == 0, soak["first_errors"]
    assert soak["samples"] > 0 and soak["over_cap_samples"] == 0 and soak["max_tenant_bytes_seen"] > 0, soak
    assert abs(soak["rss_drift"]) < 0.10, soak
