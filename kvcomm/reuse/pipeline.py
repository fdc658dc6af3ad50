"""Declarative multi-agent pipelines: a JSON file of agents, input rows and a token budget.

Agents run in the listed order; a ``{name}`` slot naming an earlier agent is that agent's output,
any other slot comes from the input row; ``{{``/``}}`` are literal braces.  Every problem raises
:class:`PipelineError` naming the source, the agent/row/key at fault, and how to fix it.
"""
from __future__ import annotations

import importlib.resources
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvcomm.core.textfile import parse_json, read_utf8

__all__ = ["PipelineError", "Slot", "TemplatePart", "parse_template", "AgentSpec", "PipelineSpec",
           "parse_pipeline", "loads_pipeline", "load_pipeline", "BUNDLED_PIPELINES", "load_bundled_pipeline",
           "load_demo_pipeline"]

TOP_KEYS = ("agents", "inputs", "max_tokens", "max_new_tokens", "description")
AGENT_KEYS = ("name", "system", "template")
MAX_NEW_TOKENS_LIMIT = 4096
_TOKEN = re.compile(r"\{\{|\}\}|\{[^{}]*\}|\{|\}|[^{}]+")


class PipelineError(ValueError):
    """An invalid pipeline; the message says where (file/source, agent, row, key), what, and how to fix it."""


@dataclass(frozen=True)
class Slot:
    """A ``{name}`` placeholder in a template; ``name`` is a Python identifier."""
    name: str


TemplatePart = str | Slot


def _short(value: object, limit: int = 60) -> str:
    """A bounded description of ``value`` for messages: never reprs containers or huge ints."""
    if isinstance(value, str):
        text = repr(value[:limit])
    elif value is None or isinstance(value, (bool, float)) or (isinstance(value, int) and value.bit_length() < 64):
        text = repr(value)
    else:
        text = "a very large integer" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_template(template: str, *, where: str = "template") -> tuple[TemplatePart, ...]:
    """Split ``template`` into literal strings and :class:`Slot` s; ``where`` prefixes error messages.

    Invariants: no empty strings, never two adjacent strings, and writing each slot back as ``{name}``
    and doubling literal braces reproduces ``template``.  Accepts exactly the ``str.format`` templates
    whose fields are bare identifiers, and :meth:`AgentSpec.render` renders them identically.
    """
    if not isinstance(template, str):
        raise PipelineError(f"{where}: must be a string, got {type(template).__name__}")
    parts: list[TemplatePart] = []
    text: list[str] = []
    for m in _TOKEN.finditer(template):
        tok, at = m.group(), m.start()
        if tok == "{":
            raise PipelineError(f"{where}: '{{' at offset {at} is never closed; close it with '}}' or write '{{{{'")
        if tok == "}":
            raise PipelineError(f"{where}: unmatched '}}' at offset {at}; write '}}}}' for a literal brace")
        if tok == "{}":
            raise PipelineError(f"{where}: empty slot '{{}}' at offset {at}; put a name inside (e.g. '{{task}}') "
                                f"or write '{{{{}}}}' for literal braces")
        if tok in ("{{", "}}") or tok[0] != "{":
            text.append(tok[0] if tok in ("{{", "}}") else tok)
            continue
        if not tok[1:-1].isidentifier():
            raise PipelineError(f"{where}: slot {_short(tok)} at offset {at} is not a Python identifier; "
                                f"use letters, digits and '_' only (no spaces, dots or format specs)")
        if text:
            parts.append("".join(text))
            text = []
        parts.append(Slot(tok[1:-1]))
    if text:
        parts.append("".join(text))
    return tuple(parts)


