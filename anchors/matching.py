"""Matching a prompt's shared segments against their slots' anchors, all segments at once.

A plan asks every slot pool about every shared segment it may reuse before it walks the
prompt (``decide_all``): which anchors are candidates (host: compatibility, embedding
narrowing, coverage), their distances to the segment (device: one reduction per segment),
admission (device: one reduction for all segments), then one host read of the decisions. The
walk takes the decisions it needs (``Decision``); reading them costs no further device work.

On a GPU (and under ``TRITON_INTERPRET=1``) distances and admission are the Triton kernels
``distances_kernel`` and ``admission_kernel``; elsewhere the pool's torch code computes the same
numbers, keeping recent distances for the next reader of the same content (``DistanceCache``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcomm.anchors.anchor import Anchor, SlotKey
from kvcomm.anchors.distance import ADMISSION_TEMPERATURE, DeviceDistances
from kvcomm.core.device import OP_BYTES, host_read, upload, uses_triton
from kvcomm.core.kv import KV

DISTANCE_BLOCK = 32
"""Tokens per program of ``distances_kernel`` (its grid grows with the segment's length)."""

ENTROPY_TOLERANCE = 1e-9
"""Admission's slack on ``gamma * log(#compatible)``: in fp32 a uniform p has an entropy just
above log(n), so gamma = 1 (which must always reuse) would never reuse."""


@dataclass
class Candidates:
    """What a pool can match a segment against, decided on the host.

    anchors: the compatible anchors after narrowing, in pool order (admission's p is over them);
    covered: tokens an estimate would cover; identical: the anchor that is this very segment in
    this slot (its deviation is used as is; no distances, no admission); refusal: why the pool
    refuses before any distance is computed (too few compatible anchors, too little coverage)."""

    pool: object
    slot: SlotKey
    segment_id: str
    base: KV
    embedding: np.ndarray
    anchors: tuple[Anchor, ...] = ()
    covered: int = 0
    identical: Anchor | None = None
    refusal: str | None = None
    cold: bool = False
    """Refused because fewer than ``min_compatible`` anchors have a deviation for this slot."""

    @property
    def used(self) -> tuple[Anchor, ...]:
        """The anchors an estimate uses: those at least ``covered`` long."""
        return tuple(a for a in self.anchors if a.length >= self.covered)


@dataclass
class Decision:
    """A pool's answer for one segment. ``match``: estimate the segment from it (None: compute
    it densely and make it an anchor; ``refusal`` says why, in words). ``p``: admission's
    distribution over the candidates (host floats), for access counting on ``commit``."""

    candidates: Candidates
    match: object | None
    refusal: str | None = None
    p: list[float] = field(default_factory=list)
    estimable: object | None = None
    """The match the pool could estimate from, admitted or not (None: refused before distances)."""

    def commit(self) -> None:
        """The plan reuses the segment: the anchors carrying the top-p mass of p get an access."""
        if self.match is not None:
            self.candidates.pool.count_access(self.candidates, self.p)


def decide_all(requests: list[Candidates]) -> list[Decision]:
    """Decide every request (one host read in all), each under its pool's gamma now."""
    gammas = [c.pool.config.gamma for c in requests]
    pending = [i for i, c in enumerate(requests) if c.refusal is None and c.identical is None]
    decisions: list[Decision | None] = [None] * len(requests)
    for i, c in enumerate(requests):
        if c.refusal is not None:
            decisions[i] = Decision(c, None, c.refusal)
        elif c.identical is not None:
            match = c.pool.identical_match(c)
            decisions[i] = Decision(c, match, estimable=match)
    if pending:
        chosen = [requests[i] for i in pending]
        fused = uses_triton(chosen[0].base.values.device)
        rows, distances = (_fused_admission if fused else _torch_admission)(chosen, [gammas[i] for i in pending])
        for i, c, row, d in zip(pending, chosen, rows, distances):
            refused, entropy, p = row[0] > 0, row[1], row[2 : 2 + len(c.anchors)]
            match = c.pool.match_from(c, d)
            if refused:
                reason = f"admission entropy {entropy:.2f} over {len(c.anchors)} anchors above gamma {gammas[i]:g}"
                decisions[i] = Decision(c, None, reason, p, match)
            else:
                decisions[i] = Decision(c, match, None, p, match)
    return decisions


def _limit(candidates: Candidates, gamma: float) -> float:
    """The most entropy admission reuses at."""
    return gamma * math.log(len(candidates.anchors)) + ENTROPY_TOLERANCE


# -- torch --------------------------------------------------------------------------------------


def _torch_admission(requests: list[Candidates], gammas: list[float]):
    """Per request: the pool's distances (cached ones reused) and admission, in torch; the
    rows of all of them read to the host at once."""
    rows, distances = [], []
    for c, gamma in zip(requests, gammas):
        d = c.pool.distances(c)
        p = c.pool.admission(c, [x if isinstance(x, torch.Tensor) else x.value_l2 for x in d])
        entropy = -(p * torch.log(p.clamp_min(1e-300))).sum()
        refused = (entropy > _limit(c, gamma)).double()
        rows.append(torch.cat([refused[None], entropy[None], p]))
        distances.append(tuple(d[i] for i, a in enumerate(c.anchors) if a.length >= c.covered))
    width = max(r.numel() for r in rows)
    packed = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    return host_read(packed).tolist(), distances


# -- Triton -------------------------------------------------------------------------------------


def _fused_admission(requests: list[Candidates], gammas: list[float]):
    """Distances (one kernel per request) and admission (one kernel for all), their tables
    uploaded in one copy and the decisions read in one."""
    import triton

    first = requests[0].base.values
    layers, heads, _, dim = first.shape
    device = first.device
    width = triton.next_power_of_2(max(len(c.anchors) for c in requests))
    counts = [[min(c.base.length, a.length) for a in c.anchors] for c in requests]
    per_token = layers * heads * dim * requests[0].pool.head_shards.size
    tables = [np.array([[a.base.values.data_ptr(), *a.base.values.stride()[:3]] for a in c.anchors], dtype=np.int64).reshape(-1)
              for c in requests]
    padded = np.array([n + [0] * (width - len(n)) for n in counts], dtype=np.int64)
    weighted = np.array([[n * per_token for n in row] + [1] * (width - len(row)) for row in counts], dtype=np.float64)
    limits = np.array([_limit(c, g) for c, g in zip(requests, gammas)], dtype=np.float64)
    parts = [*tables, padded.reshape(-1), weighted.reshape(-1).view(np.int64), limits.view(np.int64),
             np.array([len(c.anchors) for c in requests], dtype=np.int64)]
    starts = np.cumsum([0] + [p.size for p in parts])
    packed = upload(np.concatenate(parts), device)
    floats = packed.view(torch.float64)
    s_counts, s_weighted, s_limits, s_anchors = (starts[len(requests) + i] for i in range(4))
    span = max(max(n) for n in counts)
    blocks = triton.cdiv(max(max(n) for n in counts), DISTANCE_BLOCK)
    parts = torch.empty(len(requests), width, blocks, layers, heads, dim, dtype=torch.float32, device=device)
    tokens = []
    for s, c in enumerate(requests):
        token = torch.empty(len(c.anchors), heads, span, dtype=torch.float32, device=device)
        distances_op(c.base.values, packed[starts[s] : starts[s + 1]],
                     packed[s_counts + s * width : s_counts + s * width + len(c.anchors)], token,
                     parts[s, : len(c.anchors)], layers, max(counts[s]))
        tokens.append(token)
    channel = parts.sum(2)  # the token blocks' shares, every segment at once
    every_head = requests[0].pool.head_shards.gather([channel], [3])[0]  # admission reads every head's differences
    result = torch.empty(len(requests), 2 + width, dtype=torch.float64, device=device)
    admission_op(every_head, floats[s_weighted:s_limits], packed[s_anchors:], floats[s_limits:s_anchors], result, width,
                 float(ADMISSION_TEMPERATURE))
    rows = host_read(result).tolist()
    distances = []
    for s, c in enumerate(requests):
        token = c.pool.head_shards.gather([tokens[s]], [1])[0]
        used = tuple(i for i, a in enumerate(c.anchors) if a.length >= c.covered)
        distances.append(DeviceDistances(token, channel[s, : len(c.anchors)], tuple(counts[s]),
                                         1.0 / (layers * token.shape[1] * dim), used))
    return rows, distances


@torch.library.custom_op("kvcomm::distances", mutates_args=("token", "channel"))
def distances_op(values: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, token: torch.Tensor,
                 channel: torch.Tensor, layers: int, span: int) -> None:
    """One ``distances_kernel`` launch: grid (candidates, heads, token blocks of ``span``);
    ``channel`` ``[candidates, blocks, layers, heads, dim]``: each block's share."""
    import triton

    from kvcomm.core.triton_kernels import distances_kernel

    anchors, heads = token.shape[0], token.shape[1]
    dim = values.shape[3]
    distances_kernel[(anchors, heads, triton.cdiv(span, DISTANCE_BLOCK))](
        values, values.stride(0), values.stride(1), values.stride(2), table, counts, token, token.stride(0), token.stride(1),
        channel, channel.stride(0), channel.stride(1), channel.stride(2), channel.stride(3), layers, dim,
        BT=DISTANCE_BLOCK, BD=triton.next_power_of_2(dim),
    )


def _distances_bytes(values, table, counts, token, channel, layers, span) -> int:
    """The new segment's values (read once per candidate, from cache after the first), each
    candidate's values on its compared tokens, and the two outputs."""
    anchors, heads = token.shape[0], token.shape[1]
    dim, item = values.shape[3], values.element_size()
    return (anchors + 1) * layers * heads * span * dim * item + token.numel() * 4 + channel[:, :1].numel() * 4


@torch.library.custom_op("kvcomm::admission", mutates_args=("out",))
def admission_op(channel: torch.Tensor, counts: torch.Tensor, anchors: torch.Tensor, limits: torch.Tensor,
                 out: torch.Tensor, width: int, temperature: float) -> None:
    """One ``admission_kernel`` launch: grid (segments,)."""
    import triton

    from kvcomm.core.triton_kernels import admission_kernel

    segments = out.shape[0]
    per_anchor = channel[0, 0].numel()
    admission_kernel[(segments,)](channel, channel.stride(0), channel.stride(1), per_anchor, counts, anchors, limits, out,
                                  out.stride(0), temperature, BA=width, BW=min(1024, triton.next_power_of_2(per_anchor)))


def _admission_bytes(channel, counts, anchors, limits, out, width, temperature) -> int:
    return channel.numel() * 4 + counts.numel() * 8 + out.numel() * 8


OP_BYTES["kvcomm::distances"] = _distances_bytes
OP_BYTES["kvcomm::admission"] = _admission_bytes
