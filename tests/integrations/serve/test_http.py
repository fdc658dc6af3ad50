"""`kvcomm serve` end to end over HTTP: one server subprocess per session (``kvcomm_server``),
two API keys = two tenants, annotated /v1/completions requests as a remote client sends them."""

from __future__ import annotations

import dataclasses
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import SERVER_KEYS, SPARE_KEYS
from kvcomm.integrations.serve.middleware import salt_of, tenant_of
from kvcomm.reuse.pipeline import load_demo_pipeline
from kvcomm.reuse.runner import _content, build_prompt

pytestmark = pytest.mark.slow

SOURCES = ("exact", "estimated", "computed")


def annotations(prompt) -> dict:
    """``kv_transfer_params["kvcomm"]`` naming a kvcomm ``Prompt``'s shared segments."""
    spans = [{"start": start, "end": start + len(segment), "slot": segment.slot}
             for segment, start in zip(prompt.segments, prompt.starts) if segment.is_shared]
    return {"template": prompt.template_id, "segments": spans}


def provenance(response: dict) -> dict:
    summary = response["kv_transfer_params"]["kvcomm"]
    assert "error" not in summary, summary
    return summary


def run_pipeline_row(server, executor, key: str, row: int, max_tokens: int = 12) -> list[tuple[object, dict]]:
    """The demo pipeline's agents on input ``row`` through HTTP; each agent sees the earlier
    agents' replies (as returned token ids). Returns (prompt, response) per agent."""
    from kvcomm.core.segments import Segment

    spec = load_demo_pipeline()
    shared = {name: _content(executor, spec.inputs[row][name]) for name in spec.input_slots}
    calls = []
    for agent in spec.agents:
        prompt = build_prompt(executor, agent, shared)
        response = server.complete(prompt.token_ids, key, max_tokens, annotations(prompt))
        calls.append((prompt, response))
        reply = [t for t in response["choices"][0]["token_ids"] if t != executor.tokenizer.eos_token_id]
        shared[agent.name] = Segment(tuple(reply), slot="_") if reply else None
    return calls


def assert_counters_match(before: dict[str, float], after: dict[str, float], summaries: list[dict]) -> None:
    """The server's counters grew by exactly what the responses reported: prompt tokens by
    source and planned requests (nothing lost or counted twice)."""
    for source in SOURCES:
        name = f'kvcomm_prompt_tokens_total{{source="{source}"}}'
        assert after[name] - before.get(name, 0.0) == sum(s[f"{source}_tokens"] for s in summaries)
    planned = 'kvcomm_requests_total{outcome="planned"}'
    assert after[planned] - before.get(planned, 0.0) == len(summaries)


