"""An anchor: a shared segment seen before, with the deviations it showed in each slot."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcomm.core.kv import KV

SlotKey = tuple[str, str]
"""(template id, slot name): one place in one agent's template where shared content goes."""


@dataclass(frozen=True)
class Deviation:
    """Real KV minus realigned base KV, observed when one slot densely prefilled an anchor.

    shared: ``[layers - first_layer, kv_heads, T_anchor, head_dim]``, position-free (key deltas
        de-rotated), for model layers ``first_layer..``.
    following: the same for the fixed segment right after the slot (``F`` tokens, fixed per
        slot), or ``None`` when nothing follows before the next slot or prompt end.
    following_base: digest (``kv_digest``) of the fixed segment's base KV that ``following``
        was measured against; a following deviation is only applied to that very base
        (None: unknown, never applied).
    first_layer: model layers below it are not stored and the realigned base is served there
        as it is. The engine records from layer 1: layer 0's K/V depend only on each token and
        its position, so its deviation is rounding.
    """

    shared: KV
    following: KV | None
    following_base: str | None = None
    first_layer: int = 0

    def __post_init__(self) -> None:
        if self.first_layer < 0:
            raise ValueError(f"first_layer must be >= 0, got {self.first_layer}")
        if self.following is not None and self.following.keys.shape[0] != self.shared.keys.shape[0]:
            raise ValueError(f"following deviation has {self.following.keys.shape[0]} layers, the shared one "
                             f"{self.shared.keys.shape[0]}: both start at first_layer")

    @property
    def nbytes(self) -> int:
        return self.shared.nbytes + (self.following.nbytes if self.following is not None else 0)


@dataclass
class Anchor:
    """One previously seen shared segment.

    base: its position-free base KV, ``[layers, kv_heads, T, head_dim]``.
    embedding: ``[dim]`` float32, L2-normalized, used to narrow candidates in large pools.
    deviations: per slot that densely prefilled it.
    accesses: how often it carried the top-p mass of a reuse decision (eviction favours low).
    serial: insertion order within its pool (eviction looks at the earliest).
    """

    segment_id: str
    base: KV
    embedding: np.ndarray
    serial: int
    deviations: dict[SlotKey, Deviation] = field(default_factory=dict)
    accesses: int = 0

    @property
    def length(self) -> int:
        return self.base.length

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + sum(d.nbytes for d in self.deviations.values())


def kv_digest(kv: KV) -> str:
    """Hex digest of a KV's shape, dtype and bytes: equal digests, identical tensors."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(kv.keys.shape), str(kv.keys.dtype), str(kv.values.dtype))).encode())
    for t in (kv.keys, kv.values):
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
