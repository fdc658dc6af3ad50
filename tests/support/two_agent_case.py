"""The two-agent pipeline the engine and mode tests share, and its prompt builder."""

from __future__ import annotations

from kvcomm.reuse.pipeline import AgentSpec
from kvcomm.reuse.runner import build_prompt
from kvcomm.core.segments import Prompt, Segment

PIPELINE = {
    "agents": [
        {"name": "reader", "system": "You are a careful reader.", "template": "Text: {doc}\nSummarize it in one line."},
        {"name": "asker", "system": "You ask questions.", "template": "Text: {doc}\nSummary: {reader}\nAsk one question."},
    ],
    "inputs": [
        {"doc": "The river Seine flows through Paris and into the English Channel."},
        {"doc": "Mount Fuji is the highest mountain in Japan, near Tokyo."},
        {"doc": "The Nile is a long river in Africa that flows north into the sea."},
        {"doc": "Bananas are yellow fruits that grow in warm countries."},
    ],
    "max_new_tokens": 12,
}


def agent_prompt(executor, agent: AgentSpec, fill: dict[str, str]) -> Prompt:
    """``agent``'s prompt with every slot in ``fill`` filled by its text as a shared segment."""
    shared = {k: Segment(tuple(executor.encode(v)), slot="_") for k, v in fill.items()}
    return build_prompt(executor, agent, shared)
