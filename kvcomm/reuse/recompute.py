"""Which estimated tokens a "kvblend" plan recomputes, when the engine chooses them.

CacheBlend (Yao et al. 2024) picks the tokens whose keys at an early layer deviate most from
the real ones, which costs a partial forward over every estimated token. An anchor estimate
knows, for free, where it is unsure: where the anchors it averages disagree
(``AnchorPool.disagreement``). ``disagreement_positions`` takes those, after the first tokens
of every estimated span (a chunk's first tokens draw attention out of proportion to their
number, so EPIC, Hu et al. 2024, recomputes chunk starts).
"""

from __future__ import annotations

import torch

from kvcomm.reuse.plan import ReusePlan, ratio_count

RECOMPUTE_SELECTIONS = ("check_layer", "disagreement")
"""How mode "kvblend" picks the tokens it recomputes: CacheBlend's check-layer key deviation
(the executor measures it), or the anchors' disagreement plus span starts (the engine picks)."""


def disagreement_positions(plan: ReusePlan, ratio: float, boundary: int) -> tuple[int, ...]:
    """Sorted prompt positions to recompute among the estimated tokens ``[exact_length, reuse_end)``
    of ``plan``: ``ceil(ratio * estimated)`` of them, first the ``boundary`` first tokens of each
    estimated span (a shared segment, the fixed segment estimated after it, a piece served as
    its realigned base), in order, then the tokens with the highest disagreement score (zero
    on a realigned piece: no anchors estimated it).

    The score of a token is its key disagreement over the mean key disagreement of all the
    plan's estimated tokens, plus the same for values; ties go to the earlier token."""
    start, end = plan.exact_length, plan.reuse_end
    count = ratio_count(ratio, end - start)
    keys, values = torch.zeros(end - start), torch.zeros(end - start)  # host: a few floats per token
    first: list[int] = []
    for piece in plan.pieces:
        if piece.match is None:  # a realigned base: no anchors to disagree, only its first tokens
            first += range(piece.start, piece.start + min(boundary, piece.base.length))
            continue
        k, v = (t.cpu() for t in piece.pool.disagreement(piece.match, piece.base))
        spans = [(piece.start, 0, piece.base.length)]
        if piece.following_base is not None:
            spans.append((piece.following_start, piece.base.length, piece.following_base.length))
        for at, offset, length in spans:
            # a following segment served as its realigned base alone (no anchor term) scores zero
            known = k[offset : offset + length].shape[0]
            keys[at - start : at - start + known] = k[offset : offset + known]
            values[at - start : at - start + known] = v[offset : offset + known]
            first += range(at, at + min(boundary, length))
    score = keys / keys.mean().clamp_min(1e-30) + values / values.mean().clamp_min(1e-30)
    chosen = first[:count]
    score[torch.tensor([p - start for p in chosen], dtype=torch.long)] = float("-inf")
    order = torch.sort(score, descending=True, stable=True).indices[: count - len(chosen)]
    return tuple(sorted(chosen + [int(i) + start for i in order]))
