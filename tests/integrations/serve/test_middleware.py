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

from kvcomm.integrations.serve.middleware import (  # noqa: E402
    KEY_DIGESTS_ENV, KvcommTenantMiddleware, key_digest, rewrite, salt_of, tenant_of,
)

KEYS = ("key-one", "key-two")
DIGESTS = frozenset(key_digest(k) for k in KEYS)


async def echo(request: Request) -> JSONResponse:
    raw = await request.body()
    assert int(request.headers["content-length"]) == len(raw)
    return JSONResponse({"body": json.loads(raw)})


def client(monkeypatch, keys: tuple[str, ...]) -> TestClient:
    monkeypatch.setenv(KEY_DIGESTS_ENV, ",".join(key_digest(k) for k in keys))
    app = Starlette(routes=[Route(p, echo, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions", "/other")])
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


def test_unknown_keys_other_paths_and_non_json_pass_unchanged(monkeypatch):
    http = client(monkeypatch, KEYS)
    body = opted_in(tenant="t")
    assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).json()["body"] == body
    assert http.post("/v1/completions", json=body).json()["body"] == body
    assert http.post("/other", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["body"] == body


def test_without_keys_opted_in_requests_get_their_tenants_salt(monkeypatch):
    http = client(monkeypatch, ())
    body = http.post("/v1/completions", json=opted_in(tenant="team-a")).json()["body"]
    assert body["cache_salt"] == salt_of("team-a", reuse=True)
    kept = http.post("/v1/completions", json={**opted_in(), "cache_salt": "own"}).json()["body"]
    assert kept["cache_salt"] == "own"
    plain = http.post("/v1/completions", json={"prompt": [1]}).json()["body"]
    assert plain == {"prompt": [1]}  # not opted in: stock request


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
