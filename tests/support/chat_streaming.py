"""Shared by the in-process and remote AutoGen client tests: streaming and concurrent calls."""

from __future__ import annotations

import asyncio


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


def assert_concurrent_calls_equal_sequential(client, conversations) -> None:
    """``client.create`` on each conversation one by one, then all at once: the same replies."""
    sequential = [asyncio.run(client.create(c)).content for c in conversations]

    async def together():
        return await asyncio.gather(*(client.create(c) for c in conversations))

    assert [r.content for r in asyncio.run(together())] == sequential
    assert len(client.call_log) == 2 * len(conversations)
