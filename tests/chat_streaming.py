"""Shared by the AutoGen client tests: collect a ``create_stream`` run, optionally cancelling it."""

from __future__ import annotations


async def collect_stream(client, messages, token=None, cancel_after: int | None = None):
    """(text chunks, final ``CreateResult``) of ``client.create_stream(messages)``; with
    ``cancel_after``, ``token.cancel()`` once that many chunks have arrived."""
    chunks, result = [], None
    async for item in client.create_stream(messages, cancellation_token=token):
        if isinstance(item, str):
            chunks.append(item)
            if cancel_after is not None and len(chunks) == cancel_after:
                token.cancel()
        else:
            result = item
    return chunks, result
