"""kvcomm serve's tenant middleware on a small Starlette app that echoes what it received
(no model, no vLLM engine)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

starlette = pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from starlette.routing import Mount  # noqa: E402

from kvcomm.integrations.serve.middleware import (  # noqa: E402
    API_KEY_DIGESTS_ENV, GENERATION_PATHS, KEY_DIGESTS_ENV, KvcommTenantMiddleware, client_salt, key_digest, rewrite,
    route_table, salt_of, shown, tenant_of,
)

KEYS = ("key-one", "key-two")
DIGESTS = frozenset(key_digest(k) for k in KEYS)


async def echo(request: Request) -> JSONResponse:
    raw = await request.body()
    assert int(request.headers["content-length"]) == len(raw)
    return JSONResponse({"body": json.loads(raw)})


async def hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def client(monkeypatch, keys: tuple[str, ...], tenant_per_key: bool = True) -> TestClient:
    """An app with vLLM's kinds of routes (generation, other POST, GET, a mounted /metrics, /health)
    behind the middleware, configured as `kvcomm serve` does for ``keys``."""
    digests = ",".join(key_digest(k) for k in keys)
    monkeypatch.setenv(KEY_DIGESTS_ENV, digests if tenant_per_key else "")
    monkeypatch.setenv(API_KEY_DIGESTS_ENV, digests)
    posts = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/invocations", "/generative_scoring", "/other")
    app = Starlette(routes=[*(Route(p, echo, methods=["POST"]) for p in posts),
                            *(Route(p, hello, methods=["GET"]) for p in ("/health", "/version", "/v1/models")),
                            Mount("/metrics", app=Starlette(routes=[Route("/", hello)]))])
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


def test_with_keys_every_route_but_the_health_probe_needs_one(monkeypatch):
    """vLLM checks keys only under /v1, /v2, /inference and /cohere: /metrics, /invocations,
    /generative_scoring and any other route answered 200 without a key."""
    for tenant_per_key in (True, False):
        http = client(monkeypatch, KEYS, tenant_per_key)
        good = {"Authorization": f"Bearer {KEYS[1]}"}
        for method, path in (("POST", "/invocations"), ("POST", "/generative_scoring"), ("GET", "/metrics/"),
                             ("POST", "/other"), ("GET", "/version"), ("POST", "/v1/completions")):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEYS[0]}"}):
                assert http.request(method, path, json={}, headers=headers).status_code == 401, (path, headers)
            assert http.request(method, path, json={}, headers=good).status_code == 200, path
        assert http.get("/health").status_code == 200
    assert client(monkeypatch, ()).get("/metrics/").status_code == 200  # no keys configured: open, as vLLM is


def test_other_post_routes_get_plain_treatment_whatever_the_body_says(monkeypatch):
    """A POST route kvcomm does not know (one vLLM adds tomorrow): no kvcomm opt-in reaches it and
    a client's salt is replaced, with keys by the tenant's plain salt, without by a client salt."""
    forged = {**opted_in(tenant="victim"), "cache_salt": salt_of("victim", reuse=True)}
    keyed = client(monkeypatch, KEYS).post("/other", json=forged, headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["body"]
    assert keyed == {"prompt": [1, 2, 3], "kv_transfer_params": {}, "cache_salt": salt_of(tenant_of(KEYS[0]), reuse=False)}
    keyless = client(monkeypatch, ()).post("/other", json=forged).json()["body"]
    assert keyless == {"prompt": [1, 2, 3], "kv_transfer_params": {}, "cache_salt": client_salt(salt_of("victim", True))}
    assert client(monkeypatch, ()).post("/other", json={"prompt": [1]}).json()["body"] == {"prompt": [1]}


def test_every_generation_route_rewrites_tenant_and_salt(monkeypatch):
    """/v1/messages, /invocations and /generative_scoring carry kv_transfer_params and cache_salt
    as /v1/completions does: a keyed client's forged tenant and salt never pass on any of them."""
    http = client(monkeypatch, KEYS)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/invocations", "/generative_scoring"):
        assert path in GENERATION_PATHS
        forged = {**opted_in(tenant=tenant_of(KEYS[0])), "cache_salt": salt_of(tenant_of(KEYS[0]), True)}
        body = http.post(path, json=forged, headers={"Authorization": f"Bearer {KEYS[1]}"}).json()["body"]
        assert body["kv_transfer_params"]["kvcomm"]["tenant"] == tenant_of(KEYS[1]), path
        assert body["cache_salt"] == salt_of(tenant_of(KEYS[1]), reuse=True), path


def test_the_route_table_classifies_every_route_of_the_app():
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"]), Route("/new/thing", echo, methods=["POST", "PUT"]),
                            Route("/health", hello, methods=["GET"]), Mount("/metrics", app=Starlette())])
    table = route_table(app)
    assert table["POST /v1/completions"] == "generation" and table["POST /new/thing"] == "plain"
    assert table["PUT /new/thing"] == "read-only" and table["GET /health"] == "public" and table["* /metrics"] == "plain"


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


def test_a_handle_over_http_is_refused_with_400(monkeypatch):
    http = client(monkeypatch, KEYS)
    reply = http.post("/v1/completions", json=opted_in(handle="request-1"), headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert reply.status_code == 400 and "in-process callers only" in reply.json()["error"]["message"]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["kv_transfer_params", "cache_salt", "prompt"]), json_values, max_size=3)
       | json_values, key=st.sampled_from([None, "key-one", "bad"]))
def test_rewrite_never_crashes_and_keyed_requests_always_get_the_key_salt(body, key):
    """Any JSON body: either a clear ValueError (a handle), or a body whose salt is the key's
    when the key is valid; other fields are left as they were."""
    original = json.loads(json.dumps(body))
    try:
        out = rewrite(json.loads(json.dumps(body)), key, DIGESTS)
    except ValueError as error:
        assert "handle" in str(error)
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


def test_oversized_kvcomm_options_are_a_400_before_the_engine(monkeypatch):
    http = client(monkeypatch, KEYS)
    for options in ({"template": "t" * 100_000}, {"segments": [{"start": 0, "end": 1, "slot": "a", "id": "i" * 300}]},
                    {"segments": [{"start": 0, "end": 1, "slot": "a"}] * 10_000}):
        reply = http.post("/v1/completions", json={"prompt": [1], "kv_transfer_params": {"kvcomm": options}},
                          headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert reply.status_code == 400 and "at most" in reply.json()["error"]["message"], options
        assert len(reply.text) < 600
