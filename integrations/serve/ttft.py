"""kvcomm's end-to-end TTFT histogram of `kvcomm serve`: from a request's arrival to its first token.

vLLM's own ``vllm:time_to_first_token_seconds`` runs from when the request reached vLLM's
engine client to its first token. For an opted-in request kvcomm works before that: the
middleware plans it ahead on the workers and, when the plan computes a preamble, runs the preamble's
request first (``serve.preambles``); vLLM's histogram leaves that time out and counts the preamble's
request as a request of its own. This one is measured around all of it, by the middleware:

- ``kvcomm_time_to_first_token_seconds{route, kvcomm}``: seconds from when the request reached
  the middleware (before its body was read) to its first reply token. ``route``:
  ``/v1/completions`` or ``/v1/chat/completions``; ``kvcomm``: ``"yes"`` for a request that opted
  into kvcomm (``kv_transfer_params.kvcomm``), ``"no"`` for a plain one. One observation per
  request answered with status 200; the server's own requests (preamble requests, the context API's
  and the quality guard's) run below the middleware and are not observed.

Where the first token is: a streamed response (``text/event-stream``) when the first event
whose choice carries text or token ids is sent; a whole JSON response when it is sent, less
vLLM's decode interval (``metrics.generation_time_ms`` of the per-request metrics, first to last
output token), as the remote chat clients compute a non-streamed call's TTFT
(``remote.wire.end_to_end_ttft``). A whole response without that interval (a server started
with ``--disable-log-stats``) is not observed. Buckets: vLLM's TTFT buckets, so the two
histograms compare bucket by bucket.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import Histogram
from starlette.types import Message, Send
from vllm.v1.metrics.buckets import histogram_buckets

ROUTES = ("/v1/completions", "/v1/chat/completions")
"""The routes whose responses carry generated tokens and are observed."""

TTFT = Histogram(
    "kvcomm_time_to_first_token_seconds",
    "Seconds from a request's arrival at kvcomm serve (planning and preamble included) to its first token",
    ["route", "kvcomm"], buckets=histogram_buckets("time_to_first_token"),
)


def observed(path: str) -> bool:
    return path in ROUTES


class FirstToken:
    """Wraps an ASGI ``send`` for one request that arrived at ``arrived`` (``time.perf_counter()``)
    and observes its TTFT in ``TTFT`` once (module docstring)."""

    def __init__(self, send: Send, arrived: float, route: str, opted_in: bool):
        self._send = send
        self.arrived = arrived
        self.labels = (route, "yes" if opted_in else "no")
        self.status: int | None = None
        self.streamed = False
        self.seconds: float | None = None
        """The TTFT observed, once it is."""
        self._pending = b""
        self._body: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self.streamed = content_type.startswith(b"text/event-stream")
        await self._send(message)
        if message["type"] == "http.response.body" and self.status == 200 and self.seconds is None:
            self._body_sent(message.get("body", b""), message.get("more_body", False))

    def _body_sent(self, chunk: bytes, more: bool) -> None:
        now = time.perf_counter()
        if self.streamed:
            self._pending += chunk
            *events, self._pending = self._pending.split(b"\n\n")
            if any(_has_token(event) for event in events):
                self._observe(now - self.arrived)
            return
        self._body.append(chunk)
        if not more:
            decode = _decode_seconds(b"".join(self._body))
            self._body = []
            if decode is not None:
                self._observe(max(0.0, now - self.arrived - decode))

    def _observe(self, seconds: float) -> None:
        self.seconds = seconds
        TTFT.labels(*self.labels).observe(seconds)


def _has_token(event: bytes) -> bool:
    """Whether one server-sent event is a chunk whose choice carries reply text or token ids."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            chunk = json.loads(line[len(b"data: "):])
        except ValueError:
            continue
        for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
            if isinstance(choice, dict) and (choice.get("text") or choice.get("token_ids") or _delta_text(choice)):
                return True
    return False


def _delta_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _decode_seconds(body: bytes) -> float | None:
    """vLLM's decode interval of a whole response (``metrics.generation_time_ms``), seconds; None
    where the response has none."""
    try:
        response = json.loads(body)
    except ValueError:
        return None
    metrics = response.get("metrics") if isinstance(response, dict) else None
    value = metrics.get("generation_time_ms") if isinstance(metrics, dict) else None
    return float(value) / 1e3 if isinstance(value, (int, float)) else None
