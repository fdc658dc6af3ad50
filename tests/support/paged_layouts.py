"""Paged KV-cache layouts vLLM's attention backends have used, for tests and device checks of
``kvcomm.core.kv_target.Paged`` targets: each layout read through its own views, never through
the offset tables under test."""

from __future__ import annotations

from typing import Callable

import torch

from kvcomm.core.kv_target import Paged

Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(cache tensor, keys view ``[blocks, block_size, H, D]``, values view of the same shape)."""


def layouts(blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
            device: torch.device | str = "cpu") -> dict[str, Callable[[], Layer]]:
    """Per layout name, a factory of one zeroed layer."""
    def zeros(*shape):
        return torch.zeros(*shape, dtype=dtype, device=device)

    def flash_attention():  # [2, NB, BS, H, D]
        c = zeros(2, blocks, block_size, heads, dim)
        return c, c[0], c[1]

    def flashinfer():  # [NB, 2, BS, H, D]
        c = zeros(blocks, 2, block_size, heads, dim)
        return c, c[:, 0], c[:, 1]

    def packed():  # [NB, BS, H, 2, D] (vllm#44455)
        c = zeros(blocks, block_size, heads, 2, dim)
        return c, c[:, :, :, 0], c[:, :, :, 1]

    def cpu_transposed_keys():  # [NB, H, 2, ...]: keys transposed per block ([D, BS]), values [BS, D]
        c = zeros(blocks, heads, 2, block_size * dim)
        keys = c[:, :, 0].view(blocks, heads, dim, block_size).permute(0, 3, 1, 2)
        values = c[:, :, 1].view(blocks, heads, block_size, dim).permute(0, 2, 1, 3)
        return c, keys, values

    return {"flash_attention": flash_attention, "flashinfer": flashinfer, "packed": packed,
            "cpu_transposed_keys": cpu_transposed_keys}


def offsets(cache: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Storage offsets of ``view[0]``'s elements ``[block_size, H, D]`` relative to ``cache``'s block 0."""
    index = torch.arange(cache.numel()).view(cache.shape)
    return index.as_strided(view.shape, view.stride(), view.storage_offset())[0].clone()


def paged(layers: list[Layer]) -> Paged:
    """The ``Paged`` of layers made by one layout factory."""
    cache, keys, values = layers[0]
    block_stride = int(offsets(cache, keys[1:])[0, 0, 0] - offsets(cache, keys)[0, 0, 0])
    koff, voff = offsets(cache, keys), offsets(cache, values)
    return Paged(tuple(c for c, _, _ in layers), koff.to(cache.device), voff.to(cache.device), block_stride)


def read(layer: Layer, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[H, N, D]`` at ``slots``, read through the layout's own views."""
    _, keys, values = layer
    heads, dim = keys.shape[-2:]
    return keys.reshape(-1, heads, dim)[slots].transpose(0, 1), values.reshape(-1, heads, dim)[slots].transpose(0, 1)
