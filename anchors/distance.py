"""Distances between a new segment's base KV and an anchor's, all on position-free KV.

Every function compares the first ``n`` tokens of both (``n <= min(lengths)``) unless it
says otherwise, and returns fp32. With KV heads split over ranks (``head_shards``, see
``kvcomm.core.heads``) the KVs hold this rank's heads; sums over heads come last, after the
ranks' per-head partials were gathered, so every rank gets the single-process numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcomm.core.blocks import block_layers
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV


def value_l2(anchor: KV, new: KV, n: int, head_shards: HeadShards = ALL_HEADS) -> torch.Tensor:
    """Scalar L2 norm of the value difference on the first ``n`` tokens (the reference's
    admission distance), fp64: per-channel fp32 sums of squares, added in fp64 (a single fp32
    norm over millions of elements drifts by ~1e-4 relative). Equals
    ``EstimateDistances.value_l2`` of the same pair exactly."""
    return value_l2_many([anchor], new, [n], head_shards)[0]


def value_l2_many(anchors: Sequence[KV], new: KV, ns: Sequence[int], head_shards: HeadShards = ALL_HEADS) -> list[torch.Tensor]:
    """``value_l2(anchors[a], new, ns[a])`` for every anchor, with one ``gather`` for all of
    them under split heads (one exchange per decision, not one per anchor)."""
    if len(anchors) != len(ns):
        raise ValueError(f"{len(anchors)} anchors but {len(ns)} token counts")
    if not anchors:
        return []
    layers, local_heads, _, dim = new.values.shape
    channels = torch.empty(len(anchors), layers, local_heads, dim, dtype=torch.float32, device=new.values.device)
    for channel, anchor, n in zip(channels, anchors, ns):
        for start, end, d in _difference_blocks(anchor.values, new.values, n):
            torch.sum(d.mul_(d), 2, out=channel[start:end])
    (channels,) = head_shards.gather([channels], [2])
    return [channel.double().sum().sqrt() for channel in channels]


ADMISSION_TEMPERATURE = 0.0075
"""Relative distance scale of admission: an anchor this fraction farther than the nearest gets
1/e of its weight in p (``admission_logits``)."""


def admission_logits(l2: torch.Tensor, counts: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits of the admission distribution over ``A`` compatible anchors, fp64 ``[A]``:
    ``-(r / r_min) / temperature`` with ``r = l2 / sqrt(counts)``, the per-element RMS value
    difference.

    l2: ``[A]`` value L2 distances (``value_l2``), each over ``counts[a]`` compared elements
        (layers * kv_heads * tokens compared * head_dim; anchors may be compared on different
        token counts).
    Length-normalized (anchors compared on fewer tokens are not favoured) and scale-free (no
    dependence on the model's value magnitude), so ``temperature`` reads as "an anchor
    ``temperature`` (e.g. 0.75%) farther than the nearest gets ``1/e`` of its weight". An anchor
    at RMS distance 0 (same values) takes all the mass, shared with any other at distance 0.
    (The reference's ``-l2`` is one-hot on segments longer than a few tokens, which makes gamma
    inert: docs/decisions.md, 2026-11-29.)
    """
    rms = l2.double() / counts.double().sqrt()
    nearest = rms.min().clamp_min(torch.finfo(torch.float64).tiny)
    return -(rms / nearest) / temperature


@dataclass(frozen=True)
class EstimateDistances:
    """Distances that weight one anchor's deviations, from its first ``n`` tokens vs the new segment's.

    token_keys, token_values: ``[n]`` mean absolute difference per token over layers, heads,
        channels (weights for the shared segment's deviation, token by token).
    channel_keys, channel_values: ``[layers, kv_heads, head_dim]`` L2 difference over the
        ``n`` tokens (weights for the following fixed segment's deviation, channel by channel).
    value_l2: fp64 scalar, ``value_l2`` of the same pair (admission needs no pass of its own).
    """

    token_keys: torch.Tensor
    token_values: torch.Tensor
    channel_keys: torch.Tensor
    channel_values: torch.Tensor
    value_l2: torch.Tensor


@dataclass(frozen=True)
class DeviceDistances:
    """Distances of a segment's candidates on the device (the fused path's raw sums).

    token: fp32 ``[A, heads, T]``: per head, sum over layers and channels of ``|diff|``
    (``scale`` turns the sum over heads into the mean). channel: fp32 ``[A, layers, heads,
    head_dim]``, sum over compared tokens of ``diff^2``. counts: host ints, tokens compared per
    candidate. rows: the candidates' rows of the anchors an estimate uses."""

    token: torch.Tensor
    channel: torch.Tensor
    counts: tuple[int, ...]
    scale: float
    rows: tuple[int, ...] = ()



