"""Token KV in vLLM's paged cache: written with the layer's own ``do_kv_cache_update``, read
back exactly through a gather learned by probing that op (no layout hand-coded)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvcomm.integrations.vllm.connector.layout import KvIO, LayoutError  # noqa: E402


class _Layer(torch.nn.Module):
    """The attributes of vLLM's ``Attention`` module that a backend's ``do_kv_cache_update``
    reads (the real module needs a running engine's config; the op is vLLM's own)."""

    def __init__(self, impl, isa: str | None = None):
        super().__init__()
        self.impl = impl
        if isa is not None:
            self.isa = isa
        self._k_scale_float = self._v_scale_float = 1.0
        self._k_scale = self._v_scale = torch.ones(())


@functools.cache
def _vllm_config():
    """The engine config the CPU backend's implementation reads when it is built (the
    embedded model's)."""
    from vllm.config import ModelConfig, VllmConfig

    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    return VllmConfig(model_config=ModelConfig(model=str(resolve_model_dir(None)), dtype="float32"))


def _cpu_layer(dtype: torch.dtype, heads: int, head_dim: int, block_size: int) -> _Layer:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    with set_current_vllm_config(_vllm_config()):
        impl = CPUAttentionBackendImpl(heads, head_dim, head_dim ** -0.5, heads, None, None, "auto")
    return _Layer(impl, _get_attn_isa(dtype, block_size, head_dim, "auto"))


class _FlashLayoutImpl:
    """What ``reshape_and_cache_flash`` does on GPU backends (FlashAttention, FlashInfer,
    Triton), in plain torch: the cache is split ``kv_cache.transpose(1, 2).split(D, -1)``
    and each token's K/V is stored at its slot. Used only to show the learned gather follows
    a layout unlike the CPU one, on a cache with permuted strides as GPU runners allocate."""

    kv_cache_dtype = "auto"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_dim, dim=-1)
        block_size = kv_cache.shape[2]
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        key_cache[block, offset] = key
        value_cache[block, offset] = value


def _round_trip(io: KvIO, cache: torch.Tensor, count: int, generator: torch.Generator) -> None:
    blocks, heads, block_size, twice = cache.shape
    dim = twice // 2
    slots = torch.randperm(blocks * block_size, generator=generator)[:count]
    keys = torch.randn(count, heads, dim, generator=generator).to(cache.dtype)
    values = torch.randn(count, heads, dim, generator=generator).to(cache.dtype)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    others = torch.nonzero(untouched).view(-1)
    before = io.read(others)
    io.write(keys, values, slots)
    got_keys, got_values = io.read(slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    after = io.read(others)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])  # other slots untouched


@settings(max_examples=12, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([32, 64]),
    block_size=st.sampled_from([16, 32]),
    count=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_cpu_backend_read_returns_what_its_op_wrote(dtype, heads, head_dim, block_size, count, seed):
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(5, heads, block_size, 2 * head_dim, generator=generator).to(dtype)
    io = KvIO(_cpu_layer(dtype, heads, head_dim, block_size), cache)
    _round_trip(io, cache, count, generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_strided_gpu_style_layout_is_learned_too(dtype):
    generator = torch.Generator().manual_seed(1)
    blocks, heads, block_size, dim = 6, 2, 16, 32
    # Physically [num_blocks, block_size, heads, 2 * dim] (NHD), viewed logically as
    # [num_blocks, heads, block_size, 2 * dim]: the strides a GPU runner gives the layer.
    physical = torch.randn(blocks, block_size, heads, 2 * dim, generator=generator).to(dtype)
    cache = physical.permute(0, 2, 1, 3)
    assert not cache.is_contiguous()
    io = KvIO(_Layer(_FlashLayoutImpl(dim)), cache)
    _round_trip(io, cache, 40, generator)


def test_a_cache_carved_from_a_shared_buffer_reads_its_own_elements():
    """vLLM carves each layer's cache out of one buffer: a view at a storage offset. Reads
    index the storage, so they must start at the view's first element, not the buffer's."""
    generator = torch.Generator().manual_seed(2)
    blocks, heads, block_size, dim = 4, 2, 16, 32
    size = blocks * block_size * heads * 2 * dim
    buffer = torch.randn(3 * size, generator=generator)
    cache = buffer[size : 2 * size].view(blocks, block_size, heads, 2 * dim).permute(0, 2, 1, 3)
    assert cache.storage_offset() == size
    outside = torch.cat([buffer[:size], buffer[2 * size :]]).clone()
    io = KvIO(_Layer(_FlashLayoutImpl(dim)), cache)
    _round_trip(io, cache, 50, generator)
    assert torch.equal(torch.cat([buffer[:size], buffer[2 * size :]]), outside)


def test_a_cache_of_another_shape_is_a_clear_error():
    layer = _cpu_layer(torch.float32, 4, 64, 16)
    with pytest.raises(LayoutError, match="logical shape"):
        KvIO(layer, torch.zeros(2, 4, 16, 2, 64))


def test_a_quantized_cache_is_refused():
    layer = _cpu_layer(torch.float32, 2, 64, 16)
    with pytest.raises(LayoutError, match="kv_cache_dtype='auto'"):
        KvIO(layer, torch.zeros(2, 2, 16, 128, dtype=torch.float8_e4m3fn))


def test_an_op_that_loses_elements_fails_the_probe():
    class Lossy(_FlashLayoutImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            kv_cache[:, :, :, 0] = -5.0  # the first key channel is never stored

    with pytest.raises(LayoutError, match="distinct key elements"):
        KvIO(_Layer(Lossy(32)), torch.zeros(2, 2, 16, 64))


def test_a_backend_without_do_kv_cache_update_is_refused():
    with pytest.raises(LayoutError, match="do_kv_cache_update"):
        KvIO(_Layer(object()), torch.zeros(2, 2, 16, 64))
