"""Matching every segment at once (``kvcomm.anchors.matching``): the fused path (Triton kernels,
in Triton's interpreter here) decides what the torch path decides, and its estimates serve the
same KV within float rounding. Small random KV, no model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcomm.anchors.anchor import Deviation
from kvcomm.anchors.config import PoolConfig
from kvcomm.anchors.matching import decide_all
from kvcomm.anchors.pool import AnchorPool
from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.place import Piece, place_all
from kvcomm.core.rope import Rotary

L, H, D = 3, 2, 16


def rand_kv(layers: int, t: int, gen: torch.Generator, scale: float = 1.0) -> KV:
    return KV(scale * torch.randn(layers, H, t, D, generator=gen), scale * torch.randn(layers, H, t, D, generator=gen))


def _pools(gen: torch.Generator, n: int = 12) -> tuple[list[AnchorPool], list]:
    """Two slots' pools (in the second every anchor is as far from the segment, and gamma is low)
    and the requests of five segments: admitted, refused by entropy, an identical anchor, too
    few anchors, a partly covered one. ``n``: the segments' length (anchors 2n/3 and 5n/3 too)."""
    pools = [AnchorPool(PoolConfig(gamma=1.0)), AnchorPool(PoolConfig(gamma=0.05))]
    slot = [("t", "a"), ("t", "b")]
    center = rand_kv(L, n, gen)
    for p, pool in enumerate(pools):
        for i in range(4):
            length = n if i < 3 else 2 * n // 3
            base = KV(center.keys[:, :, :length] + 0.3 * torch.randn(L, H, length, D, generator=gen),
                      center.values[:, :, :length] + (0.3 + 0.4 * i * (p == 0)) * torch.randn(L, H, length, D, generator=gen))
            following = rand_kv(L - 1, 3, gen)
            pool.record(slot[p], f"s{p}-{i}", base, np.eye(4, dtype=np.float32)[i], Deviation(rand_kv(L - 1, length, gen), following, "f", 1))
    near = KV(center.keys + 0.01, center.values + 0.01)
    requests = [
        pools[0].candidates(slot[0], "new", near, np.eye(4, dtype=np.float32)[0]),
        pools[1].candidates(slot[1], "new", near, np.eye(4, dtype=np.float32)[1]),
        pools[0].candidates(slot[0], "s0-1", pools[0].get("s0-1").base, np.eye(4, dtype=np.float32)[1]),
        AnchorPool().candidates(("t", "c"), "lonely", near, np.eye(4, dtype=np.float32)[0]),
        pools[0].candidates(slot[0], "long", rand_kv(L, 5 * n // 3, gen), np.eye(4, dtype=np.float32)[2]),
    ]
    return pools, requests


def _decide(fused: bool, monkeypatch, n: int = 12):
    monkeypatch.setenv("KVCOMM_TRITON", "1" if fused else "0")
    gen = torch.Generator().manual_seed(0)
    pools, requests = _pools(gen, n)
    return requests, decide_all(requests)


@pytest.mark.parametrize("n", [12, 75])  # one token block of the distances kernel, and three
def test_the_fused_path_decides_what_the_torch_path_decides(n, monkeypatch):
    _, torch_path = _decide(False, monkeypatch, n)
    _, fused = _decide(True, monkeypatch, n)
    kinds = []
    for a, b in zip(torch_path, fused):
        assert (a.match is None) == (b.match is None) and a.refusal == b.refusal
        np.testing.assert_allclose(a.p, b.p, rtol=1e-4, atol=1e-9)  # fp32 sums in another order, sharpened by the temperature
        if a.match is not None:
            assert [x.segment_id for x in a.match.anchors] == [x.segment_id for x in b.match.anchors]
            assert a.match.covered == b.match.covered and a.match.identical == b.match.identical
        kinds.append("identical" if a.match is not None and a.match.identical else
                     "match" if a.match is not None else a.refusal.split(" ")[1])
    # the cases the requests were built to reach
    assert kinds == ["match", "entropy", "identical", "compatible", "match"], kinds


@pytest.mark.parametrize("following", [False, True])
def test_the_fused_estimate_serves_what_the_torch_estimate_serves(following, monkeypatch):
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 1.0, D)
    served = []
    for fused in (False, True):
        requests, decisions = _decide(fused, monkeypatch)
        match, base = decisions[0].match, requests[0].base
        shared, follow = requests[0].pool.estimate_terms(match, base)
        piece = Piece(KV(torch.ones(L, H, 3, D), torch.ones(L, H, 3, D)), 0, 5, follow) if following else Piece(base, 0, 5, shared)
        out = KV(torch.zeros(L, H, piece.base.length, D), torch.zeros(L, H, piece.base.length, D))
        place_all([piece], KVTarget.contiguous(out, 0, piece.base.length), rotary)
        served.append(out)
    torch.testing.assert_close(served[1].keys, served[0].keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(served[1].values, served[0].values, rtol=1e-5, atol=1e-5)
