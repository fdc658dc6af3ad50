"""Strategy "kvcomm": realignment, with each shared segment's estimate served where its slot
has earned it (KVCOMM §3-4, gated by evidence).

The plan reaches what mode ``realign`` reaches: after the exact prefix (and a preamble
where the executor computes one), every segment with a stored base, in order, up to new
content (no base yet) or a fixed segment with no stored base. Each shared segment there is
served as its realigned base plus its anchors' estimated deviation when its pool admits it
(``AnchorPool.decide``) and the slot's estimate has been measured closer to dense than
realignment (``AnchorPool.earned``, ``kvcomm.anchors.evidence``; an identical match, the very
segment's measured deviation, needs no evidence); otherwise as its realigned base. The fixed
segment after a fully covered estimate is estimated from the anchors' following deviations
under the same rule, else realigned. So a cold or unproven slot gives up no reuse realignment
has; it learns from what is computed anyway: the shared segments after reuse ended in a
request that reused nothing else (they become anchors), calibration calls and the quality
guard's dense twins (``GuardConfig.learn``), each also a measured pair for the evidence.
"""

from __future__ import annotations

from kvcomm.reuse.plan import Piece, Serving
from kvcomm.reuse.strategies.context import PlanContext
from kvcomm.reuse.strategies.realign import add_realigned, first_after_exact, preamble_before, new_content_note


def plan_estimates(context: PlanContext) -> Serving:
    prompt, last, serving = context.prompt, context.limit, context.serving()
    index, reusing = first_after_exact(context), True
    preamble = preamble_before(context, index)
    if preamble is not None:
        index = preamble[0]
        serving.preamble_end = prompt.starts[index]
    while index < len(prompt.segments):
        segment, start = prompt.segments[index], prompt.starts[index]
        reusing = reusing and start < last and start == serving.next_start  # the last token is always computed
        if not reusing:
            _mark_dense_sample(serving, context, index)
            index += 1
        elif not segment.is_shared:
            reusing = _serve_fixed(serving, context, index)
            index += 1
        else:
            known = context.base(segment)
            if known is None:  # new content: computed densely, its base taken in learn
                serving.stop(new_content_note(segment))
                reusing = False
                index += 1
            else:
                reusing, index = _serve_shared(serving, context, index, known[0])
    return serving


def _mark_dense_sample(serving: Serving, context: PlanContext, index: int) -> None:
    """After reuse ended: a shared segment with a base whose slot would not serve an estimate
    of it is computed, so ``learn`` records it as an anchor (and as evidence) when the request
    is clean."""
    decision = context.decisions.get(index)
    if decision is None or context.prompt.starts[index] < serving.reuse_end:
        return
    match = decision.match
    if match is None or not (match.identical or decision.candidates.pool.earned(match.slot)):
        serving.learn.append(index)


def _serve_fixed(serving: Serving, context: PlanContext, index: int) -> bool:
    """A fixed segment reached by reuse: served as its template's realigned stored base, else reuse ends."""
    fixed = context.fixed_base(index)
    if fixed is None:
        serving.stop(f"fixed segment {index} at {context.prompt.starts[index]} has no base yet")
        return False
    return add_realigned(serving, context, index, fixed)


def _serve_shared(serving: Serving, context: PlanContext, index: int, base) -> tuple[bool, int]:
    """A shared segment with a base (``base``) reached by reuse: estimated where its slot
    earned it, else realigned. Returns (reuse goes on, next index)."""
    prompt = context.prompt
    segment, start = prompt.segments[index], prompt.starts[index]
    decision = context.decisions[index]
    pool, match = decision.candidates.pool, decision.match
    if match is None or not (match.identical or pool.earned(match.slot)):
        return add_realigned(serving, context, index, base), index + 1
    covered = min(match.covered, context.limit - start)
    if match.identical:  # its deviation is applied to the very base it was measured against
        base = match.anchors[0].base
    piece = Piece(index, start, base.span(0, covered), match, pool)
    if covered < len(segment):  # partly covered: the rest realigned, behind the estimate
        serving.pieces.append(piece)
        return add_realigned(serving, context, index, base, covered), index + 1
    piece = _with_following(context, piece)
    serving.pieces.append(piece)
    return True, index + (1 if piece.following_base is None else 2)


def _with_following(context: PlanContext, piece: Piece) -> Piece:
    """Extend a fully covered shared piece over the fixed segment after it, when every matched
    anchor measured its deviation against the fixed base held now and the slot earned its
    estimate of that segment (an identical match: its own measured deviation)."""
    prompt, nxt = context.prompt, piece.segment_index + 1
    if nxt >= len(prompt.segments) or prompt.segments[nxt].is_shared:
        return piece
    if not (piece.match.identical or piece.pool.earned(piece.match.slot, "following")):
        return piece
    fixed_base = context.fixed_base(nxt)
    if fixed_base is None:
        return piece
    digest = context.fixed_digest(nxt)
    deviations = [a.deviations[piece.match.slot] for a in piece.match.anchors]
    if any(d.following is None or d.following_base != digest for d in deviations):
        return piece  # measured against another base of this fixed segment (dropped, relearned)
    start = prompt.starts[nxt]
    length = min(fixed_base.length, context.limit - start)
    if length <= 0:
        return piece
    return Piece(piece.segment_index, piece.start, piece.base, piece.match, piece.pool, start, fixed_base.span(0, length))
