"""Fuzzing the pipeline-file reader end to end: text and bytes in, ``PipelineSpec`` or a
``PipelineError`` with a message out, never any other exception; valid pipelines round-trip."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcomm.reuse.pipeline import PipelineError, PipelineSpec, load_pipeline, loads_pipeline

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any unicode but lone surrogates


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


@st.composite
def valid_pipelines(draw) -> dict:
    """Any valid pipeline: agents that use earlier agents and input keys, any unicode text."""
    names = draw(st.lists(identifiers, min_size=1, max_size=4, unique=True))
    keys = draw(st.lists(identifiers.filter(lambda k: k not in names), min_size=0, max_size=3, unique=True))
    agents = []
    for i, name in enumerate(names):
        usable = names[:i] + keys
        slots = draw(st.lists(st.sampled_from(usable), max_size=3)) if usable else []
        pieces = draw(st.lists(texts, min_size=len(slots) + 1, max_size=len(slots) + 1))
        template = _literal(pieces[0]) + "".join("{" + s + "}" + _literal(t) for s, t in zip(slots, pieces[1:]))
        assume(template.strip())
        agent = {"name": name, "template": template}
        if draw(st.booleans()):
            agent["system"] = draw(texts)
        agents.append(agent)
    rows = draw(st.lists(st.fixed_dictionaries({k: texts for k in keys}, optional={"extra_" + k: texts for k in keys}),
                         min_size=1, max_size=3))
    obj = {"agents": agents, "inputs": rows}
    if draw(st.booleans()):
        obj["max_new_tokens"] = draw(st.integers(1, 4096))
    if draw(st.booleans()):
        obj["description"] = draw(texts)
    return obj


def _to_obj(spec: PipelineSpec) -> dict:
    """A spec written back as the JSON object that describes it (defaults filled in)."""
    return {
        "agents": [{"name": a.name, "system": a.system, "template": a.template} for a in spec.agents],
        "inputs": [dict(row) for row in spec.inputs], "max_new_tokens": spec.max_new_tokens,
        "description": spec.description,
    }


def _expect_spec_or_error(read, *args) -> PipelineSpec | None:
    try:
        spec = read(*args)
    except PipelineError as error:
        assert str(error).strip(), "a PipelineError must say what is wrong"
        return None
    assert isinstance(spec, PipelineSpec)
    return spec


@FAST
@given(valid_pipelines(), st.sampled_from([None, 0, 2]), st.booleans())
def test_valid_pipelines_round_trip(obj, indent, ascii_only):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    spec = loads_pipeline(text)
    expected = {"max_new_tokens": 64, "description": "", **obj,
                "agents": [{"system": "", **a} for a in obj["agents"]]}
    assert _to_obj(spec) == expected
    assert loads_pipeline(json.dumps(_to_obj(spec))) == spec  # and back again, unchanged


@st.composite
def mangled(draw) -> str:
    """Valid pipeline text with a random cut, splice or insertion: near misses of every kind."""
    text = json.dumps(draw(valid_pipelines()))
    at = draw(st.integers(0, len(text)))
    kind = draw(st.sampled_from(["cut", "insert", "delete", "replace"]))
    noise = draw(st.text(st.sampled_from('{}[]",:\\ 0-9eE.tfn') | st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=4))
    if kind == "cut":
        return text[:at]
    if kind == "insert":
        return text[:at] + noise + text[at:]
    if kind == "delete":
        return text[:at] + text[at + len(noise):]
    return text[:at] + noise + text[at + len(noise):]


json_ish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts | st.sampled_from(["agents", "inputs"]), inner, max_size=3),
    max_leaves=12,
).map(lambda v: json.dumps(v, allow_nan=True))


@FAST
@given(st.one_of(mangled(), json_ish, st.text(max_size=40),
                 st.sampled_from(["[" * 100_000, '{"a":' * 50_000, "1" * 5000, '{"agents": NaN}', "\ufeff{}", ""])))
def test_any_text_gives_a_spec_or_a_pipeline_error(text):
    _expect_spec_or_error(loads_pipeline, text, "fuzz.json")


@FAST
@given(st.one_of(st.binary(max_size=60), mangled().map(lambda t: t.encode("utf-8")),
                 mangled().map(lambda t: b"\xef\xbb\xbf" + t.encode("utf-8")),
                 mangled().map(lambda t: t.encode("utf-16")), mangled().map(lambda t: t.encode("latin-1", "replace"))))
def test_any_file_bytes_give_a_spec_or_a_pipeline_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.json"
        path.write_bytes(data)
        spec = _expect_spec_or_error(load_pipeline, path)
    if spec is None:
        return
    assert data.decode("utf-8-sig")  # only UTF-8 (BOM allowed) is ever accepted


def test_directories_and_missing_files_are_pipeline_errors(tmp_path):
    for path in (tmp_path, tmp_path / "missing.json"):
        assert _expect_spec_or_error(load_pipeline, path) is None
