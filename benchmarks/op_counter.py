"""A dispatch-level counter of device cost: kernels, host synchronizations, bytes moved.

``DispatchCounter`` is a ``TorchDispatchMode``: every aten or ``kvcomm::`` operator dispatched
inside it is one device operation, except views and allocations (no kernel runs). Bytes
moved: for an aten operator, the bytes of its tensor arguments and results (what a kernel
reads and writes; a view counts the elements it addresses); for a ``kvcomm::`` operator, the
bytes its kernel moves as ``kvcomm.core.device.OP_BYTES`` computes them from its arguments
(its pointer tables address tensors a dispatch-level view cannot see). A host sync: an
operator whose result the host must wait for (``_local_scalar_dense``, ``nonzero``, ``equal``,
...), or a call of ``kvcomm.core.device.host_read``. Triton launches are counted too
(``triton_launches``): every launch on the reuse path must be a ``kvcomm::`` operator.

These are what a GPU pays per call, measured on any machine: on a CPU the reuse path runs
the same operators (with ``TRITON_INTERPRET=1`` its Triton kernels run in Triton's
interpreter), so the counts are those of a GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvcomm.core.device as device

FREE = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.lift_fresh.default", "aten.detach.default", "aten.alias.default",
    "aten._reshape_alias.default", "aten.set_.source_Storage_storage_offset", "aten.resize_.default",
}
"""Operators that allocate or alias without running a kernel (views are recognised by ``is_view``)."""

SYNCS = {
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default",
    "aten.masked_select.default", "aten.allclose.default", "aten.unique_dim.default", "aten._unique2.default",
    "aten.item.default",
}
"""Operators whose result the host waits for."""


@dataclass
class Counts:
    kernel_ops: int = 0
    host_syncs: int = 0
    bytes_moved: int = 0
    triton_launches: int = 0
    ops: dict[str, int] = field(default_factory=dict)


def _bytes(values) -> int:
    flat, _ = tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class DispatchCounter(TorchDispatchMode):
    """``with DispatchCounter() as counter: ...`` then ``counter.counts``."""

    def __init__(self, cpu_uploads: bool = True):
        """cpu_uploads: count ``kvcomm.core.device.upload`` calls as one operation each (on a
        CPU, where their copy dispatches nothing); leave it off where uploads are real copies."""
        super().__init__()
        self.cpu_uploads = cpu_uploads
        self.counts = Counts()
        self._reads = 0
        self._launch_patch = None

    def __enter__(self):
        self._reads, self._uploads = device.host_reads, device.uploads
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, *exc):
        self.counts.host_syncs += device.host_reads - self._reads
        if self.cpu_uploads:  # a host-to-"device" copy on a CPU dispatches nothing: count kvcomm's uploads
            self.counts.kernel_ops += device.uploads - self._uploads
        self._unpatch_triton()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if getattr(func, "is_view", False) or name in FREE:
            return out
        c = self.counts
        c.kernel_ops += 1
        c.ops[name] = c.ops.get(name, 0) + 1
        if name in SYNCS:
            c.host_syncs += 1
        op = name.rsplit(".", 1)[0].replace(".", "::", 1)
        if op in device.OP_BYTES:
            c.bytes_moved += device.OP_BYTES[op](*args, **kwargs)
        else:
            c.bytes_moved += _bytes((args, kwargs)) + _bytes(out)
        return out

    def _patch_triton(self) -> None:
        """Count every Triton launch (compiled, or in Triton's interpreter)."""
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        counts = self.counts
        self._launch_patch = []
        for cls in (JITFunction, InterpretedFunction):
            original = cls.run

            def run(fn, *args, _original=original, **kwargs):
                counts.triton_launches += 1
                return _original(fn, *args, **kwargs)

            cls.run = run
            self._launch_patch.append((cls, original))

    def _unpatch_triton(self) -> None:
        for cls, original in self._launch_patch or ():
            cls.run = original
        self._launch_patch = None
