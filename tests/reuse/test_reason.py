"""A call's reason in plain words (``kvcomm.reuse.reason``): every count it names adds up to the
provenance's, and each kind of plan note reads as what happened."""

from __future__ import annotations

import pytest

from kvcomm.reuse.plan import Provenance
from kvcomm.reuse.reason import because, explain


def _p(prompt, exact=0, estimated=0, preamble=0, recomputed=0, cached=0, note="", fallback=False):
    computed = prompt - exact - estimated
    return Provenance(prompt, exact, estimated, computed, 0, 0, fallback, note, 0.1, recomputed, cached, preamble)


def test_the_issue_case_a_long_exact_prefix_is_reuse_not_a_fallback():
    """Issue 49: a call counted as a "fallback" had reused 996 of 1,204 tokens exactly."""
    p = _p(1204, exact=996, fallback=True,
           note="slot 'notes' not shareable (0 compatible anchors, 2 needed): new anchor")
    assert p.reason == ("reused 996 of 1,204 tokens (exact 996); computed 208: 208 from token 996 because slot "
                        "'notes' is warming up (0 of 2 anchors needed to estimate it); this call becomes one")


def test_a_computed_head_and_the_last_token():
    p = _p(1204, exact=0, estimated=1000, preamble=203)
    assert p.reason == ("reused 1,000 of 1,204 tokens (estimated 1,000); computed 204: 203 new text before the "
                        "reused content, 1 because the last prompt token is always computed (its logits start the reply)")


def test_a_dense_call_and_a_call_that_reused_nothing():
    assert _p(50, note="dense").reason == "reused 0 of 50 tokens; computed 50: all 50 because a dense call (no reuse engine)"
    assert _p(50).reason == "reused 0 of 50 tokens; computed 50: all 50"


def test_recomputed_and_prefix_cache_tokens_are_named():
    p = _p(100, exact=10, estimated=60, recomputed=9, cached=4, note="slot 'doc': 60 of 80 tokens covered by anchors")
    assert p.reason == ("reused 70 of 100 tokens (exact 10, estimated 60); computed 30: 9 recomputed inside the reused "
                        "range (selective recompute), 21 from token 79 because the anchors of slot 'doc' cover only 60 "
                        "of its 80 tokens (4 of them served by vLLM's prefix cache)")


@pytest.mark.parametrize("note, words", [
    ("slot 'x' not shareable (anchors cover 10 of 100 tokens, under min_coverage 0.5): new anchor",
     "slot 'x' cannot be estimated (anchors cover 10 of 100 tokens, under min_coverage 0.5); this call becomes an anchor of it"),
    ("slot 'doc': new content, its base is taken from this prefill",
     "slot 'doc' holds text seen for the first time (this call's KV of it is kept for later calls)"),
    ("fixed segment 0 at 0 has no base yet", "the template text at token 0 is new (an agent's first call, or a new system message)"),
    ("fixed segment 3 at 1120 is not reusable on its own",
     "the template text at token 1,120 is reused only right after estimated content, and none came before it"),
    ("the exact prefix ends inside fixed segment 0, at token 31: the rest of it is computed",
     "the stored exact prefix ends inside template text at token 31"),
    ("template text after the last reused shared segment is computed (from 77)",
     "the reuse scope computes the template text after the shared content"),
    ("no reuse: prompt of 9000 tokens is past the exact RoPE length", "prompt of 9000 tokens is past the exact RoPE length"),
    ("mode exact: exact prefix only", "mode exact serves exact prefixes only"),
    ("something new a server says", "something new a server says"),  # unknown notes pass through
    ("dense; vLLM cached_tokens 32: vLLM's prefix-cache hit (kvcomm reported no split)", "a dense call (no reuse engine)"),
    ("", ""),
])
def test_each_kind_of_note_in_words(note, words):
    assert because(note) == words


def test_nothing_computed_but_a_note():
    p = Provenance(10, 10, 0, 0, 0, 0, False, "calibration: computed densely, learned")
    assert explain(p) == "reused 10 of 10 tokens (exact 10); calibration: computed densely, learned"
