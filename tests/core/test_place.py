"""The fused writer (``kvcomm.core.place``): its Triton kernel, run in Triton's interpreter on
this CPU, writes what the torch composite writes, into a buffer and into every paged layout
vLLM has used, located by per-element offset tables rather than by a hand-coded layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.estimate import Estimate
from kvcomm.core.place import Piece, place_all
from kvcomm.core.rope import Rotary
from support.paged_layouts import layouts, paged, read

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


@pytest.mark.parametrize("layout", ["flash_attention", "flashinfer", "packed", "cpu_transposed_keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_paged_layout_gets_the_tokens_at_their_slots(layout, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    pieces = _pieces(dtype, True, 2, gen)
    rotary = _rotary(D, False)
    blocks, block_size = 6, 4
    slots = torch.randperm(blocks * block_size, generator=gen)[: T + 5]
    make = layouts(blocks, block_size, H, D, dtype)[layout]
    held = {}

    def target():
        held["layers"] = [make() for _ in range(L)]
        return KVTarget.at_slots(paged(held["layers"]), slots)

    reference = KVTarget.contiguous(KV(torch.zeros(L, H, T + 5, D, dtype=dtype), torch.zeros(L, H, T + 5, D, dtype=dtype)), 0, T + 5)
    monkeypatch.setenv("KVCOMM_TRITON", "0")
    place_all(pieces, reference, rotary)
    for interpret in (False, True):
        _written(target, pieces, rotary, interpret, monkeypatch)
        for layer, held_layer in enumerate(held["layers"]):  # read back through the layout itself
            got_k, got_v = read(held_layer, slots)
            _close(got_k, reference.buffer.keys[layer], dtype)
            _close(got_v, reference.buffer.values[layer], dtype)


@pytest.mark.parametrize("layout", ["flash_attention", "packed", "cpu_transposed_keys"])
def test_copying_tokens_out_of_a_paged_layout_reads_them_back_exactly(layout, monkeypatch):
    """``kvcomm.core.copy.copy_tokens`` (the vLLM worker's capture): paged slots -> a buffer,
    bit-exact on both paths."""
    from kvcomm.core.copy import copy_tokens

    gen = torch.Generator().manual_seed(2)
    blocks, block_size, dtype = 6, 4, torch.bfloat16
    slots = torch.randperm(blocks * block_size, generator=gen)[:9]
    layers = [layouts(blocks, block_size, H, D, dtype)[layout]() for _ in range(L)]
    for _, keys, values in layers:
        keys.copy_(torch.randn(keys.shape, generator=gen).to(dtype))
        values.copy_(torch.randn(values.shape, generator=gen).to(dtype))
    source = KVTarget.at_slots(paged(layers), slots)
    for interpret in ("0", "1"):
        monkeypatch.setenv("KVCOMM_TRITON", interpret)
        out = KV(torch.zeros(L, H, 12, D, dtype=dtype), torch.zeros(L, H, 12, D, dtype=dtype))
        copy_tokens(source, KVTarget.contiguous(out, 2, len(slots)))
        for layer, held_layer in enumerate(layers):
            keys, values = read(held_layer, slots)
            assert torch.equal(out.keys[layer, :, 2:11], keys) and torch.equal(out.values[layer, :, 2:11], values)
        assert out.keys[:, :, :2].abs().sum() == 0 and out.keys[:, :, 11:].abs().sum() == 0


def test_a_clipped_piece_writes_what_the_whole_piece_writes_there(monkeypatch):
    """The vLLM worker writes only the tokens beyond vLLM's own prefix hit: a plan's pieces
    clipped to that range write exactly those tokens of the whole plan."""
    from kvcomm.core.place import clip

    gen = torch.Generator().manual_seed(3)
    pieces = _pieces(torch.float32, True, 2, gen, raw=True)
    rotary = _rotary(D, False)
    for interpret in ("0", "1"):
        monkeypatch.setenv("KVCOMM_TRITON", interpret)
        whole = KV(torch.zeros(L, H, T + 5, D), torch.zeros(L, H, T + 5, D))
        place_all(pieces, KVTarget.contiguous(whole, 0, T + 5), rotary)
        part = KV(torch.zeros(L, H, T, D), torch.zeros(L, H, T, D))
        place_all(clip(pieces, 4, T + 4), KVTarget.contiguous(part, 0, T), rotary)
        assert torch.equal(part.keys, whole.keys[:, :, 4 : T + 4]) and torch.equal(part.values, whole.values[:, :, 4 : T + 4])
