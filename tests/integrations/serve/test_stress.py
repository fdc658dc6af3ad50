"""Concurrency stress on `kvcomm serve` (issue 6): many pipelines from many client threads at
once, two tenants, through vLLM's scheduler and the connector's scheduler and worker sides.

What must hold afterwards: no request failed, every response's provenance adds up to its
prompt, the server's counters equal the sum of what the responses reported (nothing lost or
counted twice), and the server's own consistency check (``TenantRegistry.problems()``: V and
byte caps, embedding index, access counts adding up) finds nothing.
"""

from __future__ import annotations

import threading
import time

import pytest

from .test_http import SOURCES, assert_counters_match, executor, metrics, provenance, run_pipeline_row  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

THREADS = 8
ROWS_PER_THREAD = 3


@pytest.mark.parametrize("mode", ["in-process", "multiprocess"])
def test_concurrent_pipelines_keep_the_server_consistent(mode, executor, request):  # noqa: F811
    """``mode``: the worker in the engine-core process (``kvcomm_server``) or in a process of
    its own (``kvcomm_server_mp``, vLLM's default); the printed seconds compare the two."""
    from conftest import MP_SERVER_KEYS

    if mode == "in-process":
        kvcomm_server = request.getfixturevalue("kvcomm_server")
        fresh_key = request.getfixturevalue("fresh_key")
        keys = (fresh_key(), fresh_key())  # two tenants of this test alone
    else:
        kvcomm_server = request.getfixturevalue("kvcomm_server_mp")
        keys = MP_SERVER_KEYS[1:3]
    before = metrics(kvcomm_server)
    results: dict[int, list] = {}
    errors: list[str] = []

    def client(worker: int) -> None:
        key = keys[worker % 2]
        try:
            results[worker] = [call for i in range(ROWS_PER_THREAD)
                               for call in run_pipeline_row(kvcomm_server, executor, key, (worker + i) % 4, max_tokens=8)]
        except Exception as error:  # collected: an exception in a thread would not fail the test
            errors.append(f"client {worker}: {error!r}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(w,)) for w in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    assert not errors, errors
    calls = [call for worker in sorted(results) for call in results[worker]]
    summaries = [provenance(response) for _, response in calls]
    assert len(calls) == THREADS * ROWS_PER_THREAD * 4
    for (prompt, _), summary in zip(calls, summaries):
        assert sum(summary[f"{s}_tokens"] for s in SOURCES) == summary["prompt_tokens"] == len(prompt)
    after = metrics(kvcomm_server)
    assert_counters_match(before, after, summaries)
    assert after["kvcomm_pool_problems"] == 0
    assert sum(s["exact_tokens"] + s["estimated_tokens"] for s in summaries) > 0  # reuse under load
    print(f"\nstress ({mode}): {THREADS} client threads x {ROWS_PER_THREAD} demo rows x 4 agents = {len(calls)} requests "
          f"on 2 tenants in {seconds:.0f} s; tokens exact/estimated/computed "
          f"{[sum(s[f'{x}_tokens'] for s in summaries) for x in SOURCES]}; "
          f"anchors {sum(v for k, v in after.items() if k.startswith('kvcomm_anchors{'))}, "
          f"pool bytes {after['kvcomm_pool_bytes']:.0f}, evictions {after['kvcomm_evictions']:.0f}")
