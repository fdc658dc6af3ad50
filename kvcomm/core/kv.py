"""The KV of a token span, for every layer at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomm.core.rope import Rotary


@dataclass(frozen=True)
class KV:
    """Keys and values of ``T`` consecutive tokens.

    keys, values: ``[layers, kv_heads, T, head_dim]``, same dtype and device.
    Whether keys are rotated (as cached at absolute positions) or position-free is a
    property of where a KV is kept, not of this class; functions say which they take.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.ndim != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"keys and values must both be [layers, kv_heads, T, head_dim], got "
                f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def span(self, start: int, end: int) -> "KV":
        """Tokens ``[start, end)`` (a view, no copy)."""
        return KV(self.keys[:, :, start:end], self.values[:, :, start:end])

    def to(self, dtype: torch.dtype) -> "KV":
        return KV(self.keys.to(dtype), self.values.to(dtype))

    def clone(self) -> "KV":
        return KV(self.keys.clone(), self.values.clone())

    def __add__(self, other: "KV") -> "KV":
        return KV(self.keys + other.keys.to(self.keys.dtype), self.values + other.values.to(self.values.dtype))

    def __sub__(self, other: "KV") -> "KV":
        return KV(self.keys - other.keys.to(self.keys.dtype), self.values - other.values.to(self.values.dtype))

    @staticmethod
    def cat(parts: list["KV"]) -> "KV":
        return KV(torch.cat([p.keys for p in parts], dim=2), torch.cat([p.values for p in parts], dim=2))


def positions(start: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """Absolute positions ``[start, start + length)`` as an int64 tensor, made on ``device``
    (default: the host), so that no upload is needed where they are used."""
    return torch.arange(start, start + length, dtype=torch.int64, device=device)


def to_position_free(kv: KV, rotary: Rotary, start: int) -> KV:
    """KV cached at positions ``[start, start + T)`` -> position-free KV (keys de-rotated)."""
    return KV(rotary.unrotate(kv.keys, positions(start, kv.length, kv.keys.device)), kv.values)


def place(kv: KV, rotary: Rotary, start: int) -> KV:
    """Position-free KV -> KV as the model caches it at ``[start, start + T)``."""
    return KV(rotary.rotate(kv.keys, positions(start, kv.length, kv.keys.device)), kv.values)
