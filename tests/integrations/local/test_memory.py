"""Memory bounds of the chat backends (AutoGen, AG2): a long conversation stays inside the
anchor byte cap ``ChatBackend`` applies by default, although every message opens a slot
(and so a pool) of its own."""

from __future__ import annotations

import pytest

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.local.backend import ANCHOR_BYTES, ChatBackend
from kvcomm.integrations.local.segments import ChatTurn
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)

AGENTS = {"writer": "You answer briefly.", "reviewer": "You review the answer in one sentence."}
ROUNDS = 14


def _converse(backend: ChatBackend, after_call=None) -> list:
    """Agents take turns on one growing conversation, each speaking once: each sees the task
    and every earlier reply (as user turns). Each call's system message is new, so it reuses
    nothing and computes every message, which its slots learn as anchors (under the
    estimate-or-realign rule a call that reuses a message realigns it and learns no anchor)."""
    said: list[tuple[str, str]] = [("user", "Plan a three-day trip to Lisbon, one step at a time.")]
    calls = []
    for turn in range(ROUNDS):
        name = f"{('writer', 'reviewer')[turn % 2]}-{turn}"
        system = f"{AGENTS[name.split('-')[0]]} You speak as agent {turn}."
        turns = [ChatTurn("system", system)] + [
            ChatTurn("assistant" if author == name else "user", text, author) for author, text in said
        ]
        reply = backend.complete(turns, max_new_tokens=6)
        said.append((name, reply.text.strip() or f"step {turn}"))
        calls.append(reply.call)
        if after_call is not None:
            after_call(backend)
    return calls


def _backend(executor, anchor_bytes) -> ChatBackend:
    engine = ReuseEngine(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    return ChatBackend(executor, engine, max_new_tokens=6, anchor_bytes=anchor_bytes)


def test_the_anchor_cap_is_on_by_default(tiny_executor):
    backend = ChatBackend(tiny_executor, ReuseEngine(tiny_executor.rotary))
    assert backend.anchor_bytes == ANCHOR_BYTES and ANCHOR_BYTES is not None
    with pytest.raises(ValueError, match="anchor_bytes must be a number of bytes"):
        ChatBackend(tiny_executor, ReuseEngine(tiny_executor.rotary), anchor_bytes=-1)


@pytest.mark.slow
def test_a_long_conversation_stays_inside_the_anchor_cap(tiny_executor):
    peaks: list[tuple[int, int]] = []  # per call: (anchor bytes, pools) after it returned

    def watch(backend: ChatBackend) -> None:
        peaks.append((backend.anchor_pool_bytes, len(backend.engine.pools)))

    free = _backend(tiny_executor, None)
    free_calls = _converse(free, watch)
    uncapped_bytes = max(b for b, _ in peaks)
    uncapped_pools = max(p for _, p in peaks)
    slots = {slot for call in free_calls for slot in call.slots}
    # what the cap is for: without it, pools (one per message slot) and bytes keep growing
    assert len(slots) >= ROUNDS and uncapped_pools >= 6 and free.anchor_evictions == 0
    assert peaks[-1][0] == uncapped_bytes > peaks[len(peaks) // 2][0]

    cap = uncapped_bytes // 4
    peaks.clear()
    capped = _backend(tiny_executor, cap)
    calls = _converse(capped, watch)
    assert all(held <= cap for held, _ in peaks), (cap, peaks)
    assert capped.anchor_evictions > 0 and max(p for _, p in peaks) < uncapped_pools
    assert capped.anchor_pool_bytes == sum(pool.nbytes for pool in capped.engine.pools.values())
    assert all(len(pool) for pool in capped.engine.pools.values())  # emptied pools are dropped
    assert not any(pool.problems() for pool in capped.engine.pools.values())
    # the conversation is served as before: the cap costs anchors (which no slot here has
    # earned the right to serve), not what the calls reuse
    def sources(run):
        return [(c.provenance.exact_tokens, c.provenance.estimated_tokens, c.provenance.prompt_tokens) for c in run]

    assert sources(calls) == sources(free_calls)
