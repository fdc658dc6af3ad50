"""kvcomm serve's tenant middleware on a small FastAPI app shaped like vLLM's, that echoes what
it received (no model, no vLLM engine)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

starlette = pytest.importorskip("starlette")
fastapi = pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from pydantic import BaseModel, ConfigDict  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware.cors import CORSMiddleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from kvcomm.integrations.serve.bodies import MAX_BODY_BYTES, MAX_DEPTH  # noqa: E402
from kvcomm.integrations.serve.middleware import (  # noqa: E402
    API_KEY_DIGESTS_ENV, KEY_DIGESTS_ENV, KeyMismatch, KvcommTenantMiddleware, client_salt, key_digest, rewrite,
    salt_of, shown, tenant_of,
)
from kvcomm.integrations.serve.routes import RouteTable  # noqa: E402

KEYS = ("key-one", "key-two")
DIGESTS = frozenset(key_digest(k) for k in KEYS)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Generation(_Body):  # vLLM's CompletionRequest, ChatCompletionRequest, ...: may opt into kvcomm
    kv_transfer_params: dict | None = None
    cache_salt: str | None = None


class Batch(_Body):  # vLLM's BatchChatCompletionRequest: a salt, no kvcomm opt-in
    cache_salt: str | None = None


class Tokenize(_Body):  # vLLM's TokenizeCompletionRequest: neither
    prompt: object = None


async def _echo(request: Request) -> JSONResponse:
    raw = await request.body()
    assert int(request.headers["content-length"]) == len(raw)
    return JSONResponse({"body": json.loads(raw) if raw else None})


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def generation(body: Generation, request: Request) -> JSONResponse:
    return await _echo(request)


async def batch(body: Batch, request: Request) -> JSONResponse:
    return await _echo(request)


async def tokenize(body: Tokenize, request: Request) -> JSONResponse:
    return await _echo(request)


def app_like_vllms() -> FastAPI:
    """A FastAPI app with vLLM's kinds of routes: declared generation bodies, a raw-body route
    (/invocations), a salted body (/v1/chat/completions/batch), a plain body (/tokenize), GETs,
    a mounted /metrics that answers every method, /health, and vLLM's CORS middleware."""
    app = FastAPI()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        app.post(path)(generation)
    app.post("/v1/chat/completions/batch")(batch)
    app.post("/tokenize")(tokenize)
    app.router.routes.append(Route("/invocations", _echo, methods=["POST"]))
    for path in ("/health", "/version", "/v1/models"):
        app.get(path)(hello)
    app.mount("/metrics", Starlette(routes=[Route("/", hello, methods=["GET", "POST", "OPTIONS", "PUT"])]))
    app.add_middleware(CORSMiddleware, allow_origins=[], allow_methods=["*"], allow_headers=["*"])
    return app


def client(monkeypatch, keys: tuple[str, ...], tenant_per_key: bool = True) -> TestClient:
    """``app_like_vllms`` behind the middleware, configured as `kvcomm serve` does for ``keys``."""
    digests = ",".join(key_digest(k) for k in keys)
    monkeypatch.setenv(KEY_DIGESTS_ENV, digests if tenant_per_key else "")
    monkeypatch.setenv(API_KEY_DIGESTS_ENV, digests)
    app = app_like_vllms()
    app.add_middleware(KvcommTenantMiddleware)
    return TestClient(app)


def opted_in(**extra) -> dict:
    return {"prompt": [1, 2, 3], "kv_transfer_params": {"kvcomm": {"segments": [], **extra}}}


def test_each_key_is_its_own_tenant_and_overrides_the_body(monkeypatch):
    http = client(monkeypatch, KEYS)
    seen = []
    for key in KEYS:
        forged = opted_in(tenant=tenant_of(KEYS[0]))
        body = http.post("/v1/completions", json={**forged, "cache_salt": "mine"},
                         headers={"Authorization": f"Bearer {key}"}).json()["body"]
        assert body["kv_transfer_params"]["kvcomm"]["tenant"] == tenant_of(key)
        assert body["cache_salt"] == salt_of(tenant_of(key), reuse=True)
        plain = http.post("/v1/chat/completions", json={"messages": [], "cache_salt": "x"},
                          headers={"Authorization": f"Bearer {key}"}).json()["body"]
        assert plain == {"messages": [], "cache_salt": salt_of(tenant_of(key), reuse=False)}
        seen.append((body["cache_salt"], plain["cache_salt"], tenant_of(key)))
    assert len({v for row in seen for v in row}) == 6  # no salt or tenant shared across keys or kinds
    assert all(k not in json.dumps(seen) for k in KEYS)  # ids are hashes, never the key


