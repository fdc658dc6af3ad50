"""The remote clients' session key and their one retry (``remote.affinity``): what is sent, and which failures are retried."""

from __future__ import annotations

import httpx
import pytest

from kvcomm.integrations.remote import affinity


def test_the_default_session_key_is_one_per_tenant_and_never_shows_the_api_key():
    by_key = affinity.default_session("default", "secret-key-a")
    assert by_key == affinity.default_session("other-tenant", "secret-key-a")  # the key decides the tenant
    assert by_key != affinity.default_session("default", "secret-key-b")
    assert "secret" not in by_key and by_key.startswith("kvcomm-") and len(by_key) == 23
    assert affinity.default_session("team-a", None) != affinity.default_session("team-b", None)
    assert affinity.default_session("team-a", None) == affinity.default_session("team-a", None)


@pytest.mark.parametrize("bad", ["", "é-team", "a\nb", "x" * 201, None])
def test_a_session_key_that_cannot_travel_as_a_header_is_refused(bad):
    with pytest.raises(ValueError, match="session must be"):
        affinity.check_session(bad)


def test_connection_failures_are_retried_and_nothing_else():
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
    assert affinity.retryable(httpx.ConnectError("refused", request=request))
    assert affinity.retryable(httpx.RemoteProtocolError("dropped", request=request))
    assert affinity.retryable(httpx.ConnectTimeout("slow", request=request))
    assert not affinity.retryable(httpx.ReadTimeout("computing", request=request))
    for status in (502, 503, 504):
        assert affinity.retryable(status=status)
    assert affinity.retryable(status=500, body="Request failed: error sending request for url (http://127.0.0.1:9/v1/completions)")
    for status, body in ((500, '{"error": "engine failed"}'), (400, ""), (404, ""), (401, ""), (200, "")):
        assert not affinity.retryable(status=status, body=body)


def test_the_backend_sends_the_session_key_and_retries_a_refused_connection_once(smol_tokenizer):
    """Against a port nothing listens on: the construction's first request is sent twice, then fails."""
    from kvcomm.integrations.remote.backend import RemoteChatBackend, RemoteError

    sent = []

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request):
            sent.append(dict(request.headers))
            return super().handle_request(request)

    original = httpx.Client.__init__

    def client(self, *args, **kwargs):
        original(self, *args, transport=Counting(), **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(affinity, "RETRY_DELAY_S", 0.0)
        patch.setattr(httpx.Client, "__init__", client)
        with pytest.raises(RemoteError, match="cannot reach"):
            RemoteChatBackend("http://127.0.0.1:9", tokenizer=smol_tokenizer, session="team-7")
    assert len(sent) == 2 and all(h["x-session-id"] == "team-7" for h in sent)
