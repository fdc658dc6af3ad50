"""Retained contexts through a real `kvcomm serve` (``serve.contexts``): agent A's reply kept as
a context, agents B and C naming it, release and TTL expiry falling back to text, tenant
isolation (404), the byte cap, and bad input. One server for the module, one API key (tenant)
per role so no test sees another's state."""

from __future__ import annotations

import time

import pytest

from kvcomm.integrations.local.segments import ChatTurn
from kvcomm.integrations.remote import wire

from .test_http import metrics

pytestmark = pytest.mark.slow

KEYS = ("kvcomm-test-ctx-a", "kvcomm-test-ctx-b", "kvcomm-test-ctx-twin", "kvcomm-test-ctx-cap", "kvcomm-test-ctx-ttl",
        "kvcomm-test-ctx-bad")
A, B, TWIN, CAP, TTL, BAD = KEYS
MIB = 1 << 20
TENANT_CAP = 24 * MIB
# SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 channels x (K and V) x 4 bytes per token
BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4
WRITER = "You answer briefly."
READERS = {"reviewer": "You review the answer in one sentence.", "editor": "You shorten the answer to five words."}
CONTEXTS = "/v1/kvcomm/contexts"
# Greedy SmolLM2 answers each within 12 tokens, ending with its stop token (tests/integrations/remote/test_clients.py)
TASKS = ["Name a fruit.", "Name a capital city in Europe.", "Name a color."]


@pytest.fixture(scope="module")
def ctx_server(tmp_path_factory):
    from support.serve_client import start_server

    server = start_server(tmp_path_factory.mktemp("kvcomm-serve-contexts") / "server.log", KEYS,
                          "--max-tenant-bytes", str(TENANT_CAP))
    try:
        yield server
    finally:
        server.stop()


def _backend(server, key):
    from kvcomm.integrations.remote.backend import RemoteChatBackend

    return RemoteChatBackend(server.base_url, api_key=key, max_new_tokens=12)


def _reader_turns(system: str, text: str, question: str) -> list[ChatTurn]:
    return [ChatTurn("system", system), ChatTurn("user", text, "writer"), ChatTurn("user", question, "user")]


def _warm(backend, system: str) -> None:
    """An agent's first call: its system message becomes a known template lead, so later calls
    can reuse what follows it (a new agent's first call stops at its new system message)."""
    backend.complete([ChatTurn("system", system), ChatTurn("user", "Say hello.", "user")], agent="warm-up")


def _count(server, name: str) -> float:
    return metrics(server).get(name, 0.0)


def _uses(server, outcome: str) -> float:
    return _count(server, f'kvcomm_context_uses_total{{outcome="{outcome}"}}')


