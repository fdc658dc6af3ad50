"""Requests `kvcomm serve` sends to its own served app (below the middleware): the context
API's engine requests, the preamble requests and the quality guard's twins; and
its lines in the API server's log."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from starlette.types import ASGIApp, Message, Scope


async def call_app(app: ASGIApp, base: Scope, method: str, path: str, body: dict | None,
                   auth: list | None = None) -> tuple[int, Any]:
    """One request to ``app`` (the served app, not through the middleware) in a copy of the
    HTTP scope ``base``; ``auth``: its ``authorization`` headers (default: ``base``'s, as vLLM's
    own key check applies below the middleware). Returns (status, parsed JSON or text)."""
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if auth is None:
        auth = [(k, v) for k, v in base.get("headers", []) if k.lower() == b"authorization"]
    inner = {**base, "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers + list(auth)}
    done = asyncio.Event()
    sent = [False]
    out: dict = {"status": 500, "body": []}

    async def receive() -> Message:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"].append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(inner, receive, send)
    finally:
        done.set()
    text = b"".join(out["body"]).decode("utf-8", "replace")
    try:
        return out["status"], json.loads(text)
    except ValueError:
        return out["status"], text


def kvcomm_of(message: Any) -> Any:
    """``message["kv_transfer_params"]["kvcomm"]`` of a request body or a response, or None where
    a level is missing or not an object (vLLM answers ``"kv_transfer_params": null``)."""
    params = message.get("kv_transfer_params") if isinstance(message, dict) else None
    return params.get("kvcomm") if isinstance(params, dict) else None


def kvcomm_error(answer: Any) -> str | None:
    """The kvcomm error a response reports, if any."""
    options = kvcomm_of(answer)
    return options.get("error") if isinstance(options, dict) else None


def say(line: str) -> None:
    """One line in the API server's log. Printed, as the middleware prints its route table:
    vLLM's logging setup leaves other packages' loggers without a handler in the API server."""
    print(f"kvcomm: {line}", file=sys.stderr, flush=True)
