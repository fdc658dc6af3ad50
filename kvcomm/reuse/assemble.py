"""Assembly of a plan's reused prefix: exact KV, realigned bases and estimates, written into one KV.

``assemble`` writes whatever memory it is given (new, or lent by a ``KVWorkspace``); it reads
the plan and the anchors' deviations and changes neither.
"""

from __future__ import annotations

import torch

from kvcomm.anchors.deviations import WeightedDeviations
from kvcomm.core.blocks import block_layers
from kvcomm.core.kv import KV, positions
from kvcomm.reuse.plan import ReusePlan
from kvcomm.core.rope import Rotary


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


def assemble(plan: ReusePlan, out: KV, rotary: Rotary) -> KV:
    """Write KV for prompt tokens ``[0, plan.reuse_end)`` into ``out`` (``reuse_layout(plan)``),
    keys rotated at their positions, and return ``out``.

    Each piece is written layer block by layer block (cache-sized, ``block_layers``): the
    block's base plus its weighted deviations is summed in fp32 and its keys rotated straight
    into place, so no full-size temporary is made.
    """
    if plan.exact_length:
        out.span(0, plan.exact_length).keys.copy_(plan.exact_kv.keys)
        out.span(0, plan.exact_length).values.copy_(plan.exact_kv.values)
    for piece in plan.pieces:
        if piece.match is None:  # realigned base, no deviation
            _place(out, piece.base, piece.start, None, rotary)
            continue
        shared, following = piece.pool.estimate_terms(piece.match, piece.base)
        _place(out, piece.base, piece.start, shared, rotary)
        if piece.following_base is not None:
            _place(out, piece.following_base, piece.following_start, following, rotary)
    return out


def _place(out: KV, base: KV, start: int, deviations: WeightedDeviations | None, rotary: Rotary) -> None:
    """Write position-free ``base`` (plus ``deviations``, if any) realigned to ``[start, start + T)`` of ``out``."""
    target = out.span(start, start + base.length)
    layers, heads, length, dim = base.keys.shape
    block = block_layers(layers, heads * length * dim * 4, out.keys.device)
    at = positions(start, length)
    cos_sin = rotary.cos_sin(at, out.keys.device)
    keys = torch.empty(block, heads, length, dim, dtype=torch.float32, device=out.keys.device)
    values = None if target.values.dtype == torch.float32 else torch.empty_like(keys)
    for first in range(0, layers, block):
        last = min(first + block, layers)
        k = keys[: last - first]
        v = target.values[first:last] if values is None else values[: last - first]
        if deviations is None:
            k.copy_(base.keys[first:last])
            v.copy_(base.values[first:last])
        else:
            deviations.add_to(k, "keys", first, last, base=base.keys[first:last])
            deviations.add_to(v, "values", first, last, base=base.values[first:last])
        rotary.rotate(k, at, out=target.keys[first:last], cos_sin=cos_sin)
        if values is not None:
            target.values[first:last].copy_(v)
