"""Strategy "realign": every segment with a stored base, RoPE-realigned, no deviation; and the
walk's steps the "kvcomm" strategy shares (the preamble, a realigned piece)."""

from __future__ import annotations

from kvcomm.reuse.plan import Piece, Serving
from kvcomm.reuse.strategies.context import PlanContext


def plan_realigned(context: PlanContext) -> Serving:
    """Serve each segment after the exact prefix as its realigned base (shared: its content's
    base; fixed: the template's stored base), in order, up to the first without one. No
    anchors, no admission."""
    prompt, serving = context.prompt, context.serving()
    first = first_after_exact(context)
    preamble = preamble_before(context, first)
    if preamble is not None:
        first = preamble[0]
        serving.preamble_end = prompt.starts[first]
    for index in range(first, len(prompt.segments)):
        segment = prompt.segments[index]
        if prompt.starts[index] != serving.next_start:  # the exact prefix ends inside this segment
            break
        if segment.is_shared:
            known = context.base(segment)
            if known is None:
                serving.stop(new_content_note(segment))
                break
            base = known[0]
        else:
            base = context.fixed_base(index)
            if base is None:
                serving.stop(f"fixed segment {index} at {prompt.starts[index]} has no base yet")
                break
        if not add_realigned(serving, context, index, base):
            break
    return serving


PREAMBLE_MIN_REUSE = 64
"""Tokens the shared segment right after a preamble must hold for the preamble to be planned:
computing a preamble costs the vLLM executor one more engine step (a request of its own), which a
few reused tokens do not pay back (docs/measurements/2026-12-06-first-task.md)."""


def preamble_before(context: PlanContext, index: int) -> tuple[int, bool] | None:
    """(the segment a preamble would end at, whether the preamble holds template text new to
    the engine), when the executor computes preambles and segment ``index`` (the first after the
    exact prefix, starting right there) cannot be served first: the first shared segment from
    ``index`` on whose content has a base, if text the engine does not serve on its own lies
    before it (fixed segments, new content), it starts before the last prompt token and holds
    at least ``PREAMBLE_MIN_REUSE`` tokens. Template text is new when a fixed segment has no stored
    base (an agent's first call); new shared content (a reply just written) is not. Computing
    the preamble is clean, so the engine learns from it. None otherwise: reuse stops where it did."""
    prompt = context.prompt
    if not context.computes_preambles or index >= len(prompt.segments) or prompt.starts[index] != context.exact_length:
        return None
    new = False
    for k in range(index, len(prompt.segments)):
        segment = prompt.segments[k]
        known = context.base(segment) is not None if segment.is_shared else context.fixed_base(k) is not None
        if segment.is_shared and known:
            worth = len(segment) >= PREAMBLE_MIN_REUSE and prompt.starts[k] < context.limit
            return (k, new) if k > index and worth else None
        new = new or not (segment.is_shared or known)
    return None


def first_after_exact(context: PlanContext) -> int:
    """Index of the first segment that ends after the exact prefix (``len(segments)`` if none)."""
    prompt = context.prompt
    return next((i for i in range(len(prompt.segments)) if prompt.end(i) > context.exact_length), len(prompt.segments))


def add_realigned(serving: Serving, context: PlanContext, index: int, base, offset: int = 0) -> bool:
    """Append segment ``index``'s tokens from ``offset`` on, served as their realigned ``base``
    (position-free, the segment's own; no deviation), to ``serving``, which must reach exactly
    there; never a token at or past ``context.limit``. Returns whether the whole segment is now
    reused (so reuse may go on), False if ``serving`` does not reach there or it was cut short."""
    prompt = context.prompt
    start = prompt.starts[index] + offset
    if start != serving.next_start:  # the exact prefix ends inside this segment
        return False
    end = min(len(prompt.segments[index]), base.length, context.limit - prompt.starts[index])
    if end <= offset:
        return False
    serving.pieces.append(Piece(index, start, base.span(offset, end), None, None))
    return end == len(prompt.segments[index])


def new_content_note(segment) -> str:
    return f"slot {segment.slot!r}: new content, its base is taken from this prefill"
