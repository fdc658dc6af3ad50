"""Prompts as sequences of fixed and shared segments."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np


def content_id(token_ids: Sequence[int]) -> str:
    """Stable identity of a token run: a 128-bit hash of its ids (tokenizer-specific by nature)."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Segment:
    """A contiguous span of a prompt.

    A *fixed* segment (``slot is None``) belongs to one agent's template. A *shared*
    segment fills ``slot`` with content other agents may see too; ``shared_id`` names that
    content (the hash of its ids unless the caller gives one).
    """

    token_ids: tuple[int, ...]
    slot: str | None = None
    shared_id: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a segment must hold at least one token; drop empty segments")
        if self.slot is not None and self.shared_id is None:
            object.__setattr__(self, "shared_id", content_id(self.token_ids))
        if self.slot is None and self.shared_id is not None:
            raise ValueError("a fixed segment has no shared_id; give it a slot to make it shared")

    @property
    def is_shared(self) -> bool:
        return self.slot is not None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Prompt:
    """One agent call's prompt: ``template_id`` names the agent template, segments tile the tokens."""

    template_id: str
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"prompt for template {self.template_id!r} has no segments")

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Start offset of each segment; ``starts[i] + len(segments[i]) == starts[i + 1]``."""
        offsets, total = [], 0
        for segment in self.segments:
            offsets.append(total)
            total += len(segment)
        return tuple(offsets)

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)

    def __len__(self) -> int:
        return self.starts[-1] + len(self.segments[-1])

    def end(self, index: int) -> int:
        return self.starts[index] + len(self.segments[index])
