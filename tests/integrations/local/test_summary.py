"""The chat clients' times: each call's TTFT runs from the start of the call to its first reply
token, a preamble included; ``summary()`` sums TTFT and wall time per agent and in all,
and against a baseline client."""

from __future__ import annotations

import time

import pytest

from kvcomm.integrations.local.backend import ChatBackend, ChatCall
from kvcomm.integrations.local.segments import ChatTurn
from kvcomm.integrations.local.summary import summarize
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.plan import Provenance

DOC = "The river Seine flows through Paris and into the English Channel. " * 8
HEAD_DELAY_S = 0.3


def _call(agent, ttft, wall, exact=0, estimated=0, prompt=100, fallback=False, plan=None):
    p = Provenance(prompt, exact, estimated, prompt - exact - estimated, 50, exact + estimated, fallback, "", ttft,
                   plan_s=plan)
    return ChatCall("t", agent, p, 8, "stop", False, wall)


def test_summary_sums_ttft_and_wall_time_per_agent_and_in_all():
    calls = [_call("a", 0.5, 1.0, exact=40, plan=0.01), _call("b", 0.2, 0.9, exact=60, estimated=30, fallback=False),
             _call("a", 0.3, 0.8, exact=90, fallback=True), _call("b", None, 0.5)]
    s = summarize(calls)
    assert s["ttft_s"] == pytest.approx(1.0) and s["ttft_unknown"] == 1 and s["wall_s"] == pytest.approx(3.2)
    assert s["plan_s"] == pytest.approx(0.01)
    assert s["calls_reusing_nothing"] == 1 and s["calls_estimating_nothing"] == 1  # the second "a" call reused 90 tokens
    assert list(s["agents"]) == ["a", "b"]
    a, b = s["agents"]["a"], s["agents"]["b"]
    assert (a["calls"], a["ttft_s"], a["wall_s"]) == (2, pytest.approx(0.8), pytest.approx(1.8))
    assert (b["calls"], b["ttft_s"], b["wall_s"], b["ttft_unknown"]) == (2, pytest.approx(0.2), pytest.approx(1.4), 1)
    assert a["prompt_tokens"] == 200 and a["exact_tokens"] == 130 and a["token_reuse_rate"] == pytest.approx(0.65)


def test_summary_against_a_baseline():
    mine = [_call("a", 0.5, 1.0), _call("b", 0.25, 0.5)]
    dense = [_call("a", 1.0, 1.5), _call("b", 1.0, 1.5)]
    s = summarize(mine, baseline=summarize(dense))
    assert s["baseline"]["ttft_speedup"] == pytest.approx(2.0 / 0.75) and s["baseline"]["wall_speedup"] == pytest.approx(2.0)
    assert s["agents"]["b"]["baseline"]["ttft_speedup"] == pytest.approx(4.0)

    class Client:  # anything with summary(): a client or a backend
        def summary(self):
            return summarize(dense)

    assert summarize(mine, baseline=Client())["baseline"] == s["baseline"]
    assert summarize([], baseline=summarize(dense))["baseline"]["ttft_speedup"] is None


def test_ttft_counts_a_preamble_and_the_summary_adds_up(tiny_executor, monkeypatch):
    """The second agent's call computes its new system prompt (the preamble) before the shared
    document is served: its TTFT must include that, here slowed by HEAD_DELAY_S."""
    backend = ChatBackend(tiny_executor, ReuseEngine(tiny_executor.rotary), max_new_tokens=3)
    backend.complete([ChatTurn("system", "You summarize."), ChatTurn("user", DOC, "user")], agent="summarizer")
    real = tiny_executor._preamble

    def slow_preamble(*args, **kwargs):
        time.sleep(HEAD_DELAY_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_executor, "_preamble", slow_preamble)
    started = time.perf_counter()
    reply = backend.complete([ChatTurn("system", "You criticize designs sharply."), ChatTurn("user", DOC, "user")],
                             agent="critic")
    elapsed = time.perf_counter() - started
    p = reply.call.provenance
    assert p.preamble_tokens > 0 and p.estimated_tokens > 0, p.reason
    assert HEAD_DELAY_S <= p.ttft_s <= reply.call.latency_s <= elapsed
    assert 0 <= p.plan_s <= p.ttft_s
    assert f"{p.preamble_tokens} new text before the reused content" in reply.call.reason
    s = backend.summary()
    assert s["wall_s"] == pytest.approx(sum(c.latency_s for c in backend.calls))
    assert s["agents"]["critic"]["ttft_s"] == pytest.approx(p.ttft_s)