def test_every_generation_route_rewrites_tenant_and_salt(monkeypatch):
    """/v1/messages and /invocations carry kv_transfer_params and cache_salt as /v1/completions
    does: a keyed client's forged tenant and salt never pass on any of them."""
    http = client(monkeypatch, KEYS)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/invocations"):
        forged = {**opted_in(tenant=tenant_of(KEYS[0])), "cache_salt": salt_of(tenant_of(KEYS[0]), True)}
        body = http.post(path, json=forged, headers={"Authorization": f"Bearer {KEYS[1]}"}).json()["body"]
        assert body["kv_transfer_params"]["kvcomm"]["tenant"] == tenant_of(KEYS[1]), path
        assert body["cache_salt"] == salt_of(tenant_of(KEYS[1]), reuse=True), path


def test_without_keys_salts_are_the_servers_and_a_client_salt_never_reaches_approximate_blocks(monkeypatch):
    """Approximate KV lives only in blocks salted salt_of(tenant, True). A client-chosen salt used to
    be kept on opted-in requests, and a plain request could send salt_of("default", True) itself
    (the formula is public) to get exact prefix hits on approximate blocks. Now an opted-in
    request's salt is always the server's, and a plain request's own salt is mapped elsewhere."""
    http = client(monkeypatch, ())
    body = http.post("/v1/completions", json=opted_in(tenant="team-a")).json()["body"]
    assert body["cache_salt"] == salt_of("team-a", reuse=True)
    mine = http.post("/v1/completions", json={**opted_in(), "cache_salt": "own"}).json()["body"]
    assert mine["cache_salt"] == salt_of("default", reuse=True)
    reuse_salts = {salt_of(t, True) for t in ("default", "team-a")}
    for salt in [*reuse_salts, "own"]:
        plain = http.post("/v1/chat/completions", json={"messages": [], "cache_salt": salt}).json()["body"]
        assert plain["cache_salt"] == client_salt(salt) and plain["cache_salt"] not in reuse_salts
    assert client_salt("own") == client_salt("own") != client_salt("other")  # a client keeps its own partitions
    plain = http.post("/v1/completions", json={"prompt": [1]}).json()["body"]
    assert plain == {"prompt": [1]}  # not opted in, no salt: stock request


def test_shown_values_are_cut_to_a_few_hundred_characters():
    huge = "x" * 10_000_000
    assert len(shown(huge)) < 300 and "10000000 characters" in shown(huge)
    assert len(shown(list(range(1_000_000)))) < 300
    assert shown("ok") == "'ok'"


def test_server_directives_never_reach_vllm_from_a_client(monkeypatch):
    """A client's ``kvcomm_server`` (a handle, a forged ticket or purpose, context directives) is
    removed whole on every kind of route before vLLM sees the body; the same keys inside
    ``kvcomm`` are a 400 naming them as kvcomm's own."""
    http = client(monkeypatch, KEYS)
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    reply = http.post("/v1/completions", json=opted_in(handle="request-1"), headers=auth)
    assert reply.status_code == 400 and "kvcomm's own" in reply.json()["error"]["message"]
    forged = {"handle": "h", "ticket": "t", "purpose": "preamble", "retain": ["x"], "release": ["y"]}
    for path, body in (("/v1/completions", {"prompt": [1, 2], "kv_transfer_params": {"kvcomm": {}}}),
                       ("/v1/completions", {"prompt": [1, 2], "kv_transfer_params": {}}),
                       ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "d"}]],
                                                       "kv_transfer_params": {}}),
                       ("/invocations", {"prompt": [1, 2], "kv_transfer_params": {"kvcomm": {}}})):
        body["kv_transfer_params"]["kvcomm_server"] = dict(forged)
        reply = http.post(path, json=body, headers=auth)
        assert reply.status_code == 200, (path, reply.text)
        seen = reply.json()["body"]
        assert "kvcomm_server" not in seen["kv_transfer_params"], (path, seen)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["kv_transfer_params", "cache_salt", "prompt"]), json_values, max_size=3)
       | json_values, key=st.sampled_from([None, "key-one", "bad"]))
def test_rewrite_never_crashes_and_keyed_requests_always_get_the_key_salt(body, key):
    """Any JSON body: either a clear ValueError (kvcomm options the engine would refuse), or a
    body whose salt is the key's when the key is valid and without ``kvcomm_server``; other
    fields are left as they were."""
    original = json.loads(json.dumps(body))
    try:
        out = rewrite(json.loads(json.dumps(body)), key, DIGESTS)
    except ValueError as error:
        assert str(error).startswith("kv_transfer_params"), error
        return
    if not isinstance(body, dict):
        assert out == original
        return
    if key == "key-one":
        assert out["cache_salt"] in (salt_of(tenant_of(key), True), salt_of(tenant_of(key), False))
    elif key is None or key == "bad":
        assert out == original
    assert {k: v for k, v in out.items() if k not in ("cache_salt", "kv_transfer_params")} == \
           {k: v for k, v in original.items() if k not in ("cache_salt", "kv_transfer_params")}
    assert not isinstance(out.get("kv_transfer_params"), dict) or "kvcomm_server" not in out["kv_transfer_params"]


