"""An estimated deviation: the anchors' deviations of ``n`` tokens, weighted, kept as its terms.

``sum_a w_a * alpha * parts[a]``, with ``w_a = softmax_a(-(x_a / divisor_a) / tau)`` per element,
``x_a`` the anchor's distance to the segment (per token, or per layer, head and channel) and
``alpha`` the slot's per-layer shrinkage. The fused writer (``kvcomm.core.place``) computes the
weights inside its kernel from these numbers; the torch composite adds the terms layer block
by layer block (``add_to``) while the block is in cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvcomm.core.blocks import block_layers
from kvcomm.core.device import staged
from kvcomm.core.kv import KV


@dataclass(frozen=True)
class Estimate:
    """parts: per anchor, position-free deviation KV ``[layers - first_layer, kv_heads, n,
    head_dim]`` for model layers ``first_layer..``.

    distances: fp32, per token (``per_token``): ``[A, n]``, or ``[A, heads, >= n]`` head partials
        summed over ``heads`` (the fused path's raw sums); per channel: ``[A, layers - first_layer,
        kv_heads, head_dim]``. Then multiplied by ``scale``, and square-rooted under ``sqrt``.
    rows: which row of ``distances`` is each part's (None: row ``a`` is part ``a``).
    divisors: per anchor, host floats. alpha: fp32 ``[2, layers - first_layer]``, the per-layer factor of the
        key (row 0) and value (row 1) weights (ones: unshrunk).
    """

    parts: tuple[KV, ...]
    distances: torch.Tensor
    divisors: tuple[float, ...]
    tau: float
    alpha: torch.Tensor
    first_layer: int
    per_token: bool
    scale: float = 1.0
    sqrt: bool = False
    rows: tuple[int, ...] | None = None

    def span(self, start: int, end: int) -> "Estimate":
        """This estimate over its tokens ``[start, end)`` (views; per-channel weights are the same
        for every token)."""
        parts = tuple(p.span(start, end) for p in self.parts)
        distances = self.distances
        if self.per_token:
            distances = distances[..., start:end]
        return replace(self, parts=parts, distances=distances)

    @property
    def layers(self) -> int:
        """Model layers the estimate covers: ``first_layer`` + the parts' layers."""
        return self.first_layer + self.parts[0].keys.shape[0]

    def logits(self) -> torch.Tensor:
        """``x_a`` in the composite's form: ``[A, n]`` per token, ``[A, L', H, D]`` per channel."""
        x = self.distances if self.rows is None else self.distances[list(self.rows)]
        if self.per_token and x.ndim == 3:
            x = x.sum(1)
        if self.scale != 1.0:
            x = x * self.scale
        if self.per_token:
            x = x[:, : self.parts[0].keys.shape[2]]
        return x.sqrt() if self.sqrt else x

    def weights(self, name: str) -> tuple[torch.Tensor, ...]:
        """Per anchor, ``w_a`` times alpha's ``name`` row ("keys" or "values"), broadcastable
        against a part: ``[L', 1, n, 1]`` per token, ``[L', H, 1, D]`` per channel."""
        x = self.logits()
        host = torch.tensor(self.divisors, dtype=torch.float32)  # staged: the copy does not make the host wait
        divisors = staged(host, x.device).to(x.device, non_blocking=True).view(-1, *([1] * (x.ndim - 1)))
        w = torch.softmax(-(x / divisors) / self.tau, dim=0)
        row = self.alpha[0 if name == "keys" else 1][:, None, None, None]
        w = w[:, None, None, :, None] if self.per_token else w[:, :, :, None, :]
        return tuple(w * row)

    def add_to(self, target: torch.Tensor, name: str, start: int, end: int, base: torch.Tensor | None = None,
               weights: tuple[torch.Tensor, ...] | None = None) -> None:
        """``target += sum_a w_a * part_a`` over model layers ``[start, end)``, in anchor order,
        in place; with ``base``, ``target = base + sum_a w_a * part_a`` (one pass fewer than
        copying first). Layers below ``first_layer`` get nothing added.

        target: fp32 ``[end - start, kv_heads, T, head_dim]``; base: the same shape, any float
        dtype, not aliasing target; name: "keys" or "values"; weights: ``weights(name)`` if
        the caller already has them."""
        skip = min(max(self.first_layer - start, 0), end - start)
        if skip:
            if base is not None:
                target[:skip].copy_(base[:skip])
            target, base, start = target[skip:], None if base is None else base[skip:], start + skip
        if start >= end:
            return
        lo, hi = start - self.first_layer, end - self.first_layer  # in the parts' layers
        length = target.shape[2]
        for part, w in zip(self.parts, weights if weights is not None else self.weights(name)):
            w = w[lo:hi] if w.shape[0] > 1 else w
            if self.per_token:  # a target cut short of the parts (the prompt's last token is computed)
                w = w[:, :, :length]
            term = getattr(part, name)[lo:hi, :, :length].float()
            if base is None:
                target.addcmul_(term, w)
            else:
                torch.addcmul(base, term, w, out=target)
                base = None
        if base is not None:  # no parts
            target.copy_(base)

    def add_into(self, onto: KV | None = None) -> KV:
        """``onto + sum_a w_a * part_a`` for keys and values, in place in ``onto`` (fp32 zeros of
        ``[self.layers, ...]`` and the first part's other sizes if None), over cache-sized blocks
        of layers, all anchors per block."""
        if onto is None:
            like = self.parts[0].keys
            shape = (self.layers, *like.shape[1:])
            onto = KV(*(torch.zeros(shape, dtype=torch.float32, device=like.device) for _ in range(2)))
        layers = onto.keys.shape[0]
        block = block_layers(layers, onto.keys[0].numel() * onto.keys.element_size(), onto.keys.device)
        for name in ("keys", "values"):
            target = getattr(onto, name)
            weights = self.weights(name)
            for start in range(0, layers, block):
                self.add_to(target[start : start + block], name, start, min(start + block, layers), weights=weights)
        return onto
