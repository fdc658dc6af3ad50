"""``benchmarks/op_counter.py``: host syncs counted by CUDA's rules at the torch level, whichever
code makes the call (kvcomm's wrappers or plain torch)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from op_counter import DispatchCounter  # noqa: E402

from kvcomm.core import device  # noqa: E402

DEV = torch.device("cpu")  # the KV's device on this machine: a torch.device means the device


def _count(fn, host=()) -> tuple[int, dict]:
    with DispatchCounter(host=host) as counter:
        fn()
    return counter.counts.host_syncs, counter.counts.syncs


def test_pageable_uploads_are_syncs_non_blocking_or_not():
    table = np.arange(6, dtype=np.int64)
    assert _count(lambda: torch.from_numpy(table).to(DEV))[0] == 1
    assert _count(lambda: torch.from_numpy(table).to(DEV, non_blocking=True))[0] == 1
    assert _count(lambda: torch.tensor([1, 2, 3], device=DEV))[0] == 1
    assert _count(lambda: torch.as_tensor(table, device=DEV))[0] == 1
    host = torch.arange(4)
    assert _count(lambda: host.to(DEV), host=(host,))[0] == 1
    assert _count(lambda: torch.empty(4, dtype=torch.int64, device=DEV).copy_(host), host=(host,))[0] == 1


def test_a_non_blocking_upload_from_pinned_memory_is_not_a_sync():
    table = np.arange(6, dtype=np.int64)
    syncs, _ = _count(lambda: device.upload(table, DEV))
    assert syncs == 0
    # the same staging copied blocking is a sync (CUDA waits for it)
    assert _count(lambda: device.staged(torch.from_numpy(table), DEV).to(DEV))[0] == 1


def test_reads_of_device_values_are_syncs_and_of_host_values_are_not():
    on_device = torch.arange(5.0)  # made before the counter: device memory
    for read in (lambda: on_device.cpu(), lambda: on_device.to("cpu"), lambda: on_device.tolist(),
                 lambda: on_device[0].item(), lambda: bool(on_device[1]), lambda: int(on_device[1]),
                 lambda: float(on_device[1]), lambda: on_device.numpy(), lambda: on_device.nonzero(),
                 lambda: torch.nonzero(on_device)):
        assert _count(read)[0] == 1
    host = torch.arange(5.0)
    for read in (lambda: host.tolist(), lambda: host[0].item(), lambda: int(host[2]), lambda: host.nonzero(),
                 lambda: (host * 2).tolist(), lambda: torch.zeros(3).tolist(), lambda: torch.from_numpy(np.ones(2)).sum().item()):
        assert _count(read, host=(host,))[0] == 0


def test_device_work_is_not_a_sync_and_host_work_is_no_device_op():
    on_device = torch.arange(5.0)
    with DispatchCounter() as counter:
        (on_device * 2 + 1).sum()
        torch.zeros(3, device=DEV).add_(1)
        on_device.to(DEV)  # already there
    assert counter.counts.host_syncs == 0 and counter.counts.kernel_ops >= 3
    host = torch.arange(5.0)
    with DispatchCounter(host=(host,)) as counter:
        (host * 2 + 1).sum()
        torch.from_numpy(np.arange(3)) // 2
    assert counter.counts.host_syncs == 0 and counter.counts.kernel_ops == 0, counter.counts.ops