def test_kvcomm_options_of_the_wrong_type_are_a_400_and_a_span_past_the_prompt_goes_to_the_engine(monkeypatch):
    http = client(monkeypatch, KEYS)
    segment = {"start": 0, "end": 2, "slot": "doc"}
    for options, says in (({"segments": [{**segment, "end": 1e308}]}, "segments[0].end must be an integer, got float"),
                          ({"segments": [{**segment, "start": "0"}]}, "segments[0].start must be an integer, got str"),
                          ({"segments": [segment, segment]}, "overlaps"),
                          ({"segments": [{**segment, "slot": "no spaces"}]}, "slot must be a name"),
                          ({"colour": 1}, "unknown keys"), ({"calibrate": "yes"}, "calibrate must be true or false")):
        reply = http.post("/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": {"kvcomm": options}},
                          headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert reply.status_code == 400 and says in reply.json()["error"]["message"], (options, reply.text)
        assert "\n" not in reply.json()["error"]["message"]
    past_the_end = {"segments": [{**segment, "end": 10**6}]}  # the prompt's length is known after tokenization
    assert rewrite({"prompt": "text", "kv_transfer_params": {"kvcomm": past_the_end}}, KEYS[0], DIGESTS)


def test_oversized_kvcomm_options_are_a_400_before_the_engine(monkeypatch):
    http = client(monkeypatch, KEYS)
    for options in ({"template": "t" * 100_000}, {"segments": [{"start": 0, "end": 1, "slot": "a", "id": "i" * 300}]},
                    {"segments": [{"start": 0, "end": 1, "slot": "a"}] * 10_000}):
        reply = http.post("/v1/completions", json={"prompt": [1], "kv_transfer_params": {"kvcomm": options}},
                          headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert reply.status_code == 400 and "at most" in reply.json()["error"]["message"], options
        assert len(reply.text) < 600


def test_with_keys_every_route_but_the_health_probe_needs_one(monkeypatch):
    """vLLM checks keys only under /v1, /v2, /inference and /cohere: /metrics, /invocations,
    /tokenize and any other route answered 200 without a key."""
    for tenant_per_key in (True, False):
        http = client(monkeypatch, KEYS, tenant_per_key)
        good = {"Authorization": f"Bearer {KEYS[1]}"}
        for method, path in (("POST", "/invocations"), ("POST", "/tokenize"), ("GET", "/metrics/"),
                             ("GET", "/version"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions/batch")):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEYS[0]}"}):
                assert http.request(method, path, json={}, headers=headers).status_code == 401, (path, headers)
            assert http.request(method, path, json={}, headers=good).status_code == 200, path
        assert http.get("/health").status_code == 200
    assert client(monkeypatch, ()).get("/metrics/").status_code == 200  # no keys configured: open, as vLLM is


def test_every_method_on_every_route_of_the_app_needs_a_key(monkeypatch):
    """Issue 48: OPTIONS /metrics (and /metrics/, /metrics/x, /metrics?x=1) answered the full
    metrics without a key, since OPTIONS was let through for CORS. Now every method on every
    route of the app's table, and paths it does not have, need a key; a CORS preflight without
    one reaches only vLLM's CORS middleware, never a route."""
    http = client(monkeypatch, KEYS)
    paths = sorted({row.path for row in RouteTable(app_like_vllms()).rows()}
                   | {"/metrics/", "/metrics/x", "/metrics?x=1", "/nowhere"})
    opened = []
    for path in paths:
        for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status = http.request(method, path, headers=headers).status_code
                if status != 401 and path != "/health":
                    opened.append((method, path, headers, status))
            keyed = http.request(method, path, headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code
            assert keyed != 401, (method, path)
        preflight = http.options(path, headers={"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "GET"})
        assert "ok" not in preflight.text, (path, preflight.text)  # answered by CORS, not by the route
    assert opened == []


def test_salted_routes_get_the_tenants_salt_even_when_the_client_sent_none(monkeypatch):
    """Issue 48: /v1/chat/completions/batch was a plain route and got no salt unless the client
    sent one, so tenants shared vLLM's prefix cache through it (a timing channel). A route whose
    body declares cache_salt now always gets the tenant's plain salt, and no kvcomm opt-in."""
    http = client(monkeypatch, KEYS)
    for key in KEYS:
        body = http.post("/v1/chat/completions/batch", json={"messages": [[{"role": "user", "content": "doc"}]]},
                         headers={"Authorization": f"Bearer {key}"}).json()["body"]
        assert body["cache_salt"] == salt_of(tenant_of(key), reuse=False)
        forged = http.post("/v1/chat/completions/batch", json={**opted_in(tenant="victim"), "cache_salt": "x"},
                           headers={"Authorization": f"Bearer {key}"}).json()["body"]
        assert forged["cache_salt"] == salt_of(tenant_of(key), reuse=False) and forged["kv_transfer_params"] == {}
    tokenize_body = http.post("/tokenize", json={"prompt": "doc"}, headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    assert tokenize_body["body"] == {"prompt": "doc"}  # a body that declares no salt gets none


def test_the_route_table_classifies_every_route_from_what_its_handler_declares():
    table = {f"{r.method} {r.path}": r.kind for r in RouteTable(app_like_vllms()).rows()}
    assert table["POST /v1/completions"] == table["POST /v1/messages"] == "generation"
    assert table["POST /invocations"] == "generation"  # a raw body: kvcomm cannot see what it forwards
    assert table["POST /v1/chat/completions/batch"] == "salted" and table["POST /tokenize"] == "plain"
    assert table["GET /v1/models"] == "read-only" and table["GET /health"] == "public" and table["* /metrics"] == "mount"


@pytest.mark.parametrize("where", ["kv_transfer_params", "messages", "tools", "response_format", "top"])
def test_deep_bodies_are_refused_before_the_app_and_the_next_request_is_served(monkeypatch, where):
    """Issue 48: JSON nested ~900 deep inside kv_transfer_params killed vLLM's engine core
    (RecursionError while pickling) and the server exited. Deep bodies, on every route that
    reads one, now get a 400 before vLLM sees them, however deep (no recursion in the check)."""
    http = client(monkeypatch, KEYS)
    auth = {"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    for levels in (MAX_DEPTH + 1, 900, 100_000):
        deep = "[" * levels + "]" * levels
        raw = deep if where == "top" else f'{{"prompt": [1], "{where}": {deep}}}'
        for path in ("/v1/completions", "/invocations", "/v1/chat/completions/batch", "/tokenize", "/nowhere",
                     "/v1/kvcomm/contexts"):
            reply = http.post(path, content=raw, headers=auth)
            assert reply.status_code == 400 and "levels deep" in reply.json()["error"]["message"], (path, levels)
    nested = {"a": [[[1]]]}  # a few levels: served
    ok = {"prompt": [1], where if where != "top" else "x": nested}
    assert http.post("/v1/completions", json=ok, headers=auth).json()["body"][where if where != "top" else "x"] == nested


def test_huge_numbers_and_oversized_bodies_are_refused(monkeypatch):
    http = client(monkeypatch, KEYS)
    auth = {"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    for raw in ('{"prompt": [1180591620717411303424]}', '{"max_tokens": 1e400}', '{"max_tokens": NaN}',
                '{"temperature": -Infinity}', '{"prompt": [' + "9" * 5000 + "]}", '{"n": -9223372036854775809}'):
        reply = http.post("/v1/completions", content=raw, headers=auth)
        assert reply.status_code == 400 and ("number" in reply.text or "integer" in reply.text), raw
    assert http.post("/v1/completions", content='{"n": -9223372036854775808}', headers=auth).status_code == 200
    big = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    assert http.post("/v1/completions", content=big, headers=auth).status_code == 413
    assert http.post("/tokenize", content=b"not json", headers=auth).status_code == 422  # the app's to answer


def test_the_middleware_refuses_to_start_when_vllm_accepts_other_keys(monkeypatch):
    """kvcomm checks the keys `kvcomm serve` read with vLLM's own parser; an app that was given
    other keys (the middleware under a plain `vllm serve`) is refused at start-up."""
    from argparse import Namespace

    monkeypatch.setenv(API_KEY_DIGESTS_ENV, key_digest("a"))
    monkeypatch.setenv(KEY_DIGESTS_ENV, "")
    app = app_like_vllms()
    app.state.args = Namespace(api_key=["b"])
    app.add_middleware(KvcommTenantMiddleware)
    with pytest.raises(KeyMismatch):
        with TestClient(app) as http:
            http.get("/health")
    app = app_like_vllms()
    app.state.args = Namespace(api_key=["a"])
    app.add_middleware(KvcommTenantMiddleware)
    with TestClient(app) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer a"}).status_code == 200