@dataclass(frozen=True)
class AgentSpec:
    """One agent.  Invariants: ``parts`` is a tuple equal to ``parse_template(template)``."""
    name: str
    system: str
    template: str
    parts: tuple[TemplatePart, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if self.parts != parse_template(self.template, where=f"agent {self.name!r}"):
            raise PipelineError(f"agent {self.name!r}: parts do not match parse_template(template)")

    @property
    def slots(self) -> tuple[str, ...]:
        """Slot names in order of first appearance, without duplicates."""
        return tuple(dict.fromkeys(p.name for p in self.parts if isinstance(p, Slot)))

    def render(self, values: Mapping[str, str]) -> str:
        """The template with every slot replaced by ``values[slot]`` (KeyError if one is missing)."""
        return "".join(values[p.name] if isinstance(p, Slot) else p for p in self.parts)


@dataclass(frozen=True)
class PipelineSpec:
    """A validated pipeline.

    Invariants: at least one agent and one input row; agent names are unique identifiers and never
    input keys; every slot names an earlier agent or a key of every input row (so no cycles and no
    forward references); ``1 <= max_new_tokens <= 4096``; input rows are read-only str->str mappings.
    """
    agents: tuple[AgentSpec, ...]
    inputs: tuple[Mapping[str, str], ...]
    max_new_tokens: int = 64
    description: str = ""

    @property
    def input_slots(self) -> tuple[str, ...]:
        """Slots filled from input rows (not agent names), in order of first use."""
        names = {a.name for a in self.agents}
        return tuple(dict.fromkeys(s for a in self.agents for s in a.slots if s not in names))


def _nonempty_list(value: object, what: str, source: str) -> list:
    if not isinstance(value, (list, tuple)) or not value:
        raise PipelineError(f"{source}: {what} must be a non-empty JSON list, got {_short(value)}")
    return list(value)


def _object(obj: object, allowed: tuple[str, ...] | None, what: str, source: str) -> Mapping:
    if not isinstance(obj, Mapping):
        raise PipelineError(f"{source}: {what} must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if allowed is not None and k not in allowed]
    if unknown:
        raise PipelineError(f"{source}: {what} has unknown key {_short(unknown[0])}; "
                            f"allowed keys are {', '.join(allowed)}")
    return obj


def parse_pipeline(obj: object, source: str = "<pipeline>") -> PipelineSpec:
    """Validate a JSON-like object (as from :func:`json.load`) into a :class:`PipelineSpec`."""
    top = _object(obj, TOP_KEYS, "the top level", source)
    for key in ("agents", "inputs"):
        if key not in top:
            raise PipelineError(f"{source}: missing required key {key!r} at the top level")
    raw_rows = _nonempty_list(top["inputs"], "'inputs'", source)
    rows = [dict(_object(row, None, f"inputs[{r}]", source)) for r, row in enumerate(raw_rows)]
    for r, row in enumerate(rows):
        for k, v in row.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise PipelineError(f"{source}: inputs[{r}] key {_short(k)} must map a string to a string, "
                                    f"got {type(v).__name__}; quote the value")
    fields: list[tuple[str, str, str]] = []
    for a, raw in enumerate(_nonempty_list(top["agents"], "'agents'", source)):
        agent = _object(raw, AGENT_KEYS, f"agents[{a}]", source)
        name, system, template = agent.get("name"), agent.get("system", ""), agent.get("template")
        if not isinstance(name, str) or not name.isidentifier():
            raise PipelineError(f"{source}: agents[{a}] needs a 'name' that is a Python identifier "
                                f"(letters, digits, '_'), got {_short(name)}")
        where = f"{source}: agents[{a}] ({name!r})"
        if any(name == f[0] for f in fields):
            raise PipelineError(f"{where}: duplicate agent name {name!r}; agent names must be unique")
        if not isinstance(system, str):
            raise PipelineError(f"{where}: 'system' must be a string, got {type(system).__name__}")
        if not isinstance(template, str) or not template.strip():
            raise PipelineError(f"{where}: 'template' must be a non-empty string, got {_short(template)}")
        clash = next((r for r, row in enumerate(rows) if name in row), None)
        if clash is not None:
            raise PipelineError(f"{where}: agent name {name!r} collides with a key of inputs[{clash}]; "
                                f"rename the agent or the input key")
        fields.append((name, system, template))
    names = [f[0] for f in fields]
    common = [k for k in rows[0] if all(k in row for row in rows)]
    agents: list[AgentSpec] = []
    for a, (name, system, template) in enumerate(fields):
        where = f"{source}: agents[{a}] ({name!r})"
        spec = AgentSpec(name, system, template, parse_template(template, where=f"{where} template"))
        for slot in spec.slots:
            if slot == name:
                raise PipelineError(f"{where}: slot {{{slot}}} refers to the agent itself (cycle); "
                                    f"an agent can only use outputs of earlier agents")
            if slot in names[a + 1:]:
                raise PipelineError(f"{where}: slot {{{slot}}} is a forward reference to agent {slot!r}, "
                                    f"which runs after {name!r}; move {slot!r} before {name!r}")
            if slot not in names and slot not in common:
                missing = next((r for r, row in enumerate(rows) if slot not in row), 0)
                raise PipelineError(f"{where}: unknown slot {{{slot}}}: not an earlier agent and missing from "
                                    f"inputs[{missing}]; known slots here: {', '.join(names[:a] + common) or '(none)'}")
        agents.append(spec)
    mnt = _reply_budget(top, source)
    description = top.get("description", "")
    if not isinstance(description, str):
        raise PipelineError(f"{source}: 'description' must be a string, got {type(description).__name__}")
    return PipelineSpec(tuple(agents), tuple(MappingProxyType(r) for r in rows), mnt, description)


def _reply_budget(top: Mapping, source: str) -> int:
    """The reply budget: ``max_tokens`` (the clients' name), or its alias ``max_new_tokens``
    (the engine's); both must agree when both are given; 64 when neither is."""
    given = {key: top[key] for key in ("max_tokens", "max_new_tokens") if key in top}
    for key, value in given.items():
        if type(value) is not int or not 1 <= value <= MAX_NEW_TOKENS_LIMIT:
            raise PipelineError(f"{source}: {key!r} must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, got {_short(value)}")
    if len(set(given.values())) > 1:
        raise PipelineError(f"{source}: 'max_tokens' is {given['max_tokens']} and its alias 'max_new_tokens' is "
                            f"{given['max_new_tokens']}; give one of them")
    return next(iter(given.values()), 64)


def loads_pipeline(text: str, source: str = "<pipeline>") -> PipelineSpec:
    """Parse JSON ``text`` (duplicate keys rejected) and validate it with :func:`parse_pipeline`."""
    obj = parse_json(text, source, PipelineError)
    return parse_pipeline(obj, source)


def load_pipeline(path: str | os.PathLike) -> PipelineSpec:
    """Read and validate a UTF-8 JSON pipeline file (a leading BOM is tolerated)."""
    source = os.fspath(path)
    text = read_utf8(source, "pipeline file", PipelineError)
    return loads_pipeline(text, source)


BUNDLED_PIPELINES = {"review": "review_pipeline.json", "chain": "demo_pipeline.json"}
"""Pipelines shipped in ``kvcomm/data``: ``review`` (what `kvcomm demo` runs: four agents read
one ~1,000-token technical document per row behind their own prompts, plus the earlier
agents' replies) and ``chain`` (four agents on one-sentence tasks; short prompts for tests)."""


def load_bundled_pipeline(name: str) -> PipelineSpec:
    """One of :data:`BUNDLED_PIPELINES` by name; PipelineError for an unknown name."""
    if name not in BUNDLED_PIPELINES:
        raise PipelineError(f"no bundled pipeline named {name!r}; choose one of {', '.join(BUNDLED_PIPELINES)}")
    file = BUNDLED_PIPELINES[name]
    resource = importlib.resources.files("kvcomm").joinpath("data").joinpath(file)
    return loads_pipeline(resource.read_text(encoding="utf-8"), f"kvcomm/data/{file}")


def load_demo_pipeline() -> PipelineSpec:
    """The bundled ``chain`` pipeline (``kvcomm/data/demo_pipeline.json``): four agents,
    short prompts (under 200 tokens). `kvcomm demo` runs ``load_bundled_pipeline("review")``."""
    return load_bundled_pipeline("chain")
