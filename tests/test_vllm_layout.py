"""Token KV in vLLM's CPU paged cache: written with the backend's op, read back exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvcomm.integrations.vllm_layout import read_slots, write_slots  # noqa: E402


def _isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([32, 64]),
    count=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_read_returns_what_the_backend_op_wrote(dtype, heads, head_dim, count, seed):
    generator = torch.Generator().manual_seed(seed)
    blocks, block_size = 4, 32
    cache = torch.randn(blocks, heads, block_size, 2 * head_dim, generator=generator).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=generator)[:count]
    keys = torch.randn(count, heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(count, heads, head_dim, generator=generator).to(dtype)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    others = torch.nonzero(untouched).view(-1)
    before = read_slots(cache, others, _isa(dtype, block_size, head_dim))
    write_slots(cache, keys, values, slots, _isa(dtype, block_size, head_dim))
    got_keys, got_values = read_slots(cache, slots, _isa(dtype, block_size, head_dim))
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    after = read_slots(cache, others, _isa(dtype, block_size, head_dim))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])  # other slots untouched


def test_a_non_cpu_cache_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="CPU attention"):
        read_slots(torch.zeros(2, 4, 16, 2, 64), torch.tensor([0]), "vec")
