"""Running one agent call through an executor and an engine (kvcomm.engine.runner): which
replies become bases."""

import pytest

from kvcomm.core.segments import Prompt, Segment
from kvcomm.engine import ReuseConfig, ReuseEngine
from kvcomm.engine.runner import run_agent

DOC = tuple(range(1000, 1040))


def _prompt(tail: tuple[int, ...]) -> Prompt:
    return Prompt("reader", (Segment((300, 301)), Segment(DOC, slot="doc", shared_id="doc"), Segment(tail)))


@pytest.mark.parametrize("after_estimates", [False, True])
def test_a_reply_becomes_a_base_after_an_estimate_only_when_asked(tiny_executor, after_estimates):
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(
        mode="realign", exact_prefix=False, reply_bases_after_estimates=after_estimates))
    first, first_use = run_agent(tiny_executor, engine, _prompt((500, 501)), 3)
    assert first_use.estimated_tokens == 0  # the document is new: computed, its base learned
    assert engine.has_base(Segment(first.reply_ids, slot="_").shared_id)  # a clean request's reply always
    second, reuse = run_agent(tiny_executor, engine, _prompt((600, 601, 602)), 3)
    assert reuse.estimated_tokens == len(DOC)  # the document realigned from its base
    assert second.reply_ids != first.reply_ids
    assert engine.has_base(Segment(second.reply_ids, slot="_").shared_id) is after_estimates
