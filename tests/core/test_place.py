"""The fused writer (``kvcomm.core.place``): its Triton kernel, run in Triton's interpreter on
this CPU, writes what the torch composite writes, into a buffer and into every paged layout
vLLM has used, located by per-element offset tables rather than by a hand-coded layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget, Paged
from kvcomm.core.estimate import Estimate
from kvcomm.core.place import Piece, place_all
from kvcomm.core.rope import Rotary

L, H, T, D = 3, 2, 7, 16


def _rotary(rotary_dim: int, interleaved: bool) -> Rotary:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return Rotary(inv_freq, 1.3, D, interleaved)


def _pieces(dtype: torch.dtype, per_token: bool, anchors: int, gen: torch.Generator, raw: bool = False) -> list[Piece]:
    """An exact prefix, an estimated piece, a realigned one. ``raw``: the estimate's distances in
    the fused path's raw form (per-head sums, or squared sums, with rows of a larger table)."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    base = KV(rand(L, H, T + 4, D), rand(L, H, T + 4, D)).span(0, T)
    parts = tuple(KV(rand(L - 1, H, T + 2, D), rand(L - 1, H, T + 2, D)).span(0, T) for _ in range(anchors))
    divisors = tuple(float(1 + d) for d in torch.rand(anchors, generator=gen))
    alpha = torch.rand(2, L - 1, generator=gen)
    rows = tuple(range(anchors + 1))[1:] if raw else None
    if per_token:
        logits = torch.rand(anchors + 1, H, T + 3, generator=gen) if raw else torch.rand(anchors, T, generator=gen)
    else:
        logits = torch.rand(anchors + 1, L - 1, H, D, generator=gen) if raw else torch.rand(anchors, L - 1, H, D, generator=gen)
    estimate = Estimate(parts, logits, divisors, 0.7, alpha, 1, per_token, scale=0.3 if raw else 1.0,
                        sqrt=raw and not per_token, rows=rows)
    exact = KV(rand(L, H, 2, D), rand(L, H, 2, D))
    return [Piece(exact, 0, 0, None, rotate=False), Piece(base, 2, 40, estimate), Piece(base.span(0, 3), 2 + T, 47)]


def _ulp(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to one rounding of the output dtype (the kernel sums in another order)."""
    a, b = a.float(), b.float()
    assert torch.all((a - b).abs() <= _ulp(dtype) * b.abs().clamp_min(1) * 2), (a - b).abs().max()


def _written(target_factory, pieces, rotary, interpret: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("KVCOMM_TRITON", "1" if interpret else "0")
    target = target_factory()
    place_all(pieces, target, rotary)
    return torch.stack([torch.stack(target.read(layer)) for layer in range(L)])


CASES = list(itertools.product([torch.float32, torch.bfloat16, torch.float16], [False, True], [D, D // 2], [True, False],
                               [False, True]))


@pytest.mark.parametrize("dtype, interleaved, rotary_dim, per_token, raw", CASES)
def test_the_kernel_writes_what_the_composite_writes_into_a_buffer(dtype, interleaved, rotary_dim, per_token, raw, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    pieces = _pieces(dtype, per_token, 3, gen, raw)
    rotary = _rotary(rotary_dim, interleaved)

    def target():
        return KVTarget.contiguous(KV(torch.zeros(L, H, T + 9, D, dtype=dtype), torch.zeros(L, H, T + 9, D, dtype=dtype)), 1, T + 5)

    expected = _written(target, pieces, rotary, False, monkeypatch)
    _close(_written(target, pieces, rotary, True, monkeypatch), expected, dtype)
    assert expected[:, :, :, 2:].abs().sum() > 0  # the pieces landed


def _layouts(blocks: int, block_size: int, dtype: torch.dtype):
    """Physical layouts vLLM's backends have used, each with a ``[blocks, block_size, H, D]``
    view of its keys and of its values (the test's own reading of the layout)."""
    def flash_attention():  # [2, NB, BS, H, D]
        c = torch.zeros(2, blocks, block_size, H, D, dtype=dtype)
        return c, c[0], c[1]

    def flashinfer():  # [NB, 2, BS, H, D]
        c = torch.zeros(blocks, 2, block_size, H, D, dtype=dtype)
        return c, c[:, 0], c[:, 1]

    def packed():  # [NB, BS, H, 2, D] (vllm#44455)
        c = torch.zeros(blocks, block_size, H, 2, D, dtype=dtype)
        return c, c[:, :, :, 0], c[:, :, :, 1]

    def cpu_transposed_keys():  # [NB, H, 2, ...]: keys transposed per block ([D, BS]), values [BS, D]
        c = torch.zeros(blocks, H, 2, block_size * D, dtype=dtype)
        keys = c[:, :, 0].view(blocks, H, D, block_size).permute(0, 3, 1, 2)
        values = c[:, :, 1].view(blocks, H, block_size, D).permute(0, 2, 1, 3)
        return c, keys, values

    return {"flash_attention": flash_attention, "flashinfer": flashinfer, "packed": packed, "cpu_transposed_keys": cpu_transposed_keys}


def _offsets(cache: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Storage offsets of ``view[0]``'s elements ``[block_size, H, D]`` relative to ``cache``'s block 0."""
    index = torch.arange(cache.numel()).view(cache.shape)
    return index.as_strided(view.shape, view.stride(), view.storage_offset())[0].clone()


@pytest.mark.parametrize("layout", ["flash_attention", "flashinfer", "packed", "cpu_transposed_keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_paged_layout_gets_the_tokens_at_their_slots(layout, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    pieces = _pieces(dtype, True, 2, gen)
    rotary = _rotary(D, False)
    blocks, block_size = 6, 4
    slots = torch.randperm(blocks * block_size, generator=gen)[: T + 5]
    make = _layouts(blocks, block_size, dtype)[layout]
    held = {}

    def target():
        layers = [make() for _ in range(L)]
        cache, keys, values = layers[0]
        # the first block's elements relative to the block start; a block is one step of the block axis
        block_stride = _offsets(cache, keys[1:])[0, 0, 0] - _offsets(cache, keys)[0, 0, 0]
        held["views"] = [(k, v) for _, k, v in layers]
        return KVTarget.at_slots(Paged(tuple(c for c, _, _ in layers), _offsets(cache, keys), _offsets(cache, values),
                                       int(block_stride)), slots)

    reference = KVTarget.contiguous(KV(torch.zeros(L, H, T + 5, D, dtype=dtype), torch.zeros(L, H, T + 5, D, dtype=dtype)), 0, T + 5)
    monkeypatch.setenv("KVCOMM_TRITON", "0")
    place_all(pieces, reference, rotary)
    for interpret in (False, True):
        _written(target, pieces, rotary, interpret, monkeypatch)
        for layer, (keys, values) in enumerate(held["views"]):  # read back through the layout itself
            got_k = keys.reshape(-1, H, D)[slots].transpose(0, 1)
            got_v = values.reshape(-1, H, D)[slots].transpose(0, 1)
            _close(got_k, reference.buffer.keys[layer], dtype)
            _close(got_v, reference.buffer.values[layer], dtype)
