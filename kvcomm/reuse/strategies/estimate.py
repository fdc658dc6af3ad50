"""Strategy "kvcomm": shared segments estimated from their slot's anchors (KVCOMM §3-4).

Walking the prompt after the exact prefix, each shared segment asks its slot's pool
(``AnchorPool.decide``): reuse it as its realigned base plus the anchors' estimated deviation,
or compute it densely and make it an anchor. Before the plan has estimated anything, the
first segment that cannot be served ends reuse (everything after it is computed, cleanly, so
the request can be learned from). Once it has estimated, nothing the request computes can be
learned (it sits behind estimated KV), so there a segment the pool refuses, the uncovered tail
of a partly covered segment and a fixed segment without the anchors' deviation are served as
their realigned bases instead (docs/measurements/2026-12-03-behind-estimate.md), up to new
content or a fixed segment with no stored base.
"""

from __future__ import annotations

from kvcomm.reuse.plan import EstimatedPiece, ReusePlan
from kvcomm.reuse.strategies.realign import add_realigned, first_after_exact, head_before, new_content_note, start_head


def plan_estimates(engine, plan: ReusePlan, provide) -> None:
    prompt, last = plan.prompt, engine.reuse_limit(plan.prompt)
    index, reusing = first_after_exact(plan), True
    head = head_before(engine, plan, index, provide)
    if head is not None and _servable_behind_head(plan.decisions[head[0]], head[1]):
        index = head[0]
        start_head(plan, index)
    while index < len(prompt.segments):
        segment, start = prompt.segments[index], prompt.starts[index]
        reusing = reusing and start < last  # the last token is always computed
        if not segment.is_shared:
            reusing = reusing and _serve_fixed(engine, plan, index, last)
            index += 1
            continue
        known = engine.base(segment, provide)
        if known is None:  # new content: computed densely, its base taken in learn
            if reusing:
                plan.note = plan.note or new_content_note(segment)
            reusing = False
            index += 1
        elif not reusing or start != plan.next_start:
            reusing = False
            _mark_dense_sample(plan, index)
            index += 1
        else:
            reusing, index = _serve_shared(engine, plan, index, last, known)


def _servable_behind_head(decision, new_text: bool) -> bool:
    """Whether a computed head is worth planning before this shared segment: its pool
    estimates it, or its slot is cold (too few anchors for an estimate) behind text new to the
    engine, an agent's first call: then it is served as its realigned base (the cold-slot rule
    of docs/decisions.md, 2026-12-06). A cold slot behind known text is computed and learned
    from instead, as without a head, so that slots warm up."""
    return decision.match is not None or (new_text and decision.candidates.cold)


def _mark_dense_sample(plan: ReusePlan, index: int) -> None:
    """After reuse ended: a shared segment its pool would not estimate is computed in a clean
    context, so ``learn`` records it as an anchor."""
    if plan.prompt.starts[index] >= plan.reuse_end and plan.decisions[index].match is None:
        plan.learn.append(index)


def _serve_fixed(engine, plan: ReusePlan, index: int, last: int) -> bool:
    """A fixed segment reached by reuse: served realigned behind an estimate, else reuse ends."""
    start = plan.prompt.starts[index]
    if start != plan.next_start:
        plan.note = plan.note or (f"the exact prefix ends inside fixed segment {index}, at token {plan.next_start}: "
                                  "the rest of it is computed")
        return False
    fixed = engine.fixed_base(plan.prompt, index)
    if fixed is None:
        plan.note = plan.note or f"fixed segment {index} at {start} has no base yet"
        return False
    if plan.estimated_tokens > 0:
        return add_realigned(plan, index, fixed, last)
    plan.note = plan.note or f"fixed segment {index} at {start} is not reusable on its own"
    return False


def _serve_shared(engine, plan: ReusePlan, index: int, last: int, known) -> tuple[bool, int]:
    """A shared segment with a base (``known``: base, embedding) reached by reuse: estimated,
    realigned, or the end of reuse (then made an anchor). Returns (reuse goes on, next index)."""
    prompt = plan.prompt
    segment, start = prompt.segments[index], prompt.starts[index]
    base = known[0]
    pool = engine.pool(segment.slot)
    decision = plan.decisions[index]
    match = decision.match
    if match is None:
        if plan.estimated_tokens > 0 or (not plan.pieces and plan.head_end == start and decision.candidates.cold):
            return add_realigned(plan, index, base, last), index + 1
        plan.learn.append(index)
        plan.note = f"slot {segment.slot!r} not shareable ({decision.refusal}): new anchor"
        return False, index + 1
    decision.commit()
    covered = min(match.covered, last - start)
    if match.identical:  # its deviation is applied to the very base it was measured against
        base = match.anchors[0].base
    piece = EstimatedPiece(index, start, base.span(0, covered), match, pool)
    if covered < len(segment):  # partly covered: the rest realigned, behind the estimate
        plan.pieces.append(piece)
        if plan.estimated_tokens > 0:
            return add_realigned(plan, index, base, last, covered), index + 1
        plan.note = f"slot {segment.slot!r}: {covered} of {len(segment)} tokens covered by anchors"
        return False, index + 1
    piece = _with_following(engine, piece, prompt, last)
    plan.pieces.append(piece)
    return True, index + (1 if piece.following_base is None else 2)


def _with_following(engine, piece: EstimatedPiece, prompt, last: int) -> EstimatedPiece:
    """Extend a fully covered shared piece over the fixed segment after it, when every matched
    anchor measured its deviation against the fixed base held now."""
    nxt = piece.segment_index + 1
    if nxt >= len(prompt.segments) or prompt.segments[nxt].is_shared:
        return piece
    fixed_base = engine.fixed_base(prompt, nxt)
    if fixed_base is None:
        return piece
    digest = engine.fixed_digest(prompt, nxt)
    deviations = [a.deviations[piece.match.slot] for a in piece.match.anchors]
    if any(d.following is None or d.following_base != digest for d in deviations):
        return piece  # measured against another base of this fixed segment (dropped, relearned)
    start = prompt.starts[nxt]
    length = min(fixed_base.length, last - start)
    if length <= 0:
        return piece
    return EstimatedPiece(piece.segment_index, piece.start, piece.base, piece.match, piece.pool, start, fixed_base.span(0, length))
