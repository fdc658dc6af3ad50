"""``serve.ttft.FirstToken``: where a response's first token is, on the ASGI messages vLLM's
routes send (a real ``prometheus_client`` histogram; the HTTP test is test_ttft_http.py)."""

from __future__ import annotations

import asyncio
import json
import time

from prometheus_client import REGISTRY

from kvcomm.integrations.serve import ttft


def _sent(messages: list[dict], arrived: float, opted_in: bool = True, route: str = "/v1/completions") -> ttft.FirstToken:
    out: list[dict] = []

    async def sink(message):
        out.append(message)

    watch = ttft.FirstToken(sink, arrived, route, opted_in)

    async def run():
        for message in messages:
            await watch(message)

    asyncio.run(run())
    assert out == messages  # passed on unchanged
    return watch


def _start(status: int = 200, content_type: bytes = b"application/json") -> dict:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _count(route: str, kvcomm: str) -> tuple[float, float]:
    """(sum, count) of the histogram's series, as Prometheus reads them."""
    labels = {"route": route, "kvcomm": kvcomm}
    return tuple(REGISTRY.get_sample_value(f"kvcomm_time_to_first_token_seconds_{part}", labels) or 0.0
                 for part in ("sum", "count"))


def test_a_stream_is_timed_to_its_first_event_with_a_token_even_split_across_chunks():
    role_only = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    first = _event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    stream = _start(content_type=b"text/event-stream; charset=utf-8")
    arrived = time.perf_counter() - 2.0
    before = _count("/v1/chat/completions", "no")
    watch = _sent([stream, {"type": "http.response.body", "body": role_only, "more_body": True},
                   {"type": "http.response.body", "body": first[:10], "more_body": True},
                   {"type": "http.response.body", "body": first[10:] + b"data: [DONE]\n\n", "more_body": True},
                   {"type": "http.response.body", "body": b"", "more_body": False}], arrived, False, "/v1/chat/completions")
    assert watch.seconds is not None and 2.0 <= watch.seconds < 3.0
    after = _count("/v1/chat/completions", "no")
    assert after[1] - before[1] == 1 and abs(after[0] - before[0] - watch.seconds) < 1e-9

    completions = _event({"choices": [{"index": 0, "text": "", "token_ids": [42]}]})
    watch = _sent([_start(content_type=b"text/event-stream"), {"type": "http.response.body", "body": completions,
                                                                 "more_body": False}], time.perf_counter())
    assert watch.seconds is not None


def test_a_whole_response_is_timed_to_its_end_less_the_decode_interval():
    body = json.dumps({"choices": [{"text": "Hello there"}], "metrics": {"generation_time_ms": 1500.0}}).encode()
    arrived = time.perf_counter() - 4.0
    watch = _sent([_start(), {"type": "http.response.body", "body": body[:7], "more_body": True},
                   {"type": "http.response.body", "body": body[7:], "more_body": False}], arrived)
    assert watch.seconds is not None and 2.5 <= watch.seconds < 3.5


def test_responses_without_a_first_token_or_decode_interval_are_not_observed():
    before = _count("/v1/completions", "yes")
    no_metrics = json.dumps({"choices": [{"text": "Hi"}]}).encode()  # --disable-log-stats: no per-request metrics
    error = json.dumps({"error": {"message": "bad"}, "metrics": {"generation_time_ms": 1.0}}).encode()
    for messages in ([_start(), {"type": "http.response.body", "body": no_metrics, "more_body": False}],
                     [_start(400), {"type": "http.response.body", "body": error, "more_body": False}],
                     [_start(content_type=b"text/event-stream"),
                      {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}]):
        assert _sent(messages, time.perf_counter()).seconds is None
    assert _count("/v1/completions", "yes") == before
