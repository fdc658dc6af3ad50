"""What one request reuses: the plan, and the provenance it reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvcomm.anchors.pool import AnchorPool, Match
from kvcomm.core.kv import KV
from kvcomm.core.segments import Prompt
from kvcomm.reuse.reason import explain

EXACT, ESTIMATED, COMPUTED = "exact", "estimated", "computed"
"""Where a prompt token's KV comes from: a stored dense prefill, an anchor estimate, this forward."""


@dataclass(frozen=True)
class Piece:
    """Prompt tokens ``[start, end)`` served from stored KV moved to their positions: segment
    ``segment_index``'s position-free ``base`` (cut to the tokens served) realigned to
    ``start``, plus, where ``match`` is set, the deviation ``pool`` estimates from the matched
    anchors; without a ``match`` the piece is the realigned base alone (a fixed segment's
    stored base, a shared segment its slot does not estimate, or the tail of one whose first
    tokens an estimated piece serves). ``following_start``, ``following_base``: the fixed
    segment after an estimated shared one, estimated with it (position-free, possibly cut short
    so the last prompt token is left to compute)."""

    segment_index: int
    start: int
    base: KV
    match: Match | None
    pool: AnchorPool | None
    following_start: int | None = None
    following_base: KV | None = None

    @property
    def end(self) -> int:
        if self.following_base is not None:
            return self.following_start + self.following_base.length
        return self.start + self.base.length


@dataclass
class Serving:
    """What a plan strategy decided to serve after the exact prefix ``[0, exact_length)``: a
    preamble up to ``preamble_end`` (0: none), then ``pieces`` tiling ``[pieces_start,
    reuse_end)`` in prompt order; the shared segments to ``learn`` from; why reuse stopped
    (``note``). The strategy fills it as it walks the prompt and returns it; the engine hands
    it to ``ReusePlan.serve``."""

    exact_length: int
    preamble_end: int = 0
    pieces: list[Piece] = field(default_factory=list)
    learn: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def next_start(self) -> int:
        """Where the next piece must start: the end of the last piece, or of the preamble,
        or of the exact prefix."""
        return self.pieces[-1].end if self.pieces else max(self.exact_length, self.preamble_end)

    @property
    def reuse_end(self) -> int:
        return self.pieces[-1].end if self.pieces else self.exact_length

    def stop(self, note: str) -> None:
        """Reuse stops; ``note`` says why, unless an earlier stop said it already."""
        self.note = self.note or note


@dataclass(frozen=True)
class BlendRequest:
    """Selective recompute asked of the executor (CacheBlend, Yao et al. 2024): of the
    estimated prompt tokens ``[start, end)``, recompute the ``count`` whose keys at decoder
    layer ``check_layer`` deviate most from the real keys there, through every layer,
    attending properly, and keep their real KV."""

    start: int
    end: int
    ratio: float
    check_layer: int

    @property
    def count(self) -> int:
        return ratio_count(self.ratio, self.end - self.start)

    def cut(self, end: int) -> "BlendRequest | None":
        """This request over the estimated tokens ``[start, end)`` only (a plan cut short at
        ``end``), None if nothing is left to recompute from."""
        if end <= self.start:
            return None
        return BlendRequest(self.start, min(end, self.end), self.ratio, self.check_layer)


def ratio_count(ratio: float, tokens: int) -> int:
    """``ceil(ratio * tokens)``, at most ``tokens``; the rounding guards against float noise
    (0.15 * 20 is 3.0000000000000004 in floats, which must give 3)."""
    return min(tokens, math.ceil(round(ratio * tokens, 6)))