def metrics(server) -> dict[str, float]:
    """The server's kvcomm metrics (``/metrics`` needs one of its keys when it has keys)."""
    status, text = server.request("GET", "/metrics", key=server.keys[0] if server.keys else None)
    assert status == 200
    found = {}
    for line in text.splitlines():
        match = re.match(r'^(kvcomm_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if match:
            found[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return found


@pytest.fixture(scope="module")
def executor(smol):
    """Tokenizer and chat template of the served model (prompts are built exactly as in-process)."""
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    return TransformersExecutor(*smol)


def test_models_and_authentication(kvcomm_server):
    status, models = kvcomm_server.request("GET", "/v1/models", key=kvcomm_server.keys[1])
    assert status == 200 and models["data"][0]["id"] == kvcomm_server.model
    status, _ = kvcomm_server.request("GET", "/v1/models", key="not-a-key")
    assert status == 401
    assert all(key not in kvcomm_server.log.read_text() for key in SERVER_KEYS + SPARE_KEYS), "an API key reached the log"


def test_annotated_requests_learn_reuse_and_metrics_match(kvcomm_server, executor, fresh_key):
    check_learn_reuse_and_metrics(kvcomm_server, executor, fresh_key())  # a tenant of this test alone


def test_learn_reuse_and_metrics_under_vllms_default_multiprocess_engine(kvcomm_server_mp, executor):
    """The same through `kvcomm serve` with vLLM's defaults: the planner lives in the worker
    process, and /metrics still sees its counters (Prometheus multiprocess mode)."""
    assert "Worker pid=" in kvcomm_server_mp.log.read_text()  # the worker runs in a process of its own
    check_learn_reuse_and_metrics(kvcomm_server_mp, executor, kvcomm_server_mp.keys[0])


def check_learn_reuse_and_metrics(server, executor, key: str) -> None:
    """Three pipeline rows and an exact repeat in ``key``'s (empty) tenant: every summary adds
    up, the repeat is exact, later agents are estimated, and /metrics grew by the summaries."""
    before = metrics(server)
    calls = [call for row in range(3) for call in run_pipeline_row(server, executor, key, row)]
    first_prompt = calls[0][0]
    repeat = server.complete(first_prompt.token_ids, key, 4, annotations(first_prompt))
    calls.append((first_prompt, repeat))
    summaries = [provenance(response) for _, response in calls]
    for (prompt, response), summary in zip(calls, summaries):
        assert sum(summary[f"{s}_tokens"] for s in SOURCES) == summary["prompt_tokens"] == len(prompt)
        # vLLM counts its own prefix hit and every token the connector supplied as cached.
        cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= summary["exact_tokens"] + summary["estimated_tokens"]
    print(f"\nHTTP pipeline: {[(s['exact_tokens'], s['estimated_tokens'], s['computed_tokens']) for s in summaries]}")
    # (1) a repeated annotated prompt is served from the exact store, all but its last token
    assert summaries[-1]["exact_tokens"] == len(first_prompt) - 1
    # (2) later agents see earlier agents' replies at other offsets: estimated from anchors
    assert sum(s["estimated_tokens"] for s in summaries) > 0
    after = metrics(server)
    assert_counters_match(before, after, summaries)
    fallbacks = after.get("kvcomm_fallbacks_total", 0.0) - before.get("kvcomm_fallbacks_total", 0.0)
    assert fallbacks == sum(s["fallback"] for s in summaries)
    assert after["kvcomm_pool_bytes"] > 0 and any(k.startswith("kvcomm_anchors{") and v > 0 for k, v in after.items())
    assert "kvcomm_evictions" in after and any(k.startswith("kvcomm_tenant_bytes{") for k in after)


def test_tenants_per_api_key_are_isolated(kvcomm_server, executor, fresh_key):
    key_a, key_b = fresh_key(), fresh_key()  # two tenants of this test alone
    spec = load_demo_pipeline()
    # A system message no earlier test sent: nothing in vLLM's own prefix cache (shared by all
    # tenants' unsalted requests) explains any reuse B gets here.
    agent = dataclasses.replace(spec.agents[1], system=f"{spec.agents[1].system} Session {uuid.uuid4().hex}.")
    prompt = build_prompt(executor, agent, {
        "task": _content(executor, "Tenant A's secret: the launch code is 7-4-1-9. " + spec.inputs[1]["task"]),
        "analyst": _content(executor, "Step one: read the code. Step two: keep it."),
    })
    assert len(prompt) > 64  # spans several 32-token blocks, so vLLM's prefix cache could hit
    for _ in range(2):
        a = kvcomm_server.complete(prompt.token_ids, key_a, 4, annotations(prompt))
    assert provenance(a)["exact_tokens"] == len(prompt) - 1  # same key: reused
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt) - 1
    # Tenant B even names tenant A's tenant id and cache salt in the body: the key decides.
    forged = {**annotations(prompt), "tenant": tenant_of(key_a)}
    b = kvcomm_server.complete(prompt.token_ids, key_b, 4, forged, cache_salt=salt_of(tenant_of(key_a), True))
    b_plain = kvcomm_server.complete(prompt.token_ids, key_b, 4, cache_salt=salt_of(tenant_of(key_a), False))
    summary_b = provenance(b)
    assert summary_b["exact_tokens"] == summary_b["estimated_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not even vLLM's prefix cache
    assert b_plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = kvcomm_server.complete(prompt.token_ids, key_b, 4, annotations(prompt))
    assert provenance(again)["exact_tokens"] == len(prompt) - 1  # B's own content is reused for B
    assert again["choices"][0]["text"] == b["choices"][0]["text"]

def test_bad_params_get_a_clear_error_while_good_requests_succeed(kvcomm_server, executor, fresh_key):
    key = fresh_key()
    spec = load_demo_pipeline()
    prompt = build_prompt(executor, spec.agents[0], {"task": _content(executor, spec.inputs[2]["task"])})
    good = annotations(prompt)
    span = good["segments"][0]
    refused = [  # the middleware sees these before vLLM: a 400
        {**good, "segments": [span, {**span, "start": span["start"] + 1}]},  # overlapping
        {**good, "segments": [{**span, "start": "0"}]},  # wrong type
        {**good, "segments": [{**span, "end": 1e308}]},  # a float for an integer
    ]
    past_the_end = {**good, "segments": [{**span, "end": len(prompt) + 5}]}  # known after tokenization: in-band

    def send(kvcomm: dict):
        return kvcomm_server.request("POST", "/v1/completions", {
            "model": kvcomm_server.model, "prompt": list(prompt.token_ids), "max_tokens": 6, "temperature": 0,
            "kv_transfer_params": {"kvcomm": kvcomm}}, key)

    jobs = [good, refused[0], good, past_the_end, good, refused[1], refused[2]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(send, jobs))
    assert [status for status, _ in answers] == [200, 400, 200, 200, 200, 400, 400], answers
    served = [reply for status, reply in answers if status == 200]
    assert all(r["choices"][0]["finish_reason"] in ("length", "stop") for r in served)
    errors = [r["kv_transfer_params"]["kvcomm"].get("error") for r in served]
    assert errors[0] is None and errors[1] is None and "prompt length" in errors[2] and errors[3] is None, errors
    messages = [reply["error"]["message"] for status, reply in answers if status == 400]
    assert "overlaps" in messages[0] and "must be an integer, got str" in messages[1]
    assert "must be an integer, got float" in messages[2]
    status, reply = kvcomm_server.request("POST", "/v1/completions", {
        "model": kvcomm_server.model, "prompt": list(prompt.token_ids), "max_tokens": 2,
        "kv_transfer_params": {"kvcomm": {"handle": "request-x"}}}, key)
    assert status == 400 and "kvcomm's own" in str(reply)


def test_route_sweep_every_route_keyed_and_no_forged_tenant_or_salt_reaches_another_tenant(kvcomm_server, executor, fresh_key):
    """Every route of the served app (vLLM's OpenAPI schema, plus the mounted /metrics): without a
    key every route but the health probes answers 401 (vLLM's own check left /metrics,
    /invocations, /generative_scoring and others open); every POST route is in the table kvcomm logged
    at start-up as generation (tenant and salt set by kvcomm) or plain; and tenant B, forging
    tenant A's tenant and reuse salt on the generation routes that report cached tokens, gets
    none of A's exact, estimated or vLLM-cached tokens."""
    from kvcomm.integrations.serve.routes import HEALTH_PROBES

    line = next(text for text in kvcomm_server.log.read_text().splitlines() if re.search(r"kvcomm: \d+ routes;", text))
    status, schema = kvcomm_server.request("GET", "/openapi.json", key=kvcomm_server.keys[0])
    assert status == 200
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops] + [("GET", "/metrics")]
    # every other method too (OPTIONS /metrics answered the metrics without a key), and /metrics' variants
    routes += [(method, path) for path in {p for _, p in routes} | {"/metrics/", "/metrics/x", "/metrics?x=1"}
               for method in ("OPTIONS", "PUT", "DELETE", "PATCH", "HEAD") if (method, path) not in routes]
    unrewritten = [f"{m} {p}" for m, p in routes if m == "POST" and f"POST {p}" not in line]
    unauthenticated = []
    for method, path in routes:
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        status, _ = kvcomm_server.request(method, concrete, {} if method in ("POST", "PUT", "PATCH") else None)
        if status != 401 and path not in HEALTH_PROBES:  # a 400 or 422 would mean the route read the body
            unauthenticated.append(f"{method} {path} -> {status}")
    a, b = fresh_key(), fresh_key()
    spec = load_demo_pipeline()
    salt = salt_of(tenant_of(a), reuse=True)
    forged = {"tenant": tenant_of(a)}
    leaked = 0
    # (route, chat or completion body, B opts in): each attempt on content only A has sent (twice,
    # opted in: in A's reuse store and in vLLM's cache under A's reuse salt), B forging A's tenant and salt
    for path, chat, opted_in in (("/v1/completions", False, True), ("/v1/completions", False, False),
                                 ("/invocations", False, True), ("/v1/chat/completions", True, True),
                                 ("/v1/chat/completions", True, False), ("/invocations", True, True)):
        marker = uuid.uuid4().hex
        agent = dataclasses.replace(spec.agents[0], system=f"{spec.agents[0].system} Sweep {marker}.")
        prompt = build_prompt(executor, agent, {"task": _content(executor, spec.inputs[1]["task"])})
        if chat:
            body = {"model": kvcomm_server.model, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": agent.system}, {"role": "user", "content": f"Plan {marker}."}]}
            options = {}
        else:
            body = {"model": kvcomm_server.model, "prompt": list(prompt.token_ids), "max_tokens": 2, "temperature": 0}
            options = annotations(prompt)
        for _ in range(2):
            status, reply = kvcomm_server.request("POST", path, {**body, "kv_transfer_params": {"kvcomm": options}}, a)
            assert status == 200 and "error" not in reply["kv_transfer_params"]["kvcomm"], reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # A's own repeat hits: there is something to leak
        attempt = {**body, "cache_salt": salt}
        if opted_in:
            attempt["kv_transfer_params"] = {"kvcomm": {**options, **forged}}
        status, reply = kvcomm_server.request("POST", path, attempt, b)
        assert status == 200, (path, reply)
        summary = (reply.get("kv_transfer_params") or {}).get("kvcomm") or {}
        leaked += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        leaked += summary.get("exact_tokens", 0) + summary.get("estimated_tokens", 0)
    in_app = re.search(r"kvcomm: (\d+) routes", line).group(1)
    print(f"\nroute sweep: {len(routes)} routes ({in_app} in the app), "
          f"{len(unrewritten)} unrewritten, {leaked} cross-tenant cached tokens, {len(unauthenticated)} unauthenticated "
          "answers other than 401 (so 0 unauthenticated 200s)")
    assert unrewritten == [] and leaked == 0 and unauthenticated == [], (unrewritten, unauthenticated)