def test_a_reply_retained_as_context_is_read_from_stored_kv_and_falls_back_after_release(ctx_server):
    runs = {}
    for key, names in ((A, True), (TWIN, False)):  # the twin tenant sends the same text without naming it
        agent_a = _backend(ctx_server, key)
        readers = {name: _backend(ctx_server, key) for name in READERS}  # separate client objects, agents B and C
        for name, backend in readers.items():
            _warm(backend, READERS[name])
        outcomes = []
        for task in TASKS:  # a pipeline's rounds: each reply retained, then read by B and C
            reply = agent_a.complete([ChatTurn("system", WRITER), ChatTurn("user", task, "user")], agent="writer")
            handle = agent_a.retain(reply)  # the finished request's reply, by its token ids
            hits_before = _uses(ctx_server, "hit")
            calls = {}
            for name, backend in readers.items():
                turns = _reader_turns(READERS[name], reply.text, "Is that right?")
                calls[name] = backend.complete(turns, agent=name, context_ids=[handle.context_id] if names else ())
            outcomes.append([c.call.contexts.get(handle.context_id) for c in calls.values()])
        runs[key] = (agent_a, reply, handle, readers, calls, hits_before, outcomes)
    # Under the estimate-or-realign rule a slot with no anchors serves its realigned base, so the
    # context is read from stored KV from its first round on.
    assert runs[A][-1] == [["hit", "hit"]] * len(TASKS), runs[A][3]["reviewer"].last
    assert runs[TWIN][-1] == [[None, None]] * len(TASKS)

    agent_a, reply, handle, readers, calls, hits_before, _ = runs[A]
    record = agent_a.context(handle)
    assert record["state"] == "retained" and record["expires_at"] is None and record["adapter"] is None
    assert record["tokens"] == handle.token_count == len(agent_a.encode(reply.text))
    assert record["bytes"] == record["tokens"] * BYTES_PER_TOKEN
    assert record["model_fingerprint"].startswith("sha256:") and record["model"] == agent_a.model_name
    for name, reply_call in calls.items():
        call = reply_call.call
        assert call.contexts == {handle.context_id: "hit"}, (name, call.contexts, call.provenance.note)
        # the context's tokens are served from stored KV: the plan reused past the message
        assert call.slots["writer#0"] == (record["tokens"], record["tokens"]), call.slots
        twin = runs[TWIN][4][name]
        assert reply_call.reply_ids == twin.reply_ids, "naming the context changed the reply"
        assert (call.provenance.exact_tokens, call.provenance.estimated_tokens) == (
            twin.call.provenance.exact_tokens, twin.call.provenance.estimated_tokens)
    assert _uses(ctx_server, "hit") - hits_before == len(READERS)
    assert agent_a.context(handle)["uses"]["hit"] == len(READERS)

    # vLLM's own count, through the raw wire (a third kind of client): the context's tokens are cached
    reader = readers["reviewer"]
    chat = reader.render(_reader_turns(READERS["reviewer"], reply.text, "Is that right? Say why."))
    body = wire.completion_body(reader.model_name, chat, 4, reuse=True,
                                contexts={record["content_id"]: handle.context_id})
    response = ctx_server.complete(body.pop("prompt"), A, 4, body["kv_transfer_params"]["kvcomm"],
                                   cache_salt=body["cache_salt"])
    served = response["kv_transfer_params"]["kvcomm"]
    start = next(s["start"] for s in body["kv_transfer_params"]["kvcomm"]["segments"] if s["slot"] == "writer.0")
    assert served["contexts"][handle.context_id] == {"outcome": "hit", "state": "retained", "reason": None,
                                                      "reused_tokens": record["tokens"]}
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] >= start + record["tokens"]

    # release: the same requests fall back to the text, succeed and say so
    fallbacks_before = _uses(ctx_server, "fallback")
    assert agent_a.release(handle) is True
    assert agent_a.release(handle) is False  # released already: nothing changes
    record = agent_a.context(handle)
    assert record["state"] == "evicted" and record["evicted_reason"] == "released"
    agains = {}
    for name, backend in readers.items():
        again = backend.complete(_reader_turns(READERS[name], reply.text, "Is that right?"), agent=name,
                                 context_ids=[handle.context_id])
        assert again.call.contexts == {handle.context_id: "fallback"} and again.call.finish_reason in ("stop", "length")
        agains[name] = again.call
    # the engine dropped the base: the first reader after the release computes the text (no
    # anchor holds it: its hits were estimated, and estimates are not learned from); its
    # prefill makes it a base again, which the next reader may reuse by content
    assert agains["reviewer"].slots["writer#0"] == (0, record["tokens"]), agains["reviewer"].provenance.note
    assert _uses(ctx_server, "fallback") - fallbacks_before == len(READERS)


def test_a_context_expires_after_its_ttl_and_requests_fall_back(ctx_server):
    backend = _backend(ctx_server, TTL)
    _warm(backend, READERS["editor"])
    handle = backend.retain("The bridge opens at nine and closes at five.", ttl_s=3)
    record = backend.context(handle)
    assert record["state"] == "retained" and record["expires_at"] - record["created_at"] == pytest.approx(3)
    turns = _reader_turns(READERS["editor"], "The bridge opens at nine and closes at five.", "When?")
    # retained: read from stored KV at its first use (a slot with no anchors serves the realigned base)
    assert backend.complete(turns, context_ids=[handle.context_id]).call.contexts == {handle.context_id: "hit"}
    expired_before = _count(ctx_server, 'kvcomm_context_evictions_total{reason="expired"}')
    time.sleep(4)
    # the timer expired it with no request in between
    assert _count(ctx_server, 'kvcomm_context_evictions_total{reason="expired"}') - expired_before == 1
    record = backend.context(handle)
    assert record["state"] == "evicted" and record["evicted_reason"] == "expired"
    fallback = backend.complete(turns, context_ids=[handle.context_id])
    assert fallback.call.contexts == {handle.context_id: "fallback"} and fallback.text


def test_another_tenant_gets_404_for_a_context_id(ctx_server):
    owner, other = _backend(ctx_server, A), _backend(ctx_server, B)
    handle = owner.retain("Only tenant A may read this note.")
    context_id = handle.context_id
    for method, path in (("GET", f"{CONTEXTS}/{context_id}"), ("POST", f"{CONTEXTS}/{context_id}/retain"),
                         ("POST", f"{CONTEXTS}/{context_id}/release")):
        status, answer = ctx_server.request(method, path, {} if method == "POST" else None, key=B)
        assert status == 404, (method, path, status, answer)
        assert "tenant" not in str(answer).replace("per tenant", "")  # says nothing about whose it is
    status, listed = ctx_server.request("GET", CONTEXTS, key=B)
    assert status == 200 and context_id not in str(listed)
    chat = other.render(_reader_turns(READERS["reviewer"], "Only tenant A may read this note.", "Why?"))
    content = chat.prompt.segments[chat.turn_segments[1]].shared_id
    body = wire.completion_body(other.model_name, chat, 2, reuse=True, contexts={content: context_id})
    status, answer = ctx_server.request("POST", "/v1/completions", body, key=B)
    assert status == 404, answer
    assert other.release(handle) is False
    assert owner.context(handle)["state"] == "retained"  # untouched by the other tenant


