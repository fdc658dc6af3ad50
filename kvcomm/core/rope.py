"""Exact rotary position embedding (RoPE) arithmetic on cached keys.

A RoPE model caches ``k_cached = s * R(p) k`` for a token at position ``p``, where
``R(p)`` rotates each channel pair ``i`` by the angle ``p * inv_freq[i]`` and ``s`` is
the attention scaling factor that yarn/longrope multiply into cos and sin (1 otherwise).
Rotations compose and are orthogonal, so

* ``unrotate`` maps cached keys back to position-free keys ``k`` (divides ``s`` out),
* ``rotate`` places position-free keys at any target positions,
* ``shift`` moves cached keys by ``delta`` positions: ``R(delta)`` alone, ``s`` unchanged.

Values carry no position and are never touched here. The numbers (``inv_freq``,
scaling, pairing, rotary width) come from the loaded model itself; this module knows no
model library. Tensors are ``[..., T, head_dim]`` with positions ``[T]`` (or
broadcastable to the leading dims + ``[T]``), in any float dtype; angles are computed in
fp32 the same way transformers does, and the rotation itself is done in fp32 (fp64 for fp64
inputs) with one rounding to the output dtype at the end, so for bf16/fp16 keys a rotate here
is within half an ulp of the exact rotation, closer than the model's own RoPE (which rounds
cos, sin and each product to the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class RopeError(ValueError):
    """The model's rotary embedding cannot be realigned exactly."""


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding, as numbers.

    inv_freq: ``[rotary_dim // 2]`` fp32 inverse frequencies, scaling type already applied.
    attention_scaling: factor multiplied into cos and sin (yarn, longrope), else 1.0.
    head_dim: channels per head; channels ``>= rotary_dim`` pass through unrotated.
    interleaved: channel pairs are ``(2i, 2i+1)`` (GPT-J style) instead of ``(i, i + d/2)``
        (GPT-NeoX "rotate_half" style).
    max_exact_length: sequence length up to which ``inv_freq`` is fixed; dynamic NTK and
        longrope switch frequencies beyond their original context, so realignment past it
        is refused. ``None`` means no limit.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    head_dim: int = 0
    interleaved: bool = False
    max_exact_length: int | None = None
    _tables: dict = field(default_factory=dict, compare=False, repr=False)
    """device -> (cos, sin) of positions ``[0, P)`` (``cos_sin_table``)."""

    def __post_init__(self) -> None:
        if self.inv_freq.ndim != 1 or self.inv_freq.numel() == 0:
            raise RopeError(f"inv_freq must be a non-empty 1-D tensor, got shape {tuple(self.inv_freq.shape)}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.rotary_dim)
        if self.rotary_dim > self.head_dim:
            raise RopeError(f"rotary dim {self.rotary_dim} exceeds head_dim {self.head_dim}")
        if not self.attention_scaling > 0:
            raise RopeError(f"attention_scaling must be positive, got {self.attention_scaling}")
        object.__setattr__(self, "inv_freq", self.inv_freq.detach().to("cpu", torch.float32))

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def check_length(self, length: int) -> None:
        """Raise RopeError if keys of a ``length``-token sequence may use other frequencies."""
        if self.max_exact_length is not None and length > self.max_exact_length:
            raise RopeError(
                f"sequence of {length} tokens exceeds {self.max_exact_length}, where this model's "
                "dynamic RoPE changes its frequencies; realignment would not be exact"
            )

    def cos_sin(self, positions: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scaled ``cos, sin`` per channel pair, ``positions.shape + [rotary_dim // 2]``, fp32.

        Angles are ``position * inv_freq`` in fp32, as transformers computes them.
        """
        inv_freq = self.inv_freq.to(device or positions.device)
        freqs = positions.to(inv_freq.device)[..., None].float() * inv_freq
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def cos_sin_table(self, device: torch.device | str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of positions ``[0, P)`` with ``P >= length``, fp32 ``[P, rotary_dim // 2]``
        each on ``device``, computed once per device (grown by doubling): the fused writer reads
        rows of it instead of computing angles per call. Row ``p`` equals ``cos_sin(p)`` exactly."""
        device = torch.device(device)
        held = self._tables.get(device)
        if held is None or held[0].shape[0] < length:
            size = max(length, 2 * held[0].shape[0] if held is not None else 4096)
            held = self.cos_sin(torch.arange(size, dtype=torch.int64, device=device), device)
            self._tables[device] = held
        return held

    def _pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first and second channel of every rotated pair."""
        d = self.rotary_dim
        if self.interleaved:
            return x[..., 0:d:2], x[..., 1:d:2]
        return x[..., : d // 2], x[..., d // 2 : d]

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` per pair, written into ``out``
        (fresh, like ``x``, if None; must not alias ``x``). Pass-through channels are copied.

        The arithmetic runs in fp32 (fp64 for fp64 inputs) whatever the dtypes of ``x`` and
        ``out``: bf16/fp16 keys and fp32 cos/sin are multiplied and summed in fp32 and each
        output element is rounded to ``out.dtype`` once, at the end. When ``x`` and ``out``
        are both already fp32 (or both fp64) the pairs are written in place, without a temporary.
        """
        if x.shape[-1] != self.head_dim:
            raise RopeError(f"expected head_dim {self.head_dim} in the last axis, got shape {tuple(x.shape)}")
        out = torch.empty_like(x) if out is None else out
        work = torch.promote_types(x.dtype, torch.float32)
        cos, sin = cos.to(work), sin.to(work)
        direct = x.dtype == work and out.dtype == work
        d = self.rotary_dim
        rotated = out if direct else torch.empty((*out.shape[:-1], d), dtype=work, device=out.device)
        (x1, x2), (o1, o2) = self._pairs(x), self._pairs(rotated)
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
        if not direct:
            out[..., :d].copy_(rotated)
        if d < self.head_dim:
            out[..., d:] = x[..., d:]
        return out

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Position-free keys ``[..., T, head_dim]`` -> keys as the model caches them at ``positions`` ``[T]``.
        ``cos_sin``: ``self.cos_sin(positions)`` if the caller already has it (rotating block by block)."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, x.device)
        return self._apply(x, cos, sin, out)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cached keys at ``positions`` -> position-free keys (inverse of ``rotate``)."""
        cos, sin = self.cos_sin(positions, x.device)
        scale2 = self.attention_scaling**2
        return self._apply(x, cos / scale2, -sin / scale2, None)

    def shift(self, x: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Cached keys at positions ``p`` -> cached keys at ``p + delta`` (``R(delta)``, scaling kept)."""
        delta = torch.as_tensor(delta)
        cos, sin = self.cos_sin(delta, x.device)
        s = self.attention_scaling
        return self._apply(x, cos / s, sin / s, None)
