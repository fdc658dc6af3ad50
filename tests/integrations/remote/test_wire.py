"""The remote backend's wire format: slot names and span annotations the server accepts."""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcomm.integrations.local.segments import ChatTurn, render_chat
from kvcomm.integrations.remote.wire import (
    StreamedCompletion, completion_body, end_to_end_ttft, provenance, ttft_seconds, wire_slot,
)
from kvcomm.integrations.vllm.wire.params import SLOT_NAME, parse_params

_author = st.text(min_size=1, max_size=90)
_index = st.integers(0, 10_000)


@settings(max_examples=300, deadline=None)
@given(author=_author, k=_index, other=_author)
@example(author="A\n", k=0, other="A")  # "$" matched before a final newline: 'A\n.0' went out
def test_wire_slots_pass_the_servers_rule_and_keep_authors_apart(author, k, other):
    slot = wire_slot(f"{author}#{k}")
    assert SLOT_NAME.match(slot), slot
    assert wire_slot(f"{author}#{k}") == slot
    assert slot.endswith(f".{k}")
    if other != author:
        assert wire_slot(f"{other}#{k}") != slot
    assert wire_slot(f"{author}#{k + 1}") != slot


def test_plain_author_names_travel_unchanged():
    assert wire_slot("writer#0") == "writer.0"
    assert wire_slot("user#12") == "user.12"
    assert wire_slot("my agent#1").startswith("my_agent_") and wire_slot("my_agent#1") == "my_agent.1"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)


_content = st.text(st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters=" .,?!'#"), min_size=1, max_size=30)
_turn = st.tuples(st.sampled_from(["user", "assistant"]), st.sampled_from([None, "planner", "the critic", "Ärger#2"]), _content)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(turns=st.lists(_turn, min_size=1, max_size=6))
def test_annotations_are_valid_server_params_naming_each_message(tokenizer, turns):
    chat = render_chat(tokenizer, lambda t: tokenizer.encode(t, add_special_tokens=False),
                       [ChatTurn("system", "You help.")] + [ChatTurn(r, c, s) for r, s, c in turns])
    body = completion_body("m", chat, 8, reuse=True, tenant="team-1")
    params = parse_params(body["kv_transfer_params"], len(body["prompt"]))  # the server's own validator
    shared = [chat.prompt.segments[i] for i in sorted(chat.turn_segments.values())]
    assert params is not None and params.template == chat.prompt.template_id and params.tenant == "team-1"
    assert body["cache_salt"] == "kvcomm-team-1"
    assert len(params.segments) == len(shared)
    for span, segment in zip(params.segments, shared):
        assert tuple(body["prompt"][span.start : span.end]) == segment.token_ids
        assert span.slot == wire_slot(segment.slot)
    dense = completion_body("m", chat, 8, reuse=False, tenant="team-1")
    assert "kv_transfer_params" not in dense and "cache_salt" not in dense and dense["prompt"] == body["prompt"]


@pytest.mark.slow
def test_provenance_from_a_server_summary_and_without_one(tokenizer):
    chat = render_chat(tokenizer, lambda t: tokenizer.encode(t, add_special_tokens=False),
                       [ChatTurn("system", "You help."), ChatTurn("user", "Name a fruit."), ChatTurn("assistant", "A pear.", "w")])
    n = len(chat.prompt)
    first = chat.prompt.starts[chat.turn_segments[1]]
    summary = {"prompt_tokens": n, "exact_tokens": first, "estimated_tokens": 3, "computed_tokens": n - first - 3,
               "fallback": False, "note": ""}
    p = provenance(chat, n, summary, True, cached_tokens=first + 3)
    assert (p.exact_tokens, p.estimated_tokens, p.reused_shared_tokens) == (first, 3, 3)
    assert p.note == f"vLLM cached_tokens {first + 3} (vLLM's prefix-cache hit plus KV kvcomm loaded past it) vs kvcomm's plan {first + 3} exact+estimated"
    # vLLM's own prefix cache reached further than kvcomm's plan: the note says which count is which
    p = provenance(chat, n, summary | {"exact_tokens": 0, "estimated_tokens": 0, "computed_tokens": n}, True, cached_tokens=32)
    assert p.computed_tokens == n and p.note.endswith("vs kvcomm's plan 0 exact+estimated: 32 of kvcomm's computed tokens were a vLLM prefix-cache hit")
    assert p.cached_tokens == 32  # of the computed tokens, those vLLM's prefix cache served (as in process)
    assert provenance(chat, n, summary, True, cached_tokens=first + 3).cached_tokens == 0
    p = provenance(chat, n, None, False, cached_tokens=32)
    assert p.cached_tokens == 32 and p.computed_tokens == n
    assert p.note == "dense: no kvcomm options sent; vLLM cached_tokens 32: vLLM's prefix-cache hit (kvcomm reported no split)"
    for rejected in ({"error": "bad slot"}, None, {"note": "x"}):
        p = provenance(chat, n, rejected, True)
        assert p.computed_tokens == n and p.exact_tokens == p.estimated_tokens == 0 and p.note
    # annotated, no split (a streamed call): vLLM's count may hold KV kvcomm loaded, so it is no
    # prefix-cache count, and the reason keeps the words
    p = provenance(chat, n, None, True, cached_tokens=32, why_unknown="streamed: no split")
    assert p.cached_tokens == 0 and "prefix cache" not in p.reason.split("; ")[0]
    assert p.reason.endswith("because streamed: no split; vLLM did not compute 32 of the prompt tokens (its prefix cache "
                             "or KV kvcomm loaded served them; this response has no split)")
    assert provenance(chat, n, None, True, cached_tokens=0, why_unknown="streamed: no split").note == "streamed: no split"