def test_a_retain_over_the_tenant_cap_is_refused_and_changes_nothing(ctx_server):
    backend = _backend(ctx_server, CAP)
    small = backend.retain("A short note to keep.")
    refused_before = _count(ctx_server, 'kvcomm_context_retains_total{outcome="refused"}')
    big = " apple" * 600  # 600 tokens, 26.4 MiB of KV: over the 24 MiB cap (and within max_model_len)
    assert len(backend.encode(big)) * BYTES_PER_TOKEN > TENANT_CAP
    status, answer = ctx_server.request("POST", CONTEXTS, {"text": big}, key=CAP)
    assert status == 409 and "over the cap of 25165824 bytes" in answer["error"]["message"], answer
    assert _count(ctx_server, 'kvcomm_context_retains_total{outcome="refused"}') - refused_before == 1
    status, listed = ctx_server.request("GET", CONTEXTS, key=CAP)
    assert [(c["id"], c["state"]) for c in listed["data"]] == [(small.context_id, "retained")]
    # a released context that would not fit again is refused the same way, and stays released
    status, answer = ctx_server.request("POST", CONTEXTS, {"text": big[: len(big) // 2]}, key=CAP)
    assert status == 200, answer
    half = answer["id"]
    assert ctx_server.request("POST", f"{CONTEXTS}/{half}/release", {}, key=CAP)[1]["released"] is True
    status, answer = ctx_server.request("POST", CONTEXTS, {"text": big[len(big) // 2:] + " more"}, key=CAP)
    assert status == 200, answer
    status, answer = ctx_server.request("POST", f"{CONTEXTS}/{half}/retain", {}, key=CAP)
    assert status == 409, answer
    assert ctx_server.request("GET", f"{CONTEXTS}/{half}", key=CAP)[1]["state"] == "evicted"
    _warm(backend, READERS["reviewer"])
    turns = _reader_turns(READERS["reviewer"], "A short note to keep.", "Why?")
    # the retained context still serves (read from stored KV) after the refusals
    assert backend.complete(turns, context_ids=[small.context_id]).call.contexts == {small.context_id: "hit"}


def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(ctx_server):
    backend = _backend(ctx_server, BAD)
    handle = backend.retain("Some shared text.")
    for body, status, words in (
        ({"text": "x", "ttl_s": -1}, 400, "ttl_s"), ({"text": ""}, 400, "non-empty"),
        ({"text": "x", "token_ids": [1]}, 400, "exactly one"), ({"txt": "x"}, 400, "unknown fields"),
        ({"token_ids": [1, "a"]}, 400, "token_ids"), ({"text": "x", "model": "gpt-4"}, 400, "base model"),
    ):
        got, answer = ctx_server.request("POST", CONTEXTS, body, key=BAD)
        assert got == status and words in answer["error"]["message"], (body, got, answer)
    assert ctx_server.request("POST", f"{CONTEXTS}/{handle.context_id}/forget", {}, key=BAD)[0] == 404
    chat = backend.render(_reader_turns(READERS["reviewer"], "Other text than the context's.", "Why?"))
    content = chat.prompt.segments[chat.turn_segments[1]].shared_id
    body = wire.completion_body(backend.model_name, chat, 2, reuse=True, contexts={content: handle.context_id})
    got, answer = ctx_server.request("POST", "/v1/completions", body, key=BAD)
    assert got == 400 and "does not hold its" in answer["error"]["message"], answer
    plain = {"model": backend.model_name, "prompt": list(range(5, 12)), "max_tokens": 1}
    got, answer = ctx_server.request("POST", "/v1/completions", {
        **plain, "kv_transfer_params": {"kvcomm": {"contexts": {"release": [content]}}}}, key=BAD)
    assert got == 400 and "kvcomm's own" in answer["error"]["message"], answer
    got, answer = ctx_server.request("POST", "/v1/completions", {  # a forged directive is removed, not obeyed
        **plain, "kv_transfer_params": {"kvcomm": {}, "kvcomm_server": {"release": [content], "purpose": "preamble"}}}, key=BAD)
    assert got == 200 and "error" not in (answer["kv_transfer_params"] or {}).get("kvcomm", {}), answer
    assert backend.context(handle)["state"] == "retained"
    assert backend.complete([ChatTurn("user", "Still there?", "user")]).text is not None
    # The context counters and vLLM's request counters share this process's counter file: both
    # written after the 4xx above (new label values), /metrics still reads it whole.
    status, text = ctx_server.request("GET", "/metrics", key=ctx_server.keys[0])
    assert status == 200 and 'kvcomm_context_retains_total{outcome="retained"}' in text, str(text)[:300]
    assert 'http_requests_total{handler="/v1/completions"' in text
