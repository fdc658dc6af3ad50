"""Distances between a new segment's base KV and an anchor's, all on position-free KV.

Every function compares the first ``n`` tokens of both (``n <= min(lengths)``) unless it
says otherwise, and returns fp32.
"""

from __future__ import annotations

import torch

from kvcomm.kv import KV


def value_l2(anchor: KV, new: KV, n: int) -> torch.Tensor:
    """Scalar L2 norm of the value difference on the first ``n`` tokens (admission distance)."""
    diff = anchor.values[:, :, :n].float() - new.values[:, :, :n].float()
    return torch.linalg.vector_norm(diff)


def per_token(anchor: KV, new: KV, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean absolute key and value difference per token over layers, heads, channels: two ``[n]``."""
    dk = (anchor.keys[:, :, :n].float() - new.keys[:, :, :n].float()).abs_().mean(dim=(0, 1, 3))
    dv = (anchor.values[:, :, :n].float() - new.values[:, :, :n].float()).abs_().mean(dim=(0, 1, 3))
    return dk, dv


def per_channel_tail(anchor: KV, new: KV, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 over the last ``n`` tokens of each, per (layer, head, channel): two ``[layers, heads, head_dim]``.

    The tokens nearest a following fixed segment shape its deviation most, so the two
    segments are aligned at their ends.
    """
    a, b = anchor.span(anchor.length - n, anchor.length), new.span(new.length - n, new.length)
    dk = torch.linalg.vector_norm(a.keys.float() - b.keys.float(), dim=2)
    dv = torch.linalg.vector_norm(a.values.float() - b.values.float(), dim=2)
    return dk, dv
