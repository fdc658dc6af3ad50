"""Running one agent call through an executor and an engine (kvcomm.reuse.runner): which
replies become bases. The engines hold no exact prefixes (``prefix_store_bytes=0``), so a
prompt that repeats another's head is served from bases."""

import pytest

from kvcomm.core.segments import Prompt, Segment
from kvcomm.reuse import SCOPES, ReuseConfig, ReuseEngine
from kvcomm.reuse.runner import run_agent

DOC = tuple(range(1000, 1040))


def _prompt(tail: tuple[int, ...]) -> Prompt:
    return Prompt("reader", (Segment((300, 301)), Segment(DOC, slot="doc", shared_id="doc"), Segment(tail)))


@pytest.mark.parametrize("scope", [name for name, scope in SCOPES.items() if scope.decode_reply_bases])
def test_a_reply_becomes_a_base_only_from_a_request_that_did_not_estimate(tiny_executor, scope):
    """Scopes with decode_reply_bases: the producer's decode KV is the reply's base, from a
    request that estimated nothing."""
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(mode="realign", scope=scope, prefix_store_bytes=0))
    first, first_use = run_agent(tiny_executor, engine, _prompt((500, 501)), 3)
    assert first_use.estimated_tokens == 0  # the document is new: computed, its base learned
    assert engine.has_base(Segment(first.reply_ids, slot="_").shared_id)  # a clean request's reply always
    second, reuse = run_agent(tiny_executor, engine, _prompt((600, 601, 602)), 3)
    assert reuse.estimated_tokens == len(DOC)  # the document realigned from its base
    assert second.reply_ids != first.reply_ids
    assert not engine.has_base(Segment(second.reply_ids, slot="_").shared_id)


@pytest.mark.parametrize("scope", [name for name, scope in SCOPES.items() if not scope.decode_reply_bases])
def test_without_decode_reply_bases_a_reply_is_computed_until_a_clean_reader_takes_its_base(tiny_executor, scope):
    """Scopes without decode_reply_bases: the producer's decode KV is not the reply's base,
    even from a clean request; the first reader that computes it cleanly gives it one, which
    later readers reuse."""
    assert not SCOPES[scope].decode_reply_bases
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(mode="realign", scope=scope, prefix_store_bytes=0))
    produced, clean = run_agent(tiny_executor, engine, _prompt((500, 501)), 3)
    assert clean.estimated_tokens == 0 and produced.reply_ids
    reply = Segment(produced.reply_ids, slot="reply")
    assert not engine.has_base(reply.shared_id)  # a clean request: still none
    reader = Prompt("asker", (Segment((310, 311)), reply, Segment((700, 701))))
    _, first_read = run_agent(tiny_executor, engine, reader, 2)
    assert first_read.estimated_tokens == 0 and engine.has_base(reply.shared_id)  # computed, its base learned
    _, second_read = run_agent(tiny_executor, engine, Prompt("asker", (Segment((310, 311)), reply, Segment((702, 703)))), 2)
    assert second_read.estimated_tokens == len(reply)


@pytest.mark.parametrize("scope", [name for name, scope in SCOPES.items() if not scope.decode_reply_bases])
def test_a_reader_that_estimated_gives_a_reply_its_base(tiny_executor, scope):
    """decode_reply_bases=False with every reader estimating the document: bases_after_estimates
    (which every such scope sets) lets the first reader's computed KV of the reply become its
    base, so the next reader reuses the reply."""
    assert SCOPES[scope].bases_after_estimates
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(mode="realign", scope=scope, prefix_store_bytes=0))
    produced, _ = run_agent(tiny_executor, engine, _prompt((500, 501)), 3)
    reply = Segment(produced.reply_ids, slot="reply")

    def reader(tail: tuple[int, ...]) -> Prompt:
        return Prompt("reader", (Segment((300, 301)), Segment(DOC, slot="doc", shared_id="doc"), reply, Segment(tail)))

    assert not engine.has_base(reply.shared_id)  # not from its producer
    _, first_read = run_agent(tiny_executor, engine, reader((700, 701)), 2)
    assert first_read.estimated_tokens == len(DOC)  # the document realigned, the reply computed behind it
    assert engine.has_base(reply.shared_id)
    _, second_read = run_agent(tiny_executor, engine, reader((702, 703)), 2)
    assert second_read.estimated_tokens == len(DOC) + len(reply)


def test_namespaced_gives_each_caller_a_new_salt_and_leaves_runtimes_without_a_prefix_cache_alone(tiny_executor):
    from kvcomm.reuse.executor import namespaced

    assert namespaced(tiny_executor, "dense") is tiny_executor  # transformers: no prefix cache of its own

    class Salted:
        def __init__(self, salt=None):
            self.salt = salt

        def with_salt(self, salt):
            return Salted(salt)

    runtime = Salted()
    first, second = namespaced(runtime, "dense"), namespaced(runtime, "dense")
    assert first.salt.startswith("kvcomm-dense-") and second.salt.startswith("kvcomm-dense-")
    assert first.salt != second.salt and runtime.salt is None  # a new namespace per call; the original untouched
