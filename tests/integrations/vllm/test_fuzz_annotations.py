"""Hypothesis fuzzing of the annotation parser (``kv_transfer_params["kvcomm"]``, issue 6).

Whatever a client sends, ``parse_params`` either accepts it (and then the spans obey the
schema's laws) or raises ``KvcommParamsError`` with a message naming the field; never any
other exception, which would take more than that one request down.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.integrations.vllm.wire.params import KvcommParams, KvcommParamsError, parse_params

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
slot_names = st.builds(str.__add__, st.sampled_from("aZ_"), st.text(alphabet="bY9_.-", max_size=10))  # [A-Za-z_][A-Za-z0-9_.-]*
field_values = {
    "start": st.integers(-5, 80) | json_values, "end": st.integers(-5, 80) | json_values,
    "slot": slot_names | json_values, "id": st.text(max_size=6) | json_values,
}
segment_like = st.fixed_dictionaries(
    {}, optional={**field_values, "extra": json_values},
)
body_like = st.fixed_dictionaries({}, optional={
    "handle": st.text(max_size=6) | json_values, "template": st.text(max_size=6) | json_values,
    "tenant": st.text(max_size=6) | json_values, "segments": st.lists(segment_like, max_size=5) | json_values,
    "surprise": json_values,
})


def _parse(params, prompt_len: int) -> KvcommParams | None:
    try:
        return parse_params(params, prompt_len)
    except KvcommParamsError as error:
        assert str(error), "an error must say what was wrong"
        assert "kv_transfer_params" in str(error)  # names where the problem is
        return None


def _assert_laws(parsed: KvcommParams | None, prompt_len: int) -> None:
    if parsed is None or parsed.segments is None:
        return
    previous_end = 0
    for span in parsed.segments:
        assert previous_end <= span.start < span.end <= prompt_len
        assert isinstance(span.slot, str) and span.slot
        previous_end = span.end
    assert isinstance(parsed.template, str) and parsed.template and isinstance(parsed.tenant, str) and parsed.tenant


@settings(max_examples=200, deadline=None)
@given(params=json_values | st.fixed_dictionaries({"kvcomm": json_values}), prompt_len=st.integers(0, 80))
def test_any_json_is_parsed_or_refused_clearly(params, prompt_len):
    _assert_laws(_parse(params, prompt_len), prompt_len)


@settings(max_examples=200, deadline=None)
@given(body=body_like, prompt_len=st.integers(0, 80))
def test_near_miss_annotations_are_parsed_or_refused_clearly(body, prompt_len):
    _assert_laws(_parse({"kvcomm": body}, prompt_len), prompt_len)


@st.composite
def valid_annotations(draw):
    prompt_len = draw(st.integers(1, 200))
    cuts = sorted(draw(st.sets(st.integers(0, prompt_len), min_size=2, max_size=10)))
    spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
    segments = [{"start": a, "end": b, "slot": draw(slot_names)} for a, b in spans]
    return prompt_len, segments


@settings(max_examples=200, deadline=None)
@given(case=valid_annotations())
def test_valid_annotations_round_trip(case):
    prompt_len, segments = case
    parsed = parse_params({"kvcomm": {"segments": segments, "template": "agent"}}, prompt_len)
    assert [(s.start, s.end, s.slot) for s in parsed.segments] == [(s["start"], s["end"], s["slot"]) for s in segments]
    _assert_laws(parsed, prompt_len)


@settings(max_examples=200, deadline=None)
@given(case=valid_annotations(), data=st.data())
def test_breaking_one_span_is_refused_and_names_it(case, data):
    prompt_len, segments = case
    i = data.draw(st.integers(0, len(segments) - 1))
    span = segments[i]
    how = data.draw(st.sampled_from(["reversed", "past_end", "negative", "overlap", "slot", "float"]))
    if how == "overlap" and i == 0:
        how = "reversed"
    broken = [dict(s) for s in segments]
    if how == "reversed":
        broken[i]["start"], broken[i]["end"] = span["end"], span["start"]
    elif how == "past_end":
        broken[i]["end"] = prompt_len + 1
    elif how == "negative":
        broken[i]["start"] = -1
    elif how == "overlap":
        broken[i]["start"] = broken[i - 1]["end"] - 1
    elif how == "slot":
        broken[i]["slot"] = "bad slot!"
    else:
        broken[i]["start"] = float(span["start"])
    try:
        parse_params({"kvcomm": {"segments": broken}}, prompt_len)
    except KvcommParamsError as error:
        assert f"segments[{i}]" in str(error)
    else:
        raise AssertionError(f"{how} span {broken[i]} was accepted")
