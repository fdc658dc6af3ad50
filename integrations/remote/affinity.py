"""Team affinity behind a router: the session key the remote clients send, and their one retry.

Several ``kvcomm serve`` replicas behind ``vllm-router`` (``--policy consistent_hash``) keep a
team's reuse only if every call of the team lands on one replica: kvcomm's stored KV, anchor
pools and retained contexts live in one server process. The router hashes the first of the
headers ``X-Session-ID``, ``X-User-ID``, ``X-Tenant-ID`` a request carries onto its ring of
healthy replicas; the remote clients send ``X-Session-ID`` on every request (completions, the
context API, the tokenizer check), so the same key always reaches the same live replica.

The key names what should share a replica: reuse never crosses tenants (each has its own
engine on each replica), so by default the key is derived from the tenant (``default_session``:
a digest of the API key when there is one, else of the tenant name; the key itself never
travels in a header). Teams of one tenant that should spread over replicas each pass a key of
their own (a team or workflow-run id): at most 200 printable ASCII characters.

Retry: a call whose connection failed is sent once more, with the same session key, after
``RETRY_DELAY_S`` (time for the router's health check to take a dead replica out: run it with
``--health-check-interval-secs 1 --health-failure-threshold 1``, as ``serve.replicas`` does);
the second failure is the caller's error. A connection failed: the client's own (connect, read,
write; the connection dropped), or a router's answer that it could not reach the replica it
chose: 502, 503, 504, or ``vllm-router``'s 500 ``Request failed: error sending request for url``
(0.1.17 answers so once its own retries to the dead replica are spent).
"""

from __future__ import annotations

import hashlib

import httpx

SESSION_HEADER = "X-Session-ID"
"""The header ``vllm-router``'s ``consistent_hash`` policy reads first."""
MAX_SESSION = 200
RETRYABLE_STATUS = frozenset({502, 503, 504})
"""What a router (or a proxy) answers when it could not reach the replica it chose."""
ROUTER_CONNECTION_ERROR = "error sending request for url"
"""In the body of ``vllm-router``'s 500 for a replica it could not reach."""
RETRY_DELAY_S = 2.0


def default_session(tenant: str, api_key: str | None) -> str:
    """The session key of a client that names none: one per tenant (``kvcomm-`` + 16 hex
    digits of sha256 over the API key, or over the tenant name when there is no key)."""
    basis = f"key:{api_key}" if api_key else f"tenant:{tenant}"
    return "kvcomm-" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def check_session(session: str) -> str:
    """``session`` if it can travel as a header value; ``ValueError`` saying why not."""
    if not isinstance(session, str) or not session:
        raise ValueError(f"session must be a non-empty string (got {session!r})")
    if len(session) > MAX_SESSION or not all(" " <= c <= "~" for c in session):
        raise ValueError(f"session must be at most {MAX_SESSION} printable ASCII characters (got {session[:60]!r})")
    return session


def retryable(error: BaseException | None = None, status: int | None = None, body: str = "") -> bool:
    """Whether a failed call is sent once more: a transport error (connect, read or write
    failed, the connection dropped; a connect timeout), a gateway's 502 / 503 / 504, or a 500
    whose ``body`` is ``vllm-router``'s connection error. Read, write and pool timeouts are not
    retried: the replica may still be computing the call."""
    if error is not None:
        return isinstance(error, httpx.TransportError) and not isinstance(
            error, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout))
    return status in RETRYABLE_STATUS or (status == 500 and ROUTER_CONNECTION_ERROR in body[:500])
