"""A weighted sum of anchors' deviations, kept as its terms so it can be added block by block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomm.core.blocks import block_layers
from kvcomm.core.kv import KV


@dataclass(frozen=True)
class WeightedDeviations:
    """``sum_a w_a * part_a`` kept as its terms, so a caller can add it layer block by layer
    block while the block is in cache (``add_to``) or all at once (``add_into``).

    parts: per anchor, position-free KV ``[layers - first_layer, kv_heads, T_a, head_dim]``
        for model layers ``first_layer..`` (``T_a`` >= the target's token count; a target
        shorter than a part takes its first tokens).
    key_weights, value_weights: per anchor, fp32, broadcastable against a part: ``[1, 1, T, 1]``
        per token, ``[layers - first_layer, kv_heads, 1, head_dim]`` per channel, or a scalar.
    first_layer: model layers below it get no deviation (the base is served as it is).
    """

    parts: tuple[KV, ...]
    key_weights: tuple[torch.Tensor, ...]
    value_weights: tuple[torch.Tensor, ...]
    first_layer: int = 0

    @property
    def layers(self) -> int:
        """Model layers the sum covers: ``first_layer`` + the parts' layers."""
        return self.first_layer + self.parts[0].keys.shape[0]

    def add_to(self, target: torch.Tensor, name: str, start: int, end: int, base: torch.Tensor | None = None) -> None:
        """``target += sum_a w_a * part_a`` over model layers ``[start, end)``, in anchor order, in
        place; with ``base``, ``target = base + sum_a w_a * part_a`` (one pass fewer than copying
        first). Layers below ``first_layer`` get nothing added.

        target: fp32 ``[end - start, kv_heads, T, head_dim]``; base: the same shape, any float
        dtype, not aliasing target; name: "keys" or "values"."""
        skip = min(max(self.first_layer - start, 0), end - start)
        if skip:
            if base is not None:
                target[:skip].copy_(base[:skip])
            target, base, start = target[skip:], None if base is None else base[skip:], start + skip
        if start >= end:
            return
        lo, hi = start - self.first_layer, end - self.first_layer  # in the parts' layers
        weights = self.key_weights if name == "keys" else self.value_weights
        length = target.shape[2]
        for part, w in zip(self.parts, weights):
            w = w[lo:hi] if w.ndim == 4 and w.shape[0] > 1 else w
            term = getattr(part, name)[lo:hi, :, :length].float()
            if base is None:
                target.addcmul_(term, w)
            else:
                torch.addcmul(base, term, w, out=target)
                base = None
        if base is not None:  # no parts
            target.copy_(base)

    def add_into(self, onto: KV | None = None) -> KV:
        """``onto + sum_a w_a * part_a`` for keys and values, in place in ``onto`` (fp32 zeros
        of ``[self.layers, ...]`` and the first part's other sizes if None). Runs over cache-sized
        blocks of layers, all anchors per block, so each block of ``onto`` stays in cache while
        the deviations stream past."""
        if onto is None:
            like = self.parts[0].keys
            shape = (self.layers, *like.shape[1:])
            onto = KV(*(torch.zeros(shape, dtype=torch.float32, device=like.device) for _ in range(2)))
        layers = onto.keys.shape[0]
        block = block_layers(layers, onto.keys[0].numel() * onto.keys.element_size(), onto.keys.device)
        for name in ("keys", "values"):
            target = getattr(onto, name)
            for start in range(0, layers, block):
                self.add_to(target[start : start + block], name, start, min(start + block, layers))
        return onto