@dataclass
class ReusePlan:
    """The KV for prompt tokens ``[0, reuse_end)`` is supplied, except a preamble; the
    rest is computed densely.

    ``[0, exact_length)`` comes from ``exact_kv`` (stored, exact: rotated at its positions, or
    position-free when ``exact_position_free``, a template's first segment). The preamble
    ``[exact_length, pieces_start)`` (empty unless ``preamble_end`` was set and there are pieces;
    only planned when ``computes_preambles``: the executor can compute it, ``Executor.computes_preambles``) is
    computed densely behind the exact prefix first: text new to the engine, e.g. an agent's
    unseen system prompt, after which shared content is served. The pieces tile
    ``[pieces_start, reuse_end)`` contiguously, in order. ``reuse_end <= len(prompt) - 1``
    always: the last prompt token is recomputed so its logits come from a real forward.
    ``learn`` lists shared segment indices, all computed (``computes``), whose deviations are
    recorded after the forward pass. ``new_bases`` lists shared segment indices, all computed,
    whose content had no base KV when planned; ``learn`` takes their base from the computed
    KV. ``note`` says why reuse stopped.

    ``blend`` (modes "cacheblend", "kvblend"): the selective recompute the executor is to run over the
    estimated tokens; ``recompute`` the sorted prompt positions it recomputed (filled in
    from the executor's ``Generation.recomputed``; None when nothing was asked).
    ``estimated_tokens`` counts the tokens the injected KV estimated before any recompute.
    ``decisions``: the slot pools' decisions per shared segment index, made before the walk
    (``kvcomm.anchors.matching``).
    """

    prompt: Prompt
    computes_preambles: bool = False
    exact_length: int = 0
    preamble_end: int = 0
    exact_kv: KV | None = None
    exact_position_free: bool = False
    pieces: list[Piece] = field(default_factory=list)
    learn: list[int] = field(default_factory=list)
    new_bases: list[int] = field(default_factory=list)
    note: str = ""
    blend: BlendRequest | None = None
    recompute: tuple[int, ...] | None = None
    decisions: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def reuse_end(self) -> int:
        return self.pieces[-1].end if self.pieces else self.exact_length

    @property
    def pieces_start(self) -> int:
        """Where the pieces start: after the preamble, if any, else after the exact prefix."""
        return max(self.exact_length, self.preamble_end) if self.pieces else self.exact_length

    @property
    def preamble_length(self) -> int:
        """Tokens of the preamble ``[exact_length, pieces_start)``."""
        return self.pieces_start - self.exact_length

    @property
    def estimated_tokens(self) -> int:
        return self.reuse_end - self.pieces_start

    # -- the plan's writers: a plan changes only through these ----------------------------

    def serve(self, serving: Serving) -> None:
        """Take a strategy's decisions; the plan must hold only its exact prefix so far."""
        if self.pieces or self.preamble_end or serving.exact_length != self.exact_length:
            raise ValueError("a plan takes one strategy's decisions, made after its own exact prefix")
        self.preamble_end, self.pieces, self.learn, self.note = serving.preamble_end, serving.pieces, serving.learn, serving.note

    def cut(self, index: int, note: str) -> None:
        """Serve only ``pieces[:index]``: the rest is computed densely (the selective recompute
        shrinks to what is still estimated); ``note`` says why."""
        self.pieces = self.pieces[:index]
        self.note = note
        if self.blend is not None:
            self.blend = self.blend.cut(self.reuse_end) if self.estimated_tokens > 0 else None

    def cut_trailing_text(self) -> None:
        """Cut the plan after its last reused shared segment: the fixed template text it would
        serve after that (fixed pieces, a piece's following segment) is computed instead."""
        segments, end = self.prompt.segments, self.reuse_end
        while self.pieces and not segments[self.pieces[-1].segment_index].is_shared:
            self.pieces.pop()
        if self.pieces and self.pieces[-1].following_base is not None:
            self.pieces[-1] = replace(self.pieces[-1], following_start=None, following_base=None)
        if self.reuse_end < end:
            self.note = f"template text after the last reused shared segment is computed (from {self.reuse_end})"

    def expect_new_bases(self, has_base: Callable[[str], bool]) -> None:
        """``new_bases``: the shared segments this plan computes whose content has no base
        (``has_base(shared_id)`` is False), so ``learn`` takes theirs from the computed KV."""
        self.new_bases = [i for i, s in enumerate(self.prompt.segments)
                          if s.is_shared and not has_base(s.shared_id) and self.computes(i)]

    def ask_recompute(self, ratio: float, check_layer: int) -> None:
        """Ask the executor for a selective recompute of the estimated tokens (``blend``), if any."""
        if self.estimated_tokens > 0:
            self.blend = BlendRequest(self.pieces_start, self.reuse_end, ratio, check_layer)

    def record_recompute(self, positions: Sequence[int]) -> None:
        """The prompt positions the executor's selective recompute recomputed (``recompute``)."""
        self.recompute = tuple(positions)

    # -- reading -----------------------------------------------------------------------------

    def computes(self, index: int) -> bool:
        """Whether segment ``index`` is computed whole by the forward pass (in the preamble or the tail)."""
        start, end = self.prompt.starts[index], self.prompt.end(index)
        return start >= self.reuse_end or (self.exact_length <= start and end <= self.pieces_start)

    def provenance(self, ttft_s: float | None = None, cached_tokens: int = 0, plan_s: float | None = None) -> "Provenance":
        prompt, end = self.prompt, self.reuse_end
        recomputed = self.recompute or ()
        if any(not self.pieces_start <= p < end for p in recomputed) or len(set(recomputed)) != len(recomputed):
            raise ValueError(f"recomputed positions must be distinct and in [{self.pieces_start}, {end})")
        shared = [i for i, s in enumerate(prompt.segments) if s.is_shared]
        in_shared = [False] * len(prompt)
        for i in shared:
            in_shared[prompt.starts[i] : prompt.end(i)] = [True] * len(prompt.segments[i])
        preamble = in_shared[self.exact_length : self.pieces_start]  # computed before the pieces
        reused_shared = sum(in_shared[:end]) - sum(preamble) - sum(in_shared[p] for p in recomputed)
        outside_exact = any(prompt.end(i) > self.exact_length for i in shared)
        estimated = self.estimated_tokens - len(recomputed)
        realigned = [(piece.start, piece.end) for piece in self.pieces if piece.match is None]
        realigned_tokens = sum(b - a for a, b in realigned) - sum(any(a <= p < b for a, b in realigned) for p in recomputed)
        return Provenance(
            prompt_tokens=len(prompt),
            exact_tokens=self.exact_length,
            estimated_tokens=estimated,
            computed_tokens=len(prompt) - end + len(recomputed) + self.preamble_length,
            shared_tokens=sum(len(prompt.segments[i]) for i in shared),
            reused_shared_tokens=reused_shared,
            fallback=outside_exact and estimated == 0,
            note=self.note,
            ttft_s=ttft_s,
            recomputed_tokens=len(recomputed),
            cached_tokens=cached_tokens,
            preamble_tokens=self.preamble_length,
            plan_s=plan_s,
            realigned_tokens=realigned_tokens,
        )