@pytest.mark.slow
def test_a_preamble_is_part_of_vllms_cached_count_not_a_prefix_cache_surprise(tokenizer):
    """The issue-49 case: the server computed a preamble in a request of its own, so vLLM's
    ``cached_tokens`` covers it; the note must not call those tokens a prefix-cache hit while
    ``Provenance.cached_tokens`` says 0, and the reason names the preamble."""
    chat = render_chat(tokenizer, lambda t: tokenizer.encode(t, add_special_tokens=False),
                       [ChatTurn("system", "You help."), ChatTurn("user", "Name a fruit."), ChatTurn("assistant", "A pear.", "w")])
    n = len(chat.prompt)
    first = chat.prompt.starts[chat.turn_segments[1]]
    summary = {"prompt_tokens": n, "exact_tokens": 0, "estimated_tokens": 3, "computed_tokens": n - 3,
               "preamble_tokens": first, "fallback": False, "note": ""}
    p = provenance(chat, n, summary, True, cached_tokens=first + 3)
    assert p.cached_tokens == 0 and "prefix-cache hit" not in p.note.split("KV kvcomm loaded past it)")[1]
    assert p.note.endswith(f"vs kvcomm's plan 3 exact+estimated + {first} preamble (computed by the preamble request)")
    assert p.reason.startswith(f"reused 3 of {n} tokens (estimated 3); computed {n - 3}: {first} new text before the reused content")
    p = provenance(chat, n, summary, True, cached_tokens=first + 5)
    assert p.cached_tokens == 2 and p.note.endswith(": 2 of kvcomm's computed tokens were a vLLM prefix-cache hit")


def test_end_to_end_ttft_is_the_wait_less_the_servers_decode():
    """A non-streamed response arrives whole: the call's TTFT is its elapsed time less the
    server's first-to-last-token interval, so what the server did before scheduling the
    request (planning, a preamble request, the queue) counts; vLLM's own TTFT does not see it."""
    response = {"metrics": {"time_to_first_token_ms": 190.0, "generation_time_ms": 250.0}}
    assert ttft_seconds(response) == pytest.approx(0.19)
    assert end_to_end_ttft(response, 0.69) == pytest.approx(0.44)
    assert end_to_end_ttft({"metrics": {"time_to_first_token_ms": 190.0}}, 0.69) is None  # no decode interval reported
    assert end_to_end_ttft({}, 0.69) is None


def test_a_stream_notes_when_its_first_token_arrived():
    streamed = StreamedCompletion()
    streamed.add({"choices": [{"text": "", "token_ids": []}]})
    assert streamed.first_token_at is None  # a chunk without a token is not the first token
    before = time.perf_counter()
    streamed.add({"choices": [{"text": "Hi", "token_ids": [5]}]})
    first = streamed.first_token_at
    streamed.add({"choices": [{"text": "!", "token_ids": [6]}]})
    assert first is not None and first >= before and streamed.first_token_at == first
