"""Validation of ``kv_transfer_params["kvcomm"]`` (no engine needed)."""

from __future__ import annotations

import pytest

from kvcomm.integrations.vllm.wire.params import SERVER_KEY, KvcommParamsError, SpanAnnotation, parse_params


def test_requests_without_kvcomm_key_are_not_opted_in():
    assert parse_params(None, 10) is None
    assert parse_params({"do_remote_decode": True}, 10) is None


def test_valid_annotations_parse_in_order():
    params = parse_params({"kvcomm": {"template": "critic", "segments": [
        {"start": 2, "end": 5, "slot": "task"}, {"start": 5, "end": 9, "slot": "planner", "id": "p1"}]}}, 10)
    assert params.template == "critic" and params.handle is None
    assert params.segments == (SpanAnnotation(2, 5, "task"), SpanAnnotation(5, 9, "planner", "p1"))
    assert params.tenant == "default" and params.calibrate is False
    assert parse_params({"kvcomm": {"tenant": "team-a"}}, 10).tenant == "team-a"
    assert parse_params({"kvcomm": {"calibrate": True}}, 10).calibrate is True


@pytest.mark.parametrize("body, message", [
    ([1], "must be a JSON object"),
    ({"segmnts": []}, "unknown keys ['segmnts']"),
    ({"calibrate": "yes"}, "calibrate must be true or false, got 'yes'"),
    ({"calibrate": 1}, "calibrate must be true or false, got 1"),
    ({"handle": "h"}, "['handle'] are kvcomm's own"),
    ({"segments": "0-4"}, "segments must be a list"),
    ({"segments": [{"start": "0", "end": 4, "slot": "task"}]}, "segments[0].start must be an integer"),
    ({"segments": [{"start": True, "end": 4, "slot": "task"}]}, "segments[0].start must be an integer"),
    ({"segments": [{"start": 0, "end": 11, "slot": "task"}]}, "need 0 <= start < end <= 10"),
    ({"segments": [{"start": 4, "end": 4, "slot": "task"}]}, "need 0 <= start < end <= 10"),
    ({"segments": [{"start": -1, "end": 4, "slot": "task"}]}, "need 0 <= start < end <= 10"),
    ({"segments": [{"start": 0, "end": 4, "slot": "task"}, {"start": 3, "end": 6, "slot": "x"}]}, "overlaps"),
    ({"segments": [{"start": 0, "end": 4}]}, "missing keys ['slot']"),
    ({"segments": [{"start": 0, "end": 4, "slot": "no spaces"}]}, "slot must be a name"),
    ({"segments": [{"start": 0, "end": 4, "slot": "task\n"}]}, "slot must be a name"),
    ({"segments": [{"start": 0, "end": 4, "slot": "critic"}]}, "not a known slot"),
    ({"tenant": ""}, "tenant must be a non-empty string"),
    ({"tenant": "t" * 257}, "at most 256 characters"),
    ({"template": "t" * 257}, "template has 257 characters; at most 256"),
    ({"segments": [{"start": 0, "end": 4, "slot": "task", "id": "i" * 10_000}]}, "segments[0].id has 10000 characters"),
    ({"segments": [{"start": 0, "end": 1, "slot": "task"}] * 513}, "segments has 513 entries; at most 512"),
])
def test_bad_params_name_the_problem(body, message):
    with pytest.raises(KvcommParamsError) as error:
        parse_params({"kvcomm": body}, 10, known_slots={"task", "x"})
    assert message in str(error.value)


@pytest.mark.parametrize("body", [
    {"template": 5, "segments": []}, {"template": "x" * 10_000_000}, {"segments": [{"start": "x" * 10_000_000, "end": 1, "slot": "t"}]},
    {"segments": [{"start": 0, "end": 1, "slot": "s" * 10_000_000}]}, {"y" * 10_000_000: 1},
    {"segments": [{"start": list(range(1_000_000)), "end": 1, "slot": "t"}]},
])
def test_errors_show_client_values_cut_short(body):
    """An error names what was wrong, but a 10 MB value becomes a few hundred characters: the
    message goes to the log and back in the response."""
    with pytest.raises(KvcommParamsError) as error:
        parse_params({"kvcomm": body}, 10)
    assert len(str(error.value)) < 600, len(str(error.value))


def test_context_directives_name_content_ids_to_retain_and_release():
    """``kvcomm_server.retain`` / ``release``: what `kvcomm serve`'s context API tells the tenant's
    engine to pin and drop."""
    params = parse_params({"kvcomm": {"segments": []}, SERVER_KEY: {"retain": ["c1"], "release": ["c2", "c3"]}}, 4)
    assert (params.retain, params.release) == (("c1",), ("c2", "c3"))
    assert (parse_params({"kvcomm": {}}, 4).retain, parse_params({"kvcomm": {}}, 4).release) == ((), ())
    for bad in ({"keep": ["c"]}, {"retain": "c"}, {"release": [""]}, {"retain": [1]}, {"retain": ["c"] * 513}):
        with pytest.raises(KvcommParamsError, match="kvcomm_server"):
            parse_params({"kvcomm": {}, SERVER_KEY: bad}, 4)


@pytest.mark.parametrize("server, message", [
    ({"handle": 7}, "handle must be a non-empty string"),
    ({"handle": "h" * 257}, "at most 256 characters"),
])
def test_bad_server_directives_name_the_problem(server, message):
    with pytest.raises(KvcommParamsError, match=message):
        parse_params({"kvcomm": {}, SERVER_KEY: server}, 10)
    assert parse_params({"kvcomm": {}, SERVER_KEY: {"handle": "h"}}, 10).handle == "h"
