"""Declarative multi-agent pipelines: a JSON file of agents, input rows and a token budget.

Agents run in the listed order.  A ``{name}`` slot in a template that names an earlier agent is
that agent's output; every other slot is filled from the current input row.  ``{{``/``}}`` are
literal braces.  Everything here is validated up front: any problem raises :class:`PipelineError`
whose message names the source, the offending agent/row/key, and how to fix it.
"""
from __future__ import annotations

import importlib.resources
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["PipelineError", "Slot", "TemplatePart", "parse_template", "AgentSpec", "PipelineSpec",
           "parse_pipeline", "load_pipeline", "load_demo_pipeline"]

_TOP_KEYS = ("agents", "inputs", "max_new_tokens", "description")
_AGENT_KEYS = ("name", "system", "template")
MAX_NEW_TOKENS_LIMIT = 4096


class PipelineError(ValueError):
    """A pipeline file/object is invalid; the message says where, what, and how to fix it."""


@dataclass(frozen=True)
class Slot:
    """A ``{name}`` placeholder in a template; ``name`` is a Python identifier."""
    name: str


TemplatePart = str | Slot


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so huge values never flood an error message."""
    if isinstance(value, str):
        text = repr(value[:limit])
    elif isinstance(value, int) and value.bit_length() > 64:
        text = "a very large integer"
    elif value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
    else:  # containers: never repr them (could be huge or deeply nested)
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_template(template: str, *, where: str = "template") -> tuple[TemplatePart, ...]:
    """Split ``template`` into literal strings and :class:`Slot` s.

    Invariants: no empty strings, no two adjacent strings, and joining the parts (with each slot
    written back as ``{name}`` and literal braces doubled) reproduces ``template``.
    """
    if not isinstance(template, str):
        raise PipelineError(f"{where}: must be a string, got {type(template).__name__}")
    parts: list[TemplatePart] = []
    text: list[str] = []
    i, n = 0, len(template)
    while i < n:
        ch = template[i]
        if ch in "{}" and template.startswith(ch * 2, i):
            text.append(ch)
            i += 2
        elif ch == "}":
            raise PipelineError(f"{where}: unmatched '}}' at offset {i}; write '}}}}' for a literal brace")
        elif ch == "{":
            end = template.find("}", i + 1)
            inner = template[i + 1:end] if end != -1 else ""
            if end == -1 or "{" in inner:
                raise PipelineError(f"{where}: '{{' at offset {i} is never closed; "
                                    f"close the slot with '}}' or write '{{{{' for a literal brace")
            if not inner:
                raise PipelineError(f"{where}: empty slot '{{}}' at offset {i}; "
                                    f"put a name inside (e.g. '{{task}}') or write '{{{{}}}}' for literal braces")
            if not inner.isidentifier():
                raise PipelineError(f"{where}: slot {_short('{' + inner + '}')} at offset {i} is not a "
                                    f"Python identifier; use letters, digits and '_' only, no spaces")
            if text:
                parts.append("".join(text))
                text = []
            parts.append(Slot(inner))
            i = end + 1
        else:
            j = i + 1
            while j < n and template[j] not in "{}":
                j += 1
            text.append(template[i:j])
            i = j
    if text:
        parts.append("".join(text))
    return tuple(parts)


@dataclass(frozen=True)
class AgentSpec:
    """One agent.  Invariants: ``name`` is an identifier; ``parts == parse_template(template)``."""
    name: str
    system: str
    template: str
    parts: tuple[TemplatePart, ...]

    def __post_init__(self) -> None:
        if tuple(self.parts) != parse_template(self.template, where=f"agent {self.name!r}"):
            raise PipelineError(f"agent {self.name!r}: parts do not match parse_template(template)")

    @property
    def slots(self) -> tuple[str, ...]:
        """Slot names in order of first appearance, without duplicates."""
        return tuple(dict.fromkeys(p.name for p in self.parts if isinstance(p, Slot)))

    def render(self, values: Mapping[str, str]) -> str:
        """Fill every slot from ``values`` (earlier agents' outputs plus the input row)."""
        return "".join(values[p.name] if isinstance(p, Slot) else p for p in self.parts)


@dataclass(frozen=True)
class PipelineSpec:
    """A validated pipeline.

    Invariants: at least one agent and one input row; agent names are unique identifiers and
    never input keys; every slot is an earlier agent or a key of every input row (no cycles, no
    forward references); ``1 <= max_new_tokens <= 4096``; inputs are read-only mappings.
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


def _items(value: object, what: str, source: str) -> list:
    if not isinstance(value, (list, tuple)) or not value:
        raise PipelineError(f"{source}: {what} must be a non-empty JSON list, got {_short(value)}")
    return list(value)


def _check_keys(obj: object, allowed: tuple[str, ...], what: str, source: str) -> Mapping:
    if not isinstance(obj, Mapping):
        raise PipelineError(f"{source}: {what} must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise PipelineError(f"{source}: {what} has unknown key {_short(unknown[0])}; "
                            f"allowed keys are {', '.join(allowed)}")
    return obj


def parse_pipeline(obj: object, source: str = "<pipeline>") -> PipelineSpec:
    """Validate a JSON-like object (as loaded by :func:`json.load`) and build a :class:`PipelineSpec`."""
    top = _check_keys(obj, _TOP_KEYS, "the top level", source)
    for key in ("agents", "inputs"):
        if key not in top:
            raise PipelineError(f"{source}: missing required key {key!r} at the top level")
    rows: list[dict[str, str]] = []
    for r, row in enumerate(_items(top["inputs"], "'inputs'", source)):
        if not isinstance(row, Mapping):
            raise PipelineError(f"{source}: inputs[{r}] must be a JSON object, got {type(row).__name__}")
        for k, v in row.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise PipelineError(f"{source}: inputs[{r}] key {_short(k)} must map a string to a "
                                    f"string, got {type(v).__name__}; quote the value")
        rows.append(dict(row))
    raw_agents = _items(top["agents"], "'agents'", source)
    fields: list[tuple[str, str, str]] = []
    for a, raw in enumerate(raw_agents):
        where = f"agents[{a}]"
        agent = _check_keys(raw, _AGENT_KEYS, where, source)
        name, system, template = agent.get("name"), agent.get("system", ""), agent.get("template")
        if not isinstance(name, str) or not name.isidentifier():
            raise PipelineError(f"{source}: {where} needs a 'name' that is a Python identifier "
                                f"(letters, digits, '_'), got {_short(name)}")
        where = f"agents[{a}] ({name!r})"
        if any(name == f[0] for f in fields):
            raise PipelineError(f"{source}: {where}: duplicate agent name {name!r}; names must be unique")
        if not isinstance(system, str):
            raise PipelineError(f"{source}: {where}: 'system' must be a string, got {type(system).__name__}")
        if not isinstance(template, str) or not template.strip():
            raise PipelineError(f"{source}: {where}: 'template' must be a non-empty string, got {_short(template)}")
        for r, row in enumerate(rows):
            if name in row:
                raise PipelineError(f"{source}: {where}: agent name {name!r} collides with a key of "
                                    f"inputs[{r}]; rename the agent or the input key")
        fields.append((name, system, template))
    names = [f[0] for f in fields]
    common = [k for k in rows[0] if all(k in row for row in rows)]
    agents: list[AgentSpec] = []
    for a, (name, system, template) in enumerate(fields):
        where = f"agents[{a}] ({name!r})"
        spec = AgentSpec(name, system, template, parse_template(template, where=f"{source}: {where} template"))
        for slot in spec.slots:
            if slot == name:
                raise PipelineError(f"{source}: {where}: slot {{{slot}}} refers to the agent itself "
                                    f"(cycle); an agent can only use outputs of earlier agents")
            if slot in names[a + 1:]:
                raise PipelineError(f"{source}: {where}: slot {{{slot}}} is a forward reference to agent "
                                    f"{slot!r}, which runs after {name!r}; move {slot!r} before {name!r}")
            if slot not in names and slot not in common:
                missing = next((r for r, row in enumerate(rows) if slot not in row), 0)
                known = ", ".join(names[:a] + common) or "(none)"
                raise PipelineError(f"{source}: {where}: unknown slot {{{slot}}}: not an earlier agent and "
                                    f"missing from inputs[{missing}]; known slots here: {known}")
        agents.append(spec)
    mnt = top.get("max_new_tokens", 64)
    if type(mnt) is not int or not 1 <= mnt <= MAX_NEW_TOKENS_LIMIT:
        raise PipelineError(f"{source}: 'max_new_tokens' must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, "
                            f"got {_short(mnt)}")
    description = top.get("description", "")
    if not isinstance(description, str):
        raise PipelineError(f"{source}: 'description' must be a string, got {type(description).__name__}")
    return PipelineSpec(tuple(agents), tuple(MappingProxyType(r) for r in rows), mnt, description)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise PipelineError(f"duplicate key {_short(k)} in a JSON object; keep only one")
        out[k] = v
    return out


def loads_pipeline(text: str, source: str = "<pipeline>") -> PipelineSpec:
    """Parse JSON ``text`` (duplicate keys are rejected) and validate it as a pipeline."""
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except PipelineError as e:
        raise PipelineError(f"{source}: {e}") from None
    except json.JSONDecodeError as e:
        raise PipelineError(f"{source}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise PipelineError(f"{source}: unreadable JSON ({type(e).__name__}: {_short(str(e), 120)})") from None
    return parse_pipeline(obj, source)


def load_pipeline(path: str | os.PathLike) -> PipelineSpec:
    """Read a UTF-8 JSON pipeline file (a leading BOM is tolerated)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise PipelineError(f"{source}: pipeline file not found; check the path") from None
    except OSError as e:
        raise PipelineError(f"{source}: cannot read pipeline file ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PipelineError(f"{source}: not valid UTF-8 (byte offset {e.start}); re-save the file as UTF-8") from None
    return loads_pipeline(text, source)


def load_demo_pipeline() -> PipelineSpec:
    """The bundled ``kvcomm/data/demo_pipeline.json``."""
    resource = importlib.resources.files("kvcomm").joinpath("data").joinpath("demo_pipeline.json")
    return loads_pipeline(resource.read_text(encoding="utf-8"), "kvcomm/data/demo_pipeline.json")
