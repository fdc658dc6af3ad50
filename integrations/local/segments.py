"""Chat conversations as kvcomm prompts: one token span per message (AutoGen, AG2 backends).

The conversation is rendered once with the model's own chat template, each message's content
replaced by a private-use marker, and split at the markers. Template text (role headers,
end-of-turn tokens, the system message) becomes fixed segments; each non-system message's
content becomes a shared segment, tokenized on its own, so the same text has the same token
ids, hence the same ``shared_id``, wherever it appears and whoever sends it.

The prompt is therefore defined as the concatenation of the separately tokenized pieces.
For ordinary text it equals tokenizing the whole rendered conversation; it can differ where
BPE would merge across a message boundary (content starting with a newline, whitespace-only
content). Both runs of a comparison (dense and reuse) use this same definition.

Slots: a shared message fills slot ``"{source}#{k}"``: its author (AutoGen ``source``, AG2
``name``, else the role) and how many messages that author wrote earlier in the same
conversation; the template id names the agent by its first system message. So KVCOMM's
placeholder "agent 2's first reply in critic's prompt" is ``("chat:<critic hash>", "planner#0")``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvcomm.core.segments import Prompt, Segment, content_id

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ChatTurn:
    """One message. role: "system", "user", "assistant" or "tool". source: its author's name
    (None: the role stands in). tool_calls: OpenAI-style ``{"id", "type", "function": {"name",
    "arguments"}}`` dicts of an assistant message. tool_call_id: what a "tool" message answers."""

    role: str
    content: str
    source: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def template_message(self, content: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation. prompt: the segments. turn_segments: message index -> index
    of its shared segment in ``prompt.segments`` (messages that are fixed or empty are absent).
    note: why the conversation was not split (then it is one fixed segment), else ""."""

    prompt: Prompt
    turn_segments: dict[int, int] = field(default_factory=dict)
    note: str = ""

    @property
    def shared_ids(self) -> list[str]:
        return [self.prompt.segments[i].shared_id for i in self.turn_segments.values()]


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def template_id(tokenizer, encode: Callable[[str], list[int]], turns: Sequence[ChatTurn]) -> str:
    """The agent a conversation belongs to: the hash of its first system message's tokens."""
    system = next((t.content for t in turns if t.role == "system"), None)
    if system is None:
        return "chat:default"
    return "chat:" + content_id(encode(system) or [0])[:16]


def render_chat(
    tokenizer, encode: Callable[[str], list[int]], turns: Sequence[ChatTurn], tools: Sequence[dict] | None = None,
) -> ChatPrompt:
    """Render ``turns`` (and the assistant's generation prompt) into fixed and shared segments.

    tools: JSON schemas (``{"type": "function", "function": {...}}``) passed to the chat
    template; refused with ValueError when the template cannot render them (``supports_tools``).
    """
    if not turns:
        raise ValueError("a chat request needs at least one message")
    if tools and not supports_tools(tokenizer):
        raise ValueError(
            "this model's chat template has no tool support, so it cannot be given tools; "
            "drop the tools or use a model whose chat template renders `tools`"
        )
    tid = template_id(tokenizer, encode, turns)
    whole = _apply(tokenizer, [t.template_message(t.content) for t in turns], tools)
    for strip in (False, True):
        split = _split(tokenizer, encode, turns, tools, whole, tid, strip)
        if split is not None:
            return split
    reason = "chat template rewrites message content (or content holds U+E000/U+E001): no per-message segments"
    return ChatPrompt(Prompt(tid, (Segment(tuple(encode(whole))),)), {}, reason)


def _split(tokenizer, encode, turns, tools, whole: str, tid: str, strip: bool) -> ChatPrompt | None:
    contents = [t.content.strip() if strip else t.content for t in turns]
    if any(_OPEN in c or _CLOSE in c for c in contents):
        return None
    marked = [
        t.template_message(_OPEN + str(i) + _CLOSE if t.role != "system" and c else c)
        for i, (t, c) in enumerate(zip(turns, contents))
    ]
    pieces = _MARK.split(_apply(tokenizer, marked, tools))  # text, index, text, index, ..., text
    indices = [int(p) for p in pieces[1::2]]
    expected = [i for i, (t, c) in enumerate(zip(turns, contents)) if t.role != "system" and c]
    if indices != expected:
        return None
    if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces)) != whole:
        return None
    segments: list[Segment] = []
    turn_segments: dict[int, int] = {}
    spoken: dict[str, int] = {}
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids = encode(piece) if piece else []
            if ids:
                segments.append(Segment(tuple(ids)))
            continue
        index = int(piece)
        ids = encode(contents[index])
        if not ids:
            continue
        author = turns[index].source or turns[index].role
        slot = f"{author}#{spoken.get(author, 0)}"
        spoken[author] = spoken.get(author, 0) + 1
        turn_segments[index] = len(segments)
        segments.append(Segment(tuple(ids), slot=slot))
    return ChatPrompt(Prompt(tid, tuple(segments)), turn_segments)


def _apply(tokenizer, messages: list[dict[str, Any]], tools: Sequence[dict] | None) -> str:
    options = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as a dict, which tool-aware templates expect (OpenAI sends a string)."""
    function = dict(call.get("function", {}))
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in a
    reply -> (calls as ``{"name", "arguments" (JSON string)}``, the text around them).

    Blocks that are not a JSON object with a string ``name`` are left in the text.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append({"name": body["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})
    kept.append(text[last:])
    return calls, "".join(kept).strip()
