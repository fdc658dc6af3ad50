"""`kvcomm serve` in keyless mode (no ``--api-key``: tenants named by the request body) with
byte caps (``--max-tenant-bytes``, ``--max-total-bytes``) and a slot list (``--slots``),
through one real server shared by this module.

- keyless: no authentication; ``kv_transfer_params.kvcomm.tenant`` picks the tenant, and the
  middleware gives opted-in requests their tenant's cache salt, so tenants share neither
  kvcomm's stores nor vLLM's prefix cache, and annotated requests may use estimated KV;
- ``--slots``: an annotation naming another slot is refused for that request only (served
  without reuse, the error in its ``kv_transfer_params``), and counted as ``rejected``;
- byte caps under concurrent load: after the load, every tenant's bytes are within the
  tenant cap and all tenants' within the total cap, and the pools are consistent.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from kvcomm.reuse.pipeline import load_demo_pipeline
from kvcomm.reuse.runner import _content, build_prompt
from kvcomm.services.tenants import tenant_label
from .test_http import SOURCES, annotations, executor, metrics, provenance  # noqa: F401 (fixture)
from .test_persistence_http import run_row

pytestmark = pytest.mark.slow

MIB = 1 << 20
TENANT_CAP = 24 * MIB
TOTAL_CAP = 56 * MIB
SLOTS = ("task", "analyst", "planner", "critic")
# SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 channels x (K and V) x 4 bytes per token
BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4


@pytest.fixture(scope="module")
def keyless_server(tmp_path_factory):
    from support.serve_client import start_server

    log = tmp_path_factory.mktemp("kvcomm-serve-caps") / "server.log"
    server = start_server(log, (), "--max-tenant-bytes", str(TENANT_CAP), "--max-total-bytes", str(TOTAL_CAP),
                          "--slots", *SLOTS)
    try:
        yield server
    finally:
        server.stop()


def _prompt(executor, marker: str):  # noqa: F811
    spec = load_demo_pipeline()
    return build_prompt(executor, spec.agents[1], {
        "task": _content(executor, f"Case {marker}. " + spec.inputs[2]["task"]),
        "analyst": _content(executor, "The facts: two trains, one bridge, ten minutes apart."),
    })


def test_keyless_tenants_come_from_the_body_and_are_isolated(keyless_server, executor):  # noqa: F811
    status, models = keyless_server.request("GET", "/v1/models")  # no key needed
    assert status == 200 and models["data"][0]["id"] == keyless_server.model
    prompt = _prompt(executor, uuid.uuid4().hex)
    mine, theirs = f"alpha-{uuid.uuid4().hex[:8]}", f"beta-{uuid.uuid4().hex[:8]}"
    first = keyless_server.complete(prompt.token_ids, None, 4, {**annotations(prompt), "tenant": mine})
    # the middleware salted the request, so the planner may estimate (it did not say "exact only")
    assert "no cache_salt" not in provenance(first)["note"]
    again = keyless_server.complete(prompt.token_ids, None, 4, {**annotations(prompt), "tenant": mine})
    assert provenance(again)["exact_tokens"] == len(prompt) - 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
    other = keyless_server.complete(prompt.token_ids, None, 4, {**annotations(prompt), "tenant": theirs})
    assert provenance(other)["exact_tokens"] == provenance(other)["estimated_tokens"] == 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not vLLM's prefix cache either
    assert other["choices"][0]["text"] == first["choices"][0]["text"]
    # a request that does not opt in is stock vLLM: never handed the tenants' salted blocks
    plain = keyless_server.complete(prompt.token_ids, None, 4)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and plain.get("kv_transfer_params") is None


def test_an_unknown_slot_is_rejected_for_that_request_and_counted(keyless_server, executor):  # noqa: F811
    prompt = _prompt(executor, uuid.uuid4().hex)
    tenant = f"slots-{uuid.uuid4().hex[:8]}"
    good = {**annotations(prompt), "tenant": tenant}
    unknown = {**good, "segments": [{**span, "slot": "summary"} for span in good["segments"]]}
    out_of_range = {**good, "segments": [{**good["segments"][0], "end": len(prompt) + 3}]}
    before = metrics(keyless_server)
    refused = keyless_server.complete(prompt.token_ids, None, 4, unknown)
    error = refused["kv_transfer_params"]["kvcomm"]["error"]
    assert "'summary' is not a known slot" in error and all(s in error for s in SLOTS)
    assert refused["choices"][0]["finish_reason"] in ("length", "stop")  # still served, without reuse
    assert "prompt length" in keyless_server.complete(prompt.token_ids, None, 4, out_of_range)["kv_transfer_params"]["kvcomm"]["error"]
    served = keyless_server.complete(prompt.token_ids, None, 4, good)
    assert "error" not in served["kv_transfer_params"]["kvcomm"]
    assert served["choices"][0]["text"] == refused["choices"][0]["text"]
    after = metrics(keyless_server)
    rejected, planned = 'kvcomm_requests_total{outcome="rejected"}', 'kvcomm_requests_total{outcome="planned"}'
    assert after[rejected] - before.get(rejected, 0.0) == 2
    assert after[planned] - before.get(planned, 0.0) == 1


THREADS = 6
ROWS_PER_THREAD = 2


def test_byte_caps_hold_under_concurrent_load(keyless_server, executor):  # noqa: F811
    tenants = [f"load-{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    results: dict[int, list] = {}
    errors: list[str] = []

    def client(worker: int) -> None:
        try:
            results[worker] = [call for i in range(ROWS_PER_THREAD)
                               for call in run_row(keyless_server, executor, (worker + i) % 4, tenants[worker % 3], None)]
        except Exception as error:  # collected: an exception in a thread would not fail the test
            errors.append(f"client {worker}: {error!r}")

    threads = [threading.Thread(target=client, args=(w,)) for w in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    calls = [call for worker in sorted(results) for call in results[worker]]
    assert len(calls) == THREADS * ROWS_PER_THREAD * 4
    summaries = [provenance(response) for _, response in calls]
    for (prompt, _), summary in zip(calls, summaries):
        assert sum(summary[f"{s}_tokens"] for s in SOURCES) == summary["prompt_tokens"] == len(prompt)
    # the caps must bind: the exact prefix store alone would keep every computed prompt's KV
    demand = {t: 0 for t in tenants}
    for worker in results:
        demand[tenants[worker % 3]] += sum(s["computed_tokens"] for s in map(provenance, (r for _, r in results[worker])))
    assert all(d * BYTES_PER_TOKEN > TENANT_CAP for d in demand.values()), demand
    after = metrics(keyless_server)
    held = {t: after[f'kvcomm_tenant_bytes{{tenant="{tenant_label(t)}"}}'] for t in tenants}
    assert all(0 < b <= TENANT_CAP for b in held.values()), held
    everyone = sum(v for k, v in after.items() if k.startswith("kvcomm_tenant_bytes{"))
    assert everyone <= TOTAL_CAP and after["kvcomm_pool_problems"] == 0, (everyone, held)
    # three tenants' demand exceeds the total cap, so the total cap is what the load reached
    assert sum(demand.values()) * BYTES_PER_TOKEN > TOTAL_CAP and everyone > 0.9 * TOTAL_CAP, everyone
    assert after["kvcomm_pool_bytes"] > 0  # anchors outlive cheaper entries (prefixes, bases) under the caps
    print(f"\ncaps: held per tenant {[round(b / MIB, 1) for b in held.values()]} MiB of {TENANT_CAP / MIB:.0f}, "
          f"all tenants {everyone / MIB:.1f} MiB of {TOTAL_CAP / MIB:.0f}; demand (computed tokens x bytes) "
          f"{[round(d * BYTES_PER_TOKEN / MIB) for d in demand.values()]} MiB")
