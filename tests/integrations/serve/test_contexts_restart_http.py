"""Retained contexts across a `kvcomm serve --state-dir` restart: by design they come back
``evicted`` (reason ``restart``), requests naming them fall back to their text, and a retain
pins them again (docs/serving.md, "Retained contexts"). Keyless: the body names the tenant."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CONTEXTS = "/v1/kvcomm/contexts"
TEXT = "The meeting moved to Thursday at ten."


def _named(server, record: dict, tenant: str) -> dict:
    """A completion whose prompt is the context's tokens and a question, naming the context."""
    status, tokens = server.request("POST", "/tokenize", {"model": server.model, "prompt": TEXT, "add_special_tokens": False})
    assert status == 200
    ids = tokens["tokens"]
    _, question = server.request("POST", "/tokenize", {"model": server.model, "prompt": " When?", "add_special_tokens": False})
    kvcomm = {"tenant": tenant, "segments": [{"start": 0, "end": len(ids), "slot": "note", "context": record["id"]}]}
    return server.complete(ids + question["tokens"], "", 2, kvcomm)["kv_transfer_params"]["kvcomm"]["contexts"][record["id"]]


def test_contexts_come_back_evicted_after_a_restart_and_fall_back_to_text(tmp_path):
    from support.serve_client import start_server

    state = tmp_path / "state"
    server = start_server(tmp_path / "first.log", (), "--state-dir", str(state))
    try:
        status, record = server.request("POST", CONTEXTS, {"text": TEXT, "tenant": "team-1"})
        assert status == 200 and record["state"] == "retained", record
        assert _named(server, record, "team-1")["outcome"] != "fallback"
    finally:
        assert server.stop() == 0
    server = start_server(tmp_path / "second.log", (), "--state-dir", str(state))
    try:
        status, again = server.request("GET", f"{CONTEXTS}/{record['id']}?tenant=team-1")
        assert status == 200 and (again["state"], again["evicted_reason"]) == ("evicted", "restart"), again
        assert again["tokens"] == record["tokens"] and again["bytes"] == record["bytes"]
        assert server.request("GET", f"{CONTEXTS}/{record['id']}")[0] == 404  # tenant "default" has no such id
        named = _named(server, record, "team-1")
        assert (named["outcome"], named["state"], named["reason"]) == ("fallback", "evicted", "restart"), named
        status, pinned = server.request("POST", f"{CONTEXTS}/{record['id']}/retain", {"tenant": "team-1"})
        assert status == 200 and (pinned["state"], pinned["evicted_reason"]) == ("retained", None), pinned
        assert _named(server, record, "team-1")["outcome"] != "fallback"
    finally:
        server.stop()
