"""Assembly of a plan's reused prefix: exact KV, realigned bases and estimates, written by the
fused writer (``kvcomm.core.place``) into any ``KVTarget`` (a buffer, or vLLM's paged cache).

``pieces`` turns a plan into the writer's pieces (reading the plan and the anchors' deviations,
changing neither); ``assemble`` writes them into a buffer.
"""

from __future__ import annotations

import torch

from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.place import Piece, place_all
from kvcomm.core.rope import Rotary
from kvcomm.reuse.plan import ReusePlan


def reuse_layout(plan: ReusePlan) -> tuple[tuple[int, int, int, int] | None, torch.dtype | None, torch.dtype | None]:
    """(shape ``[layers, kv_heads, plan.reuse_end, head_dim]``, key dtype, value dtype) of the KV
    ``assemble`` fills, or (None, None, None) when the plan reuses nothing."""
    if plan.reuse_end == 0:
        return None, None, None
    like = plan.exact_kv if plan.exact_kv is not None else plan.pieces[0].base
    layers, heads, _, dim = like.keys.shape
    return (layers, heads, plan.reuse_end, dim), like.keys.dtype, like.values.dtype


def reuse_device(plan: ReusePlan) -> torch.device:
    """The device of the KV a plan reuses (its exact prefix's or first piece's): the engine keeps
    its bases, deviations and prefixes where the executor handed it their KV, and assembles there."""
    like = plan.exact_kv if plan.exact_kv is not None else plan.pieces[0].base
    return like.keys.device


def exact_piece(plan: ReusePlan) -> Piece:
    """The writer's piece for the plan's exact prefix ``[0, plan.exact_length)`` (non-empty)."""
    return Piece(plan.exact_kv.span(0, plan.exact_length), 0, 0, rotate=plan.exact_position_free)


def pieces(plan: ReusePlan) -> list[Piece]:
    """The writer's pieces for prompt tokens ``[0, plan.reuse_end)``, target token = prompt position."""
    out = [exact_piece(plan)] if plan.exact_length else []
    for piece in plan.pieces:
        if piece.match is None:  # realigned base, no deviation
            out.append(Piece(piece.base, piece.start, piece.start))
            continue
        shared, following = piece.pool.estimate_terms(piece.match, piece.base)
        out.append(Piece(piece.base, piece.start, piece.start, shared))
        if piece.following_base is not None:
            out.append(Piece(piece.following_base, piece.following_start, piece.following_start, following))
    return out


def assemble(plan: ReusePlan, out: KV, rotary: Rotary) -> KV:
    """Write KV for prompt tokens ``[0, plan.reuse_end)`` into ``out`` (``reuse_layout(plan)``),
    keys rotated at their positions, and return ``out``."""
    place_all(pieces(plan), KVTarget.contiguous(out, 0, plan.reuse_end), rotary)
    return out
