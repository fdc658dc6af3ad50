"""What one request reuses: the plan, and the provenance it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcomm.anchors.pool import AnchorPool, Match
from kvcomm.kv import KV
from kvcomm.segments import Prompt

EXACT, ESTIMATED, COMPUTED = "exact", "estimated", "computed"
"""Where a prompt token's KV comes from: a stored dense prefill, an anchor estimate, this forward."""


@dataclass(frozen=True)
class EstimatedPiece:
    """A shared segment realigned to ``start`` plus its estimated deviation, optionally with
    the fixed segment after it (``following_start``, ``following_base``: position-free, possibly
    cut short so the last prompt token is left to compute).

    ``base`` is the shared segment's position-free base KV cut to the estimated tokens.
    """

    segment_index: int
    start: int
    base: KV
    match: Match
    pool: AnchorPool
    following_start: int | None = None
    following_base: KV | None = None

    @property
    def end(self) -> int:
        if self.following_base is not None:
            return self.following_start + self.following_base.length
        return self.start + self.base.length


@dataclass
class ReusePlan:
    """The KV for prompt tokens ``[0, reuse_end)`` is supplied, the rest computed densely.

    ``[0, exact_length)`` comes from ``exact_kv`` (stored, exact); the pieces tile
    ``[exact_length, reuse_end)`` contiguously, in order. ``reuse_end <= len(prompt) - 1``
    always: the last prompt token is recomputed so its logits come from a real forward.
    ``learn`` lists shared segment indices, all inside ``[reuse_end, len(prompt))``, whose
    deviations are recorded after the forward pass. ``note`` says why reuse stopped.
    """

    prompt: Prompt
    exact_length: int = 0
    exact_kv: KV | None = None
    pieces: list[EstimatedPiece] = field(default_factory=list)
    learn: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def reuse_end(self) -> int:
        return self.pieces[-1].end if self.pieces else self.exact_length

    @property
    def estimated_tokens(self) -> int:
        return self.reuse_end - self.exact_length

    def provenance(self, ttft_s: float | None = None) -> "Provenance":
        prompt, end = self.prompt, self.reuse_end
        shared = [i for i, s in enumerate(prompt.segments) if s.is_shared]
        reused_shared = sum(max(0, min(end, prompt.end(i)) - prompt.starts[i]) for i in shared)
        outside_exact = any(prompt.end(i) > self.exact_length for i in shared)
        return Provenance(
            prompt_tokens=len(prompt),
            exact_tokens=self.exact_length,
            estimated_tokens=self.estimated_tokens,
            computed_tokens=len(prompt) - end,
            shared_tokens=sum(len(prompt.segments[i]) for i in shared),
            reused_shared_tokens=reused_shared,
            fallback=outside_exact and self.estimated_tokens == 0,
            note=self.note,
            ttft_s=ttft_s,
        )


@dataclass(frozen=True)
class Provenance:
    """Where one agent call's prompt KV came from. Token counts add up:
    ``exact_tokens + estimated_tokens + computed_tokens == prompt_tokens``.

    fallback: shared content lay outside the exact prefix, yet nothing was estimated, so
    the call was prefilled densely after its exact prefix. ttft_s: seconds from the call's
    start (planning included) to its first token's logits.
    """

    prompt_tokens: int
    exact_tokens: int
    estimated_tokens: int
    computed_tokens: int
    shared_tokens: int
    reused_shared_tokens: int
    fallback: bool
    note: str = ""
    ttft_s: float | None = None

    @property
    def reused(self) -> bool:
        """Agent-level reuse (KVCOMM's definition): some shared content was not recomputed."""
        return self.reused_shared_tokens > 0
