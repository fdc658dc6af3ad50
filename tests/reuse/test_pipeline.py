"""Tests for kvcomm.reuse.pipeline: template parsing, validation messages, the demo file, and fuzzing."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.reuse.pipeline import (AgentSpec, PipelineError, PipelineSpec, Slot, load_demo_pipeline,
                             load_pipeline, parse_pipeline, parse_template)

EXAMPLE = {
    "agents": [
        {"name": "planner", "system": "You plan.", "template": "Task: {task}\nPlan the steps."},
        {"name": "critic", "system": "You critique.", "template": "Task: {task}\nPlan: {planner}\nFind flaws."},
        {"name": "judge", "system": "You judge.",
         "template": "Task: {task}\nPlan: {planner}\nCritique: {critic}\nAnswer."},
    ],
    "inputs": [{"task": "Add 2 and 3."}, {"task": "Name a color."}],
    "max_new_tokens": 64,
}


def example(**changes):
    obj = copy.deepcopy(EXAMPLE)
    obj.update(changes)
    return obj


def error(obj, source="<pipeline>") -> str:
    with pytest.raises(PipelineError) as info:
        parse_pipeline(obj, source)
    return str(info.value)


# ---------------------------------------------------------------- round trip / files

def test_example_round_trip(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(EXAMPLE), encoding="utf-8")
    spec = load_pipeline(path)
    assert spec == parse_pipeline(EXAMPLE) and isinstance(spec, PipelineSpec)
    assert [a.name for a in spec.agents] == ["planner", "critic", "judge"]
    assert [a.slots for a in spec.agents] == [("task",), ("task", "planner"), ("task", "planner", "critic")]
    assert spec.input_slots == ("task",)
    assert [dict(r) for r in spec.inputs] == EXAMPLE["inputs"]
    assert spec.max_new_tokens == 64 and spec.description == ""
    assert spec.agents[1].parts == ("Task: ", Slot("task"), "\nPlan: ", Slot("planner"), "\nFind flaws.")
    # Rebuild the JSON object from the spec and parse it again: identical spec.
    rebuilt = {"agents": [{"name": a.name, "system": a.system, "template": a.template} for a in spec.agents],
               "inputs": [dict(r) for r in spec.inputs], "max_new_tokens": spec.max_new_tokens}
    assert rebuilt == EXAMPLE and parse_pipeline(rebuilt) == spec
    assert spec.agents[2].render({"task": "T", "planner": "P", "critic": "C"}) == "Task: T\nPlan: P\nCritique: C\nAnswer."


def test_spec_is_frozen_and_inputs_read_only():
    spec = parse_pipeline(EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_new_tokens = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.inputs[0]["task"] = "x"  # type: ignore[index]
    with pytest.raises(PipelineError, match="parts do not match"):
        AgentSpec("a", "", "x {y}", ("x ",))


def test_defaults():
    obj = example()
    del obj["max_new_tokens"]
    del obj["agents"][0]["system"]
    spec = parse_pipeline(obj)
    assert spec.max_new_tokens == 64 and spec.agents[0].system == ""


def test_max_tokens_is_the_reply_budget_and_max_new_tokens_its_alias():
    obj = example()
    del obj["max_new_tokens"]
    assert parse_pipeline({**obj, "max_tokens": 12}).max_new_tokens == 12
    assert parse_pipeline({**obj, "max_new_tokens": 7}).max_new_tokens == 7
    assert parse_pipeline({**obj, "max_tokens": 9, "max_new_tokens": 9}).max_new_tokens == 9
    with pytest.raises(PipelineError, match="'max_tokens' is 9 and its alias 'max_new_tokens' is 8"):
        parse_pipeline({**obj, "max_tokens": 9, "max_new_tokens": 8})
    with pytest.raises(PipelineError, match="'max_tokens' must be an integer in 1..4096"):
        parse_pipeline({**obj, "max_tokens": 0})


def test_load_errors(tmp_path):
    with pytest.raises(PipelineError, match="not found") as info:
        load_pipeline(tmp_path / "missing.json")
    assert "missing.json" in str(info.value)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "agents": [,]\n}', encoding="utf-8")
    with pytest.raises(PipelineError, match=r"bad\.json.*line 2, column 14"):
        load_pipeline(bad)
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"description": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(PipelineError, match=r"latin\.json.*UTF-8"):
        load_pipeline(latin)
    dup = tmp_path / "dup.json"
    dup.write_text('{"inputs": [], "inputs": []}', encoding="utf-8")
    with pytest.raises(PipelineError, match=r"dup\.json.*duplicate key 'inputs'"):
        load_pipeline(dup)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(PipelineError, match=r"deep\.json"):
        load_pipeline(deep)
    with pytest.raises(PipelineError, match="is a directory; give the path of a pipeline file"):
        load_pipeline(tmp_path)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(EXAMPLE).encode())
    assert load_pipeline(bom) == parse_pipeline(EXAMPLE)


# ---------------------------------------------------------------- parse_template

@pytest.mark.parametrize("template, parts", [
    ("Task: {task}\nPlan", ("Task: ", Slot("task"), "\nPlan")),
    ("{a}{b}", (Slot("a"), Slot("b"))),
    ("{a}", (Slot("a"),)),
    ("", ()),
    ("plain", ("plain",)),
    ("{{literal}} {x}", ("{literal} ", Slot("x"))),
    ("{{{x}}}", ("{", Slot("x"), "}")),
    ("a {{ b }} c", ("a { b } c",)),
    ("{_x1}{a}{_x1}", (Slot("_x1"), Slot("a"), Slot("_x1"))),
    ("{ünï}", (Slot("ünï"),)),
])
def test_parse_template(template, parts):
    assert parse_template(template) == parts


@pytest.mark.parametrize("template, message", [
    ("{", "never closed"), ("a {b", "never closed"), ("{a {b}", "never closed"),
    ("}", "unmatched '}'"), ("a}b", "unmatched '}'"), ("{a}}", "unmatched '}'"),
    ("{}", "empty slot"), ("{ task }", "not a Python identifier"), ("{1x}", "not a Python identifier"),
    ("{a.b}", "not a Python identifier"), ("{a:>3}", "not a Python identifier"),
])
def test_parse_template_errors(template, message):
    with pytest.raises(PipelineError, match=message):
        parse_template(template)


def test_parse_template_rejects_non_string():
    with pytest.raises(PipelineError, match="must be a string"):
        parse_template(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- validation messages

def agents_with(template, name="extra"):
    obj = example()
    obj["agents"].append({"name": name, "template": template})
    return obj


@pytest.mark.parametrize("obj, fragments", [
    ([], ["<pipeline>", "top level", "JSON object", "list"]),
    (example(extra=1), ["unknown key 'extra'", "allowed keys are agents, inputs, max_tokens, max_new_tokens, description"]),
    ({"inputs": [{"task": "x"}]}, ["missing required key 'agents'"]),
    ({"agents": EXAMPLE["agents"]}, ["missing required key 'inputs'"]),
    (example(agents=[]), ["'agents' must be a non-empty JSON list"]),
    (example(agents={"name": "a"}), ["'agents' must be a non-empty JSON list"]),
    (example(agents=["planner"]), ["agents[0] must be a JSON object", "str"]),
    (example(agents=[{"name": "a", "template": "x", "model": "m"}]), ["agents[0]", "unknown key 'model'"]),
    (example(agents=[{"template": "x"}]), ["agents[0]", "'name'", "identifier", "None"]),
    (example(agents=[{"name": "my agent", "template": "x"}]), ["agents[0]", "identifier", "'my agent'"]),
    (example(agents=[{"name": 5, "template": "x"}]), ["agents[0]", "identifier", "5"]),
    (example(agents=[{"name": "a", "template": "x"}, {"name": "a", "template": "y"}]),
     ["agents[1] ('a')", "duplicate agent name 'a'"]),
    (example(agents=[{"name": "a", "system": 1, "template": "x"}]), ["agents[0] ('a')", "'system'", "int"]),
    (example(agents=[{"name": "a"}]), ["agents[0] ('a')", "'template' must be a non-empty string"]),
    (example(agents=[{"name": "a", "template": "  \n"}]), ["agents[0] ('a')", "non-empty"]),
    (example(agents=[{"name": "a", "template": "x {"}]), ["agents[0] ('a') template", "never closed"]),
    (example(agents=[{"name": "a", "template": "{a}"}]), ["agents[0] ('a')", "cycle", "{a}"]),
    (example(agents=[{"name": "a", "template": "{b}"}, {"name": "b", "template": "{task}"}]),
     ["agents[0] ('a')", "forward reference", "'b'", "move 'b' before 'a'"]),
    (agents_with("{nope}"), ["agents[3] ('extra')", "unknown slot {nope}", "inputs[0]",
                             "known slots here: planner, critic, judge, task"]),
    (example(inputs=[{"task": "x", "topic": "y"}, {"task": "z"}], agents=[{"name": "a", "template": "{topic}"}]),
     ["unknown slot {topic}", "missing from inputs[1]"]),
    (example(inputs=[{"task": "x", "planner": "y"}]), ["agents[0] ('planner')", "collides", "inputs[0]"]),
    (example(inputs=[]), ["'inputs' must be a non-empty JSON list"]),
    (example(inputs="task"), ["'inputs' must be a non-empty JSON list"]),
    (example(inputs=[["task"]]), ["inputs[0] must be a JSON object", "list"]),
    (example(inputs=[{"task": "x"}, {"task": 3}]), ["inputs[1]", "'task'", "int"]),
    (example(inputs=[{"task": None}]), ["inputs[0]", "NoneType"]),
    (example(max_new_tokens=0), ["'max_new_tokens' must be an integer in 1..4096", "got 0"]),
    (example(max_new_tokens=4097), ["1..4096", "4097"]),
    (example(max_new_tokens=True), ["1..4096", "True"]),
    (example(max_new_tokens=64.0), ["1..4096", "64.0"]),
    (example(max_new_tokens="64"), ["1..4096", "'64'"]),
    (example(max_new_tokens=10 ** 5000), ["1..4096", "very large integer"]),
    (example(description=["x"]), ["'description' must be a string", "list"]),
])
def test_validation_errors(obj, fragments):
    message = error(obj)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_error_names_source_and_truncates_huge_values():
    message = error(example(agents=[{"name": "x" * 100_000 + " ", "template": "t"}]), "my/file.json")
    assert message.startswith("my/file.json: ") and len(message) < 400


def test_extra_input_keys_and_description_allowed():
    spec = parse_pipeline(example(inputs=[{"task": "a", "unused": "b", "not an id": "c"}], description="d"))
    assert spec.description == "d" and spec.inputs[0]["unused"] == "b" and spec.input_slots == ("task",)
    assert parse_pipeline(example(max_new_tokens=1)).max_new_tokens == 1
    assert parse_pipeline(example(max_new_tokens=4096)).max_new_tokens == 4096


# ---------------------------------------------------------------- demo pipeline

def test_demo_pipeline():
    spec = load_demo_pipeline()
    assert len(spec.agents) == 4 and len(spec.inputs) == 4 and spec.max_new_tokens == 48
    assert spec.description and spec.input_slots == ("task",)
    names = [a.name for a in spec.agents]
    for i, agent in enumerate(spec.agents):
        assert "task" in agent.slots and agent.system
        if i:
            assert set(agent.slots) & set(names[:i]), agent.name
    for row in spec.inputs:
        assert 2 <= row["task"].count(". ") + row["task"].count("? ") + 1 <= 4


# ---------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=10,
)
rare = st.tuples(st.booleans(), st.booleans(), st.booleans()).map(all)  # True about 1 time in 8
pool = ["a", "b", "task", "x"]
good_parts = [f"{{{n}}}" for n in ["task", "task", "a", "b", "x"]] + ["hi ", "\n", "{{", "}}"]
templates = st.lists(st.sampled_from(good_parts * 4 + ["{", "}", "{}", "{1}"]), min_size=1, max_size=4).map("".join)


@st.composite
def near_valid(draw):
    """Pipeline-shaped objects where each field is occasionally wrong (to reach every check)."""
    def field(good):
        return draw(json_values) if draw(rare) else draw(good)

    def maybe_add(obj, key, good):
        if draw(st.booleans()):
            obj[key] = field(good)
        return obj

    agents = []
    for _ in range(draw(st.integers(1, 3))):
        agent = {"name": field(st.sampled_from(pool * 4 + ["1", ""])), "template": field(templates)}
        agents.append(maybe_add(agent, "system", st.text(max_size=5)))
        if draw(rare):
            agent["model"] = "unknown key"
    rows = [maybe_add({"task": field(st.text(max_size=4))}, "x", st.text(max_size=4))
            for _ in range(draw(st.integers(1, 3)))]
    if draw(rare):
        rows[0]["a"] = "collides with an agent name"
    obj = maybe_add(maybe_add({"agents": agents, "inputs": rows}, "max_new_tokens", st.integers(-5, 5000)),
                    "description", st.text(max_size=5))
    if draw(rare):
        obj[draw(st.sampled_from(["extra", "agents", "inputs"]))] = draw(json_values)
    return obj


keys = st.sampled_from(["agents", "inputs", "max_new_tokens", "description", "name", "template"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.dictionaries(keys, json_values, max_size=4), json_values))
def test_fuzz_parse_pipeline_arbitrary_values(obj):
    try:
        assert isinstance(parse_pipeline(obj), PipelineSpec)
    except PipelineError as e:
        assert str(e).startswith("<pipeline>: ")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid())
def test_fuzz_parse_pipeline_near_valid(obj):
    try:
        spec = parse_pipeline(obj)
    except PipelineError as e:
        assert str(e).startswith("<pipeline>: ")
    else:
        assert isinstance(spec, PipelineSpec) and [a.name for a in spec.agents] == [a["name"] for a in obj["agents"]]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from("{}ab_1 .:\n") | st.characters(), max_size=30))
def test_fuzz_parse_template(text):
    try:
        parts = parse_template(text)
    except PipelineError:
        return
    assert all(p for p in parts) and all(isinstance(p, (str, Slot)) for p in parts)
    assert not any(isinstance(a, str) and isinstance(b, str) for a, b in zip(parts, parts[1:]))
    rebuilt = "".join("{" + p.name + "}" if isinstance(p, Slot) else p.replace("{", "{{").replace("}", "}}")
                      for p in parts)
    assert rebuilt == text
    assert parse_template(rebuilt) == parts
    values = {p.name: f"<{i}>" for i, p in enumerate(parts) if isinstance(p, Slot)}
    assert AgentSpec("a", "", text, parts).render(values) == text.format(**values)


identifiers = st.builds(str.__add__, st.sampled_from("abcxyz_"), st.text(alphabet="abcxyz_019", max_size=5))


@st.composite
def valid_pipelines(draw):
    names = draw(st.lists(identifiers, min_size=1, max_size=5, unique=True))
    input_keys = draw(st.lists(identifiers.filter(lambda k: k not in names), min_size=1, max_size=3, unique=True))
    agents, expected = [], []
    for i, name in enumerate(names):
        slots = draw(st.lists(st.sampled_from(names[:i] + input_keys), min_size=1, max_size=4))
        texts = draw(st.lists(st.text(alphabet="ab {}\n", max_size=6), min_size=len(slots) + 1,
                              max_size=len(slots) + 1))
        escaped = [t.replace("{", "{{").replace("}", "}}") for t in texts]
        template = escaped[0] + "".join("{" + s + "}" + t for s, t in zip(slots, escaped[1:]))
        agents.append({"name": name, "system": draw(st.text(max_size=8)), "template": template})
        expected.append(tuple(dict.fromkeys(slots)))
    rows = draw(st.lists(st.fixed_dictionaries({k: st.text(max_size=6) for k in input_keys}), min_size=1, max_size=3))
    return {"agents": agents, "inputs": rows, "max_new_tokens": draw(st.integers(1, 4096))}, expected


@settings(max_examples=40, deadline=None)
@given(valid_pipelines())
def test_fuzz_valid_pipelines_parse(case):
    obj, expected_slots = case
    spec = parse_pipeline(json.loads(json.dumps(obj)))
    assert [a.name for a in spec.agents] == [a["name"] for a in obj["agents"]]
    assert [a.template for a in spec.agents] == [a["template"] for a in obj["agents"]]
    assert [a.system for a in spec.agents] == [a["system"] for a in obj["agents"]]
    assert [a.slots for a in spec.agents] == expected_slots
    assert [dict(r) for r in spec.inputs] == obj["inputs"]
    assert spec.max_new_tokens == obj["max_new_tokens"]
    names = {a.name for a in spec.agents}
    assert spec.input_slots == tuple(dict.fromkeys(s for slots in expected_slots for s in slots if s not in names))
    values = {k: "<" + k + ">" for k in names | set(obj["inputs"][0])}
    for agent in spec.agents:  # rendering agrees with str.format on these (valid) templates
        assert agent.render(values) == agent.template.format(**values)