@dataclass(frozen=True)
class Provenance:
    """Where one agent call's prompt KV came from. Token counts add up:
    ``exact_tokens + estimated_tokens + computed_tokens == prompt_tokens``.

    fallback: shared content lay outside the exact prefix, yet nothing was estimated, so
    the call was prefilled densely after its exact prefix. ttft_s: seconds from the call's
    start (planning included) to its first token's logits. recomputed_tokens (mode
    "cacheblend"): tokens inside the injected range that were recomputed; they count as
    computed, not estimated. cached_tokens: of the computed tokens, those the runtime's own
    prefix cache served instead (``Generation.cached_tokens``: vLLM's prefix-cache hit beyond
    what kvcomm injected; 0 on transformers). They stay in ``computed_tokens`` (kvcomm did not
    serve them), and are reported so that a comparison can see what a prefix cache gave.
    preamble_tokens: of the computed tokens, those computed before the reused ones (the plan's
    preamble: new text, such as an agent's unseen system prompt, ahead of shared content).
    plan_s: of ``ttft_s``, the seconds spent planning (base-KV prefills of new content
    included); None where nobody measured it (a server's plan). ``reason``: all of it in words.

    estimated_tokens counts every token served from stored KV moved to its new positions (a
    realigned base), with or without an anchor's estimated deviation on top; realigned_tokens:
    of them, those served as the realigned base alone, with no deviation (a cold slot: no
    anchors yet; modes "realign" and "cacheblend"; the tail an anchor did not cover). So the
    anchor-estimated tokens are ``estimated_tokens - realigned_tokens``.
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
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    preamble_tokens: int = 0
    plan_s: float | None = None
    realigned_tokens: int = 0

    @property
    def reason(self) -> str:
        """What was reused and why the rest was computed, in plain words (``kvcomm.reuse.reason``)."""
        return explain(self)

    @property
    def reuse_end(self) -> int:
        """End of the injected prefix: the prompt positions ``[reuse_end, prompt_tokens)``
        were computed by the tail forward (``Generation.prompt_logprobs`` covers them)."""
        return self.prompt_tokens - self.computed_tokens + self.recomputed_tokens + self.preamble_tokens

    @property
    def reused(self) -> bool:
        """Agent-level reuse (KVCOMM's definition): some shared content was not recomputed."""
        return self.reused_shared_tokens > 0
