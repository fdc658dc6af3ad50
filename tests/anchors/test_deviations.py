"""WeightedDeviations: the blockwise sums equal the weighted sum written out plainly."""

import pytest
import torch

import kvcomm.core.blocks as blocks
from kvcomm.anchors.deviations import WeightedDeviations
from kvcomm.core.kv import KV

L, H, D = 4, 2, 8


def rand_kv(t: int, seed: int, dtype=torch.float32) -> KV:
    gen = torch.Generator().manual_seed(seed)
    return KV(torch.randn(L, H, t, D, generator=gen).to(dtype), torch.randn(L, H, t, D, generator=gen).to(dtype))


def deviations(t: int, dtype=torch.float32) -> WeightedDeviations:
    """Three parts of ``t + 2`` tokens: per-token, per-channel and scalar weights."""
    gen = torch.Generator().manual_seed(7)
    parts = tuple(rand_kv(t + 2, seed, dtype) for seed in range(3))
    weights = (torch.rand(1, 1, t, 1, generator=gen), torch.rand(L, H, 1, D, generator=gen), torch.tensor(0.3))
    return WeightedDeviations(parts, weights, tuple(w * 2 for w in weights))


def plain(dev: WeightedDeviations, name: str, t: int) -> torch.Tensor:
    weights = dev.key_weights if name == "keys" else dev.value_weights
    return sum(w * getattr(p, name)[:, :, :t].float() for p, w in zip(dev.parts, weights))


@pytest.mark.parametrize("one_layer_blocks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_into_equals_the_plain_weighted_sum(one_layer_blocks, dtype, monkeypatch):
    if one_layer_blocks:
        monkeypatch.setattr(blocks, "BLOCK_BYTES", 1)
    t = 5
    dev = deviations(t, dtype)
    onto = rand_kv(t, 11)
    expected = KV(onto.keys + plain(dev, "keys", t), onto.values + plain(dev, "values", t))
    got = dev.add_into(onto)
    assert got is onto
    torch.testing.assert_close(got.keys, expected.keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.values, expected.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_add_to_with_a_base_writes_base_plus_the_sum_without_reading_the_target(base_dtype):
    t, start, end = 4, 1, 3
    dev = deviations(t)
    base = rand_kv(t, 12, base_dtype).keys[start:end]
    target = torch.full((end - start, H, t, D), float("nan"))  # never read
    dev.add_to(target, "keys", start, end, base=base)
    expected = base.float() + plain(dev, "keys", t)[start:end]
    torch.testing.assert_close(target, expected, rtol=0, atol=1e-5)


def test_add_to_with_a_base_and_no_parts_copies_the_base():
    base = rand_kv(3, 13).values
    target = torch.empty_like(base)
    WeightedDeviations((), (), ()).add_to(target, "values", 0, L, base=base)
    assert torch.equal(target, base)
