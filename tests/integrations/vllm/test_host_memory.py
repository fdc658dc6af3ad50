"""The trimmer hands freed heap memory back: a worker's RSS follows the bytes kvcomm holds."""

import subprocess
import sys
import textwrap

from kvcomm.integrations.vllm.planning.host_memory import Trimmer

FRAGMENTED = textwrap.dedent("""
    import json, time, psutil, torch
    from kvcomm.integrations.vllm.planning.host_memory import Trimmer
    rss = lambda: psutil.Process().memory_info().rss
    torch.empty(16 << 20, dtype=torch.uint8)  # freed at once: glibc's mmap threshold rises past a segment's KV
    held = [torch.ones(1 << 18) for _ in range(400)]  # 400 x 1 MiB, as a pool's segments are
    del held[::2]  # every other one evicted: 200 MiB of holes no top-of-heap trim returns
    trimmer = Trimmer(interval_s=0.05)
    before = rss()
    if {trim}:
        trimmer.released()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and trimmer.trims == 0 and {trim}:
        time.sleep(0.01)
    time.sleep(0.2)
    print(json.dumps({{"before": before, "after": rss(), "trims": trimmer.trims, "available": trimmer.available}}))
    trimmer.stop()
""")


def _run(trim: bool) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", FRAGMENTED.format(trim=trim)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_trimmer_is_available_on_this_glibc_machine():
    trimmer = Trimmer()
    try:
        assert trimmer.available, "this CI machine runs glibc: malloc_trim must be found"
    finally:
        trimmer.stop()


def test_a_trim_returns_the_holes_eviction_leaves():
    kept = _run(trim=False)
    trimmed = _run(trim=True)
    assert kept["trims"] == 0 and trimmed["trims"] >= 1
    assert kept["before"] - kept["after"] < 50 << 20, "without a trim glibc keeps the freed holes"
    assert trimmed["before"] - trimmed["after"] > 150 << 20, "a trim returns most of the 200 MiB of holes"


def test_only_released_memory_starts_a_trim_and_stop_ends_the_thread():
    trimmer = Trimmer(interval_s=0.01)
    import time

    time.sleep(0.1)
    assert trimmer.trims == 0
    trimmer.released()
    deadline = time.monotonic() + 5
    while trimmer.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trimmer.trims == 1
    trimmer.stop()
    assert not trimmer._thread.is_alive()
