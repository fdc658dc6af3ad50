"""Strategy "realign": every segment with a stored base, RoPE-realigned, no deviation."""

from __future__ import annotations

from kvcomm.reuse.plan import EstimatedPiece, ReusePlan


def plan_realigned(engine, plan: ReusePlan, provide) -> None:
    """Serve each segment after the exact prefix as its realigned base (shared: its content's
    base; fixed: the template's stored base), in order, up to the first without one. No
    anchors, no admission."""
    prompt, last = plan.prompt, engine.reuse_limit(plan.prompt)
    first = first_after_exact(plan)
    head = head_before(engine, plan, first, provide)
    if head is not None:
        first = head[0]
        start_head(plan, first)
    for index in range(first, len(prompt.segments)):
        segment = prompt.segments[index]
        if prompt.starts[index] != plan.next_start:  # the exact prefix ends inside this segment
            return
        if segment.is_shared:
            known = engine.base(segment, provide)
            if known is None:
                plan.note = new_content_note(segment)
                return
            base = known[0]
        else:
            base = engine.fixed_base(prompt, index)
            if base is None:
                plan.note = f"fixed segment {index} at {prompt.starts[index]} has no base yet"
                return
        if not add_realigned(plan, index, base, last):
            return


HEAD_MIN_REUSE = 64
"""Tokens the shared segment right after a computed head must hold for the head to be planned:
computing a head costs the vLLM executor one more engine step (a request of its own), which a
few reused tokens do not pay back (docs/measurements/2026-12-06-first-task.md)."""


def head_before(engine, plan: ReusePlan, index: int, provide) -> tuple[int, bool] | None:
    """(the segment a computed head would end at, whether the head holds template text new to
    the engine), when the plan may have one (``plan.heads``) and segment ``index`` (the first
    after the exact prefix, starting right there) cannot be served first: the first shared
    segment from ``index`` on whose content has a base, if text the engine does not serve on
    its own lies before it (fixed segments, new content), it starts before the last prompt
    token and holds at least ``HEAD_MIN_REUSE`` tokens. Template text is new when a fixed
    segment has no stored base (an agent's first call); new shared content (a reply just
    written) is not. Computing the head is clean, so the engine learns from it. None
    otherwise: reuse stops where it did."""
    prompt = plan.prompt
    if not plan.heads or plan.pieces or index >= len(prompt.segments) or prompt.starts[index] != plan.exact_length:
        return None
    new = False
    for k in range(index, len(prompt.segments)):
        segment = prompt.segments[k]
        known = engine.base(segment, provide) is not None if segment.is_shared else engine.fixed_base(prompt, k) is not None
        if segment.is_shared and known:
            worth = len(segment) >= HEAD_MIN_REUSE and prompt.starts[k] < engine.reuse_limit(prompt)
            return (k, new) if k > index and worth else None
        new = new or not (segment.is_shared or known)
    return None


def start_head(plan: ReusePlan, index: int) -> None:
    """Plan the computed head up to segment ``index``: pieces start there."""
    plan.head_end = plan.prompt.starts[index]  # the provenance's head_tokens say it: the note stays free for why reuse stops


def first_after_exact(plan: ReusePlan) -> int:
    """Index of the first segment that ends after the exact prefix (``len(segments)`` if none)."""
    prompt = plan.prompt
    return next((i for i in range(len(prompt.segments)) if prompt.end(i) > plan.exact_length), len(prompt.segments))


def add_realigned(plan: ReusePlan, index: int, base, last: int, offset: int = 0) -> bool:
    """Append segment ``index``'s tokens from ``offset`` on, served as their realigned ``base``
    (position-free, the segment's own; no deviation), to ``plan``, which must reach exactly
    there; never a token at or past ``last`` (``ReuseEngine.reuse_limit``). Returns whether the
    whole segment is now reused (so reuse may go on), False if the plan does not reach there or
    it was cut short."""
    prompt = plan.prompt
    start = prompt.starts[index] + offset
    if start != plan.next_start:  # the exact prefix ends inside this segment
        return False
    end = min(len(prompt.segments[index]), base.length, last - prompt.starts[index])
    if end <= offset:
        return False
    plan.pieces.append(EstimatedPiece(index, start, base.span(offset, end), None, None))
    return end == len(prompt.segments[index])


def new_content_note(segment) -> str:
    return f"slot {segment.slot!r}: new content, its base is taken from this prefill"
