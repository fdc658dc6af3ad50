"""kvcomm's end-to-end TTFT histogram (``serve.ttft``) against a real `kvcomm serve`: a call whose
plan computes a preamble is timed from its arrival, so the preamble's request counts in its TTFT."""

from __future__ import annotations

import asyncio
import re

import pytest

pytestmark = pytest.mark.slow

NOTE = ("The harbour library opens at nine and closes at five on weekdays; on Saturdays it opens at ten. "
        "Its reading room holds forty seats, twelve of them with power outlets, and a quiet corner for children. "
        "The council plans to add a second floor for local history archives within two years. ") * 2
AGENTS = ("You answer questions about libraries in one sentence.",
          "You are a careful reviewer. Name one thing the text leaves unclear.",
          "You are an editor who shortens texts for a newsletter.")
KVCOMM = "kvcomm_time_to_first_token_seconds"
VLLM = "vllm:time_to_first_token_seconds"


def histogram(server, name: str, **labels: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on /metrics, over the series whose labels include ``labels``."""
    status, text = server.request("GET", "/metrics", key=server.keys[0] if server.keys else None)
    assert status == 200
    totals = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        match = re.match(r'^(\S+?)_(sum|count)(?:\{([^}]*)\})? ([0-9.e+-]+)$', line)
        if not match or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            totals[match.group(2)] += float(match.group(4))
    return totals["sum"], totals["count"]


def observed(server, call) -> tuple[float, float]:
    """Run ``call()``; returns (kvcomm's TTFT of it, the sum of the TTFTs vLLM recorded meanwhile)
    and checks that kvcomm observed exactly one request and vLLM two (the preamble's and the call's)."""
    kvcomm_before = histogram(server, KVCOMM, route="/v1/completions", kvcomm="yes")
    vllm_before = histogram(server, VLLM)
    call()
    kvcomm_after = histogram(server, KVCOMM, route="/v1/completions", kvcomm="yes")
    vllm_after = histogram(server, VLLM)
    assert kvcomm_after[1] - kvcomm_before[1] == 1
    assert vllm_after[1] - vllm_before[1] == 2, "vLLM saw no preamble request: the call computed no preamble"
    return kvcomm_after[0] - kvcomm_before[0], vllm_after[0] - vllm_before[0]


def test_kvcomm_ttft_of_a_call_with_a_preamble_includes_the_preamble(kvcomm_server, fresh_key):
    """Agent 0 reads the note first (its base is taken); agents 1 and 2, with system messages of
    their own, compute them as preambles (a request of their own, before the call's) and are served
    the note after them. vLLM's histogram records the preamble request and the call apart, each from
    its own arrival at vLLM's engine; kvcomm's records one TTFT per call, from its arrival at the
    server: it covers both, so it is at least their sum. Streamed (first token as sent) and
    whole (the response less vLLM's decode interval)."""
    from kvcomm.integrations.local.segments import ChatTurn
    from kvcomm.integrations.remote.backend import RemoteChatBackend

    backend = RemoteChatBackend(kvcomm_server.base_url, api_key=fresh_key(), max_new_tokens=6)

    def turns(agent: int) -> list[ChatTurn]:
        return [ChatTurn("system", AGENTS[agent]), ChatTurn("user", NOTE, "user"),
                ChatTurn("user", "When does the library open on Saturdays?", "user")]

    backend.complete(turns(0))
    assert backend.last.provenance.preamble_tokens == 0

    streamed, vllm_sum = observed(kvcomm_server, lambda: asyncio.run(backend.acomplete(turns(1), on_text=lambda _: None)))
    print(f"\nstreamed: kvcomm TTFT {streamed:.3f} s, vLLM's preamble + call TTFT {vllm_sum:.3f} s, "
          f"client {backend.last.provenance.ttft_s:.3f} s")
    assert streamed >= vllm_sum > 0
    assert streamed <= backend.last.provenance.ttft_s  # the client's first token came after the server sent it

    whole, vllm_sum = observed(kvcomm_server, lambda: backend.complete(turns(2)))
    call = backend.last
    print(f"whole: kvcomm TTFT {whole:.3f} s, vLLM's preamble + call TTFT {vllm_sum:.3f} s, client {call.provenance.ttft_s:.3f} s")
    assert call.provenance.preamble_tokens > 0 and call.provenance.estimated_tokens > 0, call.reason
    # the response's time less the decode interval: vLLM times the interval from its first to
    # its last token in the engine, its TTFT up to the first token's output in the API server;
    # the two differ by how long outputs wait for the API server, milliseconds
    assert whole >= vllm_sum - 0.03 and vllm_sum > 0
    assert whole <= call.provenance.ttft_s + 0.05