def estimate_distances(anchor: KV, new: KV, n: int, head_shards: HeadShards = ALL_HEADS) -> EstimateDistances:
    """``estimate_distances_many`` for one anchor."""
    return estimate_distances_many([anchor], new, [n], head_shards)[0]


def estimate_distances_many(
    anchors: Sequence[KV], new: KV, ns: Sequence[int], head_shards: HeadShards = ALL_HEADS,
) -> list[EstimateDistances]:
    """Both kinds of distance for each anchor vs ``new`` on its first ``ns[i]`` tokens, from
    base values only (reported for keys too: key deviations are weighted by value distances).

    Both compare the same token pairs the shared estimate combines, so the following segment
    is weighted by exactly the content that was matched. Per anchor, equal to
    ``(a - b).abs().sum(3).sum((0, 1)) / (layers * kv_heads * head_dim)`` and
    ``(a - b).square().sum(2).sqrt()`` in fp32 (the same reductions in the same order), without
    full-size temporaries: layer block by layer block, every anchor's block is subtracted from
    ``new``'s (which stays in cache across the anchors) into one cache-sized scratch buffer and
    reduced twice in place (``|d|``, then ``|d|^2 = d^2``).

    Under split heads the channel distances stay this rank's (they weight this rank's
    channels); token distances and ``value_l2`` are over all heads (one ``gather``).
    """
    if len(anchors) != len(ns):
        raise ValueError(f"{len(anchors)} anchors but {len(ns)} token counts")
    layers, local_heads, _, dim = new.keys.shape
    if not anchors:
        return []
    device = new.keys.device
    token = [torch.empty(2, layers, local_heads, n, dtype=torch.float32, device=device) for n in ns]
    channel = torch.empty(len(anchors), 2, layers, local_heads, dim, dtype=torch.float32, device=device)
    block = block_layers(layers, local_heads * max(ns) * dim * 4, device)
    scratch = torch.empty(block * local_heads * max(ns) * dim, dtype=torch.float32, device=device)
    for i, name in ((1, "values"),):
        b = getattr(new, name)
        sources = [getattr(anchor, name) for anchor in anchors]
        for start in range(0, layers, block):
            end = min(start + block, layers)
            # new's block and the scratch view, once per token count (each view op costs a dispatch)
            new_blocks, differences = {}, {}
            for j, (source, n) in enumerate(zip(sources, ns)):
                if n not in new_blocks:
                    new_blocks[n] = _fp32(b[start:end, :, :n])
                    differences[n] = scratch[: (end - start) * local_heads * n * dim].view(end - start, local_heads, n, dim)
                d = differences[n]
                torch.sub(_fp32(source[start:end, :, :n]), new_blocks[n], out=d)
                torch.sum(d.abs_(), 3, out=token[j][i, start:end])
                torch.sum(d.mul_(d), 2, out=channel[j, i, start:end])
    for j in range(len(anchors)):
        token[j][0], channel[j, 0] = token[j][1], channel[j, 1]
    count = len(anchors)
    gathered = head_shards.gather([*token, *channel[:, 1]], [2] * count + [1] * count)
    out = []
    for j in range(count):
        every_head_token, every_head_values = gathered[j], gathered[count + j]
        l2 = every_head_values.double().sum().sqrt()
        mean_abs = every_head_token.sum((1, 2)) / (layers * every_head_token.shape[2] * dim)
        root = channel[j].sqrt_()
        out.append(EstimateDistances(mean_abs[0], mean_abs[1], root[0], root[1], l2))
    return out


def _difference_blocks(a: torch.Tensor, b: torch.Tensor, n: int):
    """Yield ``(start, end, a[start:end, :, :n] - b[start:end, :, :n])`` over blocks of layers,
    in fp32, each written into the same scratch buffer (valid until the next block)."""
    layers, heads, _, dim = a.shape
    block = block_layers(layers, heads * n * dim * 4, b.device)
    scratch = torch.empty(block, heads, n, dim, dtype=torch.float32, device=b.device)
    for start in range(0, layers, block):
        end = min(start + block, layers)
        d = scratch[: end - start]
        torch.sub(_fp32(a[start:end, :, :n]), _fp32(b[start:end, :, :n]), out=d)
        yield start, end, d


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Distances are fp32 whatever the anchors are stored in (bf16 would round the differences)."""
    return x if x.dtype == torch.float32 else x.float()
