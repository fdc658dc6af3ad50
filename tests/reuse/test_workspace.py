"""KVWorkspace: lent memory is the right shape, reused after a lease ends, never lent twice at
once, and idle memory never exceeds the cap."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.reuse.workspace import KVWorkspace


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_lease_is_contiguous_kv_of_the_asked_shape_and_dtypes():
    workspace = KVWorkspace(1 << 20)
    with workspace.lease((3, 2, 7, 5), torch.float32, torch.bfloat16) as kv:
        assert kv.keys.shape == kv.values.shape == (3, 2, 7, 5)
        assert (kv.keys.dtype, kv.values.dtype) == (torch.float32, torch.bfloat16)
        assert kv.keys.is_contiguous() and kv.values.is_contiguous()
        assert kv.values.data_ptr() % 64 == 0
        assert not _overlap(_span(kv.keys), _span(kv.values))
        kv.keys.fill_(1.0)
        kv.values.fill_(2.0)
        assert kv.keys.sum() == 210 and kv.values.sum() == 420  # writing one never touches the other


def test_memory_is_lent_again_after_the_lease_even_one_left_by_an_error():
    workspace = KVWorkspace(1 << 20)
    with pytest.raises(RuntimeError, match="executor failed"):
        with workspace.lease((2, 2, 10, 4), torch.float32, torch.float32) as first:
            address = first.keys.data_ptr()
            raise RuntimeError("executor failed")
    assert workspace.idle_bytes > 0
    with workspace.lease((2, 2, 8, 4), torch.float32, torch.float32) as smaller:
        assert smaller.keys.data_ptr() == address
    assert workspace.idle_bytes > 0


def test_nothing_beyond_the_cap_is_kept():
    workspace = KVWorkspace(0)
    with workspace.lease((1, 1, 4, 4), torch.float32, torch.float32):
        pass
    assert workspace.idle_bytes == 0
    workspace = KVWorkspace(4 << 20)
    with workspace.lease((8, 8, 1024, 16), torch.float32, torch.float32):  # 8 MiB
        pass
    assert workspace.idle_bytes == 0
    with pytest.raises(ValueError, match="max_idle_bytes must be >= 0"):
        KVWorkspace(-1)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3 << 20),
       st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3000), st.booleans()), min_size=1, max_size=12))
def test_held_leases_never_share_memory_and_idle_memory_stays_under_the_cap(cap, steps):
    """Each step asks for ``[layers, 2, tokens, 16]`` fp32 KV and either keeps holding it (True)
    or releases every held lease (False)."""
    workspace = KVWorkspace(cap)
    with ExitStack() as held:
        spans = []
        for layers, tokens, keep in steps:
            kv = held.enter_context(workspace.lease((layers, 2, tokens, 16), torch.float32, torch.float32))
            for span in (_span(kv.keys), _span(kv.values)):
                assert not any(_overlap(span, other) for other in spans)
                spans.append(span)
            assert workspace.idle_bytes <= cap
            if not keep:
                held.close()
                spans.clear()
                assert workspace.idle_bytes <= cap


def test_threads_leasing_at_once_never_see_each_others_writes():
    workspace = KVWorkspace(64 << 20)
    errors = []

    def worker(mark: float) -> None:
        for tokens in range(50, 400, 50):
            with workspace.lease((4, 2, tokens, 32), torch.float32, torch.float32) as kv:
                kv.keys.fill_(mark)
                kv.values.fill_(-mark)
                for _ in range(20):
                    if not (torch.all(kv.keys == mark) and torch.all(kv.values == -mark)):
                        errors.append(mark)

    threads = [threading.Thread(target=worker, args=(float(i + 1),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert 0 < workspace.idle_bytes <= 64 << 20


def test_a_lease_is_on_the_asked_device_and_never_lends_another_devices_buffer():
    """The engine assembles on the device its KV lives on (a GPU's memory for a model there):
    a buffer kept idle for one device is never lent for another ("meta" stands in for a second
    device on a machine without one)."""
    workspace = KVWorkspace(1 << 20)
    with workspace.lease((2, 2, 8, 4), torch.float32, torch.float32, "meta") as on_meta:
        assert on_meta.keys.device.type == on_meta.values.device.type == "meta"
    assert workspace.idle_bytes > 0
    with workspace.lease((2, 2, 8, 4), torch.float32, torch.float32) as on_cpu:
        assert on_cpu.keys.device.type == "cpu"
        on_cpu.keys.fill_(1.0)  # real memory
    with workspace.lease((2, 2, 8, 4), torch.float32, torch.float32, "meta") as again:
        assert again.keys.device.type == "meta"
