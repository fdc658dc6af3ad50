"""A served request's state machine (``serve.served_request``): stages only forward, each once,
and what the middleware drives through it on an app shaped like vLLM's. The stages a real
server's requests reach (planned, preamble computed, measured) are checked end to end by
``test_ttft_http.py`` (a preamble) and ``test_guard_http.py`` (twins)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from kvcomm.integrations.serve.preambles import PreambleRequests, PlannedAhead  # noqa: E402
from kvcomm.integrations.serve.served_request import ORDER, ServedRequest, Stage  # noqa: E402
from kvcomm.integrations.serve.twins import TwinRequests  # noqa: E402


def _request(app=None) -> ServedRequest:
    body = {"prompt": [1, 2, 3], "cache_salt": "s", "kv_transfer_params": {"kvcomm": {}}}
    return ServedRequest({"type": "http", "headers": []}, body, PreambleRequests(app), TwinRequests(app))


def test_stages_go_only_forward_and_each_once():
    request = _request()
    assert request.stage is Stage.RECEIVED and ORDER[0] is Stage.RECEIVED and ORDER[-1] is Stage.MEASURED
    request.reach(Stage.PLANNED)
    request.reach(Stage.SERVED)  # no preamble: that stage is skipped
    for back in (Stage.RECEIVED, Stage.PLANNED, Stage.PREAMBLE_COMPUTED, Stage.SERVED):
        with pytest.raises(RuntimeError, match="cannot go from served to"):
            request.reach(back)
    request.reach(Stage.MEASURED)
    assert request.stages == [Stage.RECEIVED, Stage.PLANNED, Stage.SERVED, Stage.MEASURED]


async def _app(scope, receive, send, status: int = 200):
    await receive()
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _receive():
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}
    return receive


def _drive(request: ServedRequest, status: int) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def run():
        await request.prepare()
        await request.serve(lambda s, r, w: _app(s, r, w, status), request.scope, _receive(), send)
        request.measure()

    asyncio.run(run())
    return sent


def test_a_request_the_workers_cannot_plan_ahead_goes_from_received_to_served():
    """No served vLLM app in the scope (so no engine client): planned in the engine step, served,
    nothing measured; the response passes through unchanged."""
    request = _request()
    sent = _drive(request, 200)
    assert request.stages == [Stage.RECEIVED, Stage.SERVED] and request.ahead is None
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and sent[0]["status"] == 200


def test_an_error_response_is_not_served_and_a_failed_preamble_is_not_measured():
    request = _request()
    _drive(request, 500)
    assert request.stages == [Stage.RECEIVED]
    request = _request()
    request.stages.append(Stage.PLANNED)
    request.ahead = PlannedAhead("t", (0, 2), ("t.twin", 20))  # sampled, its preamble request failed
    request.stages.append(Stage.SERVED)
    request.measure()  # would start the twins (and need a running loop) if it measured
    assert request.stage is Stage.SERVED and request._twins.measured == request._twins.skipped == 0
