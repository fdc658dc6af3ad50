"""Estimate: the blockwise sums equal the weighted sum written out plainly, with the weights
(softmax over anchors of the scaled distances, times the per-layer factors) as documented."""

import pytest
import torch

import kvcomm.core.blocks as blocks
from kvcomm.core.estimate import Estimate
from kvcomm.core.kv import KV

L, H, D, FIRST = 4, 2, 8, 1


def rand_kv(layers: int, t: int, seed: int, dtype=torch.float32) -> KV:
    gen = torch.Generator().manual_seed(seed)
    return KV(torch.randn(layers, H, t, D, generator=gen).to(dtype), torch.randn(layers, H, t, D, generator=gen).to(dtype))


def estimate(t: int, per_token: bool, dtype=torch.float32) -> Estimate:
    """Three anchors' deviations of layers FIRST.., per-token or per-channel distances."""
    gen = torch.Generator().manual_seed(7)
    parts = tuple(rand_kv(L - FIRST, t, seed, dtype) for seed in range(3))
    distances = torch.rand(3, t, generator=gen) if per_token else torch.rand(3, L - FIRST, H, D, generator=gen)
    return Estimate(parts, distances, (1.0, 2.0, 0.5), 0.7, torch.rand(2, L - FIRST, generator=gen), FIRST, per_token)


def plain(est: Estimate, name: str) -> torch.Tensor:
    """sum_a w_a alpha part_a on layers FIRST.., zeros below: the definition, unblocked."""
    x = est.distances / torch.tensor(est.divisors).view(-1, *([1] * (est.distances.ndim - 1)))
    w = torch.softmax(-x / est.tau, dim=0)
    w = w[:, None, None, :, None] if est.per_token else w[:, :, :, None, :]
    w = w * est.alpha[0 if name == "keys" else 1][:, None, None, None]
    total = sum(wa * getattr(p, name).float() for p, wa in zip(est.parts, w))
    return torch.cat([torch.zeros(FIRST, *total.shape[1:]), total])


@pytest.mark.parametrize("one_layer_blocks", [False, True])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_into_equals_the_plain_weighted_sum(one_layer_blocks, per_token, dtype, monkeypatch):
    if one_layer_blocks:
        monkeypatch.setattr(blocks, "BLOCK_BYTES", 1)
    t = 5
    est = estimate(t, per_token, dtype)
    onto = rand_kv(L, t, 11)
    expected = KV(onto.keys + plain(est, "keys"), onto.values + plain(est, "values"))
    got = est.add_into(onto)
    assert got is onto
    torch.testing.assert_close(got.keys, expected.keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.values, expected.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_add_to_with_a_base_writes_base_plus_the_sum_without_reading_the_target(base_dtype):
    t, start, end = 4, 1, 3
    est = estimate(t, True)
    base = rand_kv(L, t, 12, base_dtype).keys[start:end]
    target = torch.full((end - start, H, t, D), float("nan"))  # never read
    est.add_to(target, "keys", start, end, base=base)
    torch.testing.assert_close(target, base.float() + plain(est, "keys")[start:end], rtol=0, atol=1e-5)


def test_a_target_cut_short_takes_the_first_tokens_of_per_token_weights():
    t = 6
    est = estimate(t, True)
    target = torch.zeros(L, H, t - 2, D)
    est.add_to(target, "values", 0, L)
    torch.testing.assert_close(target, plain(est, "values")[:, :, : t - 2], rtol=0, atol=1e-5)


def test_raw_head_sums_and_rows_are_the_same_estimate():
    """The fused path's raw form (per-head sums over a larger table, rows picked, scaled) gives
    the composite's logits."""
    est = estimate(4, True)
    heads = torch.rand(5, 3, 9)
    raw = Estimate(est.parts, heads, est.divisors, est.tau, est.alpha, FIRST, True, scale=0.25, rows=(4, 0, 2))
    torch.testing.assert_close(raw.logits(), heads[[4, 0, 2]].sum(1)[:, :4] * 0.25)
