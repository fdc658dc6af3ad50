"""A counter of device cost at the torch level: kernels, host synchronizations, bytes moved.

``DispatchCounter`` is a ``TorchDispatchMode`` and a ``TorchFunctionMode`` at once, so it sees
every call the code makes, kvcomm's own or not. Device operations: every aten or ``kvcomm::``
operator dispatched inside it, except views and allocations (no kernel runs), plus every
host<->device copy. Bytes moved: for an aten operator, the bytes of its tensor arguments and
results (a view counts the elements it addresses); for a ``kvcomm::`` operator, the distinct
bytes its kernel touches as ``kvcomm.core.device.OP_BYTES`` computes them from its arguments
(its pointer tables address tensors a dispatch-level view cannot see; what the kernels really
load and store is measured under Triton's interpreter: ``bytes_loaded``, ``bytes_stored``, every
access of every program, and ``distinct_bytes``, each address once; ``table_bytes_loaded`` is
the part of ``bytes_loaded`` read from integer tables, the addressing). Triton launches are counted too
(``triton_launches``): every launch on the reuse path must be a ``kvcomm::`` operator.

**Host syncs, by CUDA's rules.** Every tensor is in device memory or in host memory. Host
memory: tensors made from host data (``torch.from_numpy``, ``torch.tensor``/``as_tensor``
without a device), made by a factory without a device, computed from host tensors only,
copied to the host, or named ``host=`` when the counter starts (e.g. the scheduler's step
tensors, which come from another process); every other tensor is device memory (the KV, the
model, what the engine stored). A device argument spelled as the string ``"cpu"`` means the
host; a ``torch.device`` (on this CPU, the KV's ``cpu`` device) means the device. One host
sync is counted for each of:

- an upload (``.to(device)``, ``.cuda()``, ``copy_`` into device memory, ``torch.tensor(...,
  device=...)``) from pageable memory, ``non_blocking`` or not; an upload from pinned memory
  with ``non_blocking=True`` is not a sync (``kvcomm.core.device.pinned_where_cuda``: pinned,
  or a host tensor the code pins wherever the device is CUDA; no memory can be pinned on a
  machine without CUDA);
- a download: ``.cpu()``, ``.to("cpu")``, ``.numpy()``, ``.tolist()``, ``.item()``, ``bool``,
  ``int``, ``float`` of a device tensor, ``copy_`` into host memory;
- an operator whose result's size the host waits for (``nonzero``, ``masked_select``,
  ``unique``, ``equal``, ...) on device memory, and any ``_local_scalar_dense`` that escaped
  the calls above.

On a CPU the reuse path runs the same operators (with ``TRITON_INTERPRET=1`` its Triton
kernels run in Triton's interpreter), so the counts are those of a CUDA run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
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
"""Operators whose result the host waits for (when their input is in device memory)."""

DOWNLOADS = {"cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"}
"""Tensor methods that bring a device tensor's values to the host."""

WAITS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "repeat_interleave"}
"""Functions whose result's size (or value) the host waits for."""

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn", "randint", "eye", "empty_strided",
             "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}


@dataclass
class Counts:
    kernel_ops: int = 0
    host_syncs: int = 0
    bytes_moved: int = 0
    triton_launches: int = 0
    uploads: int = 0
    downloads: int = 0
    bytes_loaded: int | None = None
    """Bytes the Triton kernels loaded, every access counted (None: not run in the interpreter)."""
    bytes_stored: int | None = None
    table_bytes_loaded: int | None = None
    distinct_bytes: int | None = None
    """Bytes at distinct addresses the kernels loaded or stored."""
    ops: dict[str, int] = field(default_factory=dict)
    syncs: dict[str, int] = field(default_factory=dict)
    """Why each host sync was counted: ``"upload (pageable)"``, ``"download: tolist"``, ..."""


def _bytes(values) -> int:
    flat, _ = tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _tensors(values) -> list[torch.Tensor]:
    flat, _ = tree_flatten(values)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _pinned(t: torch.Tensor) -> bool:
    """Pinned, or pinned wherever the device is CUDA (``kvcomm.core.device.pinned_where_cuda``)."""
    where_cuda = getattr(device, "pinned_where_cuda", None)  # absent from code before 2026-12-07: pinned only
    return where_cuda(t) if where_cuda is not None else t.is_pinned()


def _means_host(where) -> bool | None:
    """None: no device named; True: the host (the string "cpu"); False: the device."""
    if where is None:
        return None
    if isinstance(where, str):
        return where.split(":")[0] == "cpu"
    return False


class _Functions(TorchFunctionMode):
    """The torch-level half of ``DispatchCounter``: host syncs and copies by CUDA's rules."""

    def __init__(self, owner: "DispatchCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if owner.inside:  # a call made by a call already classified
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = _tensors((args, kwargs))
        host = None  # the result's memory: True host, False device, None: as its inputs
        charged = owner.counts.uploads + owner.counts.downloads + owner.counts.host_syncs
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            host = owner.copy_to(args[0], *_to_target(owner, args[1:], kwargs), name)
        elif name == "cuda" and args:
            host = owner.copy_to(args[0], False, bool(kwargs.get("non_blocking", False)), name)
        elif name in DOWNLOADS and args and isinstance(args[0], torch.Tensor):
            if not owner.is_host(args[0]):
                owner.download(name)
            host = True
        elif name == "copy_" and len(args) >= 2:
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            host = owner.is_host(args[0])
            owner.copy_to(args[1], host, non_blocking, name)
        elif name in ("tensor", "as_tensor", "asarray") and not (args and isinstance(args[0], torch.Tensor)):
            host = _means_host(kwargs.get("device")) is not False
            if not host:  # host data copied to the device from pageable memory
                owner.upload(pinned=False, non_blocking=False, why=name)
        elif name in ("as_tensor", "asarray"):
            host = owner.copy_to(args[0], _means_host(kwargs.get("device")), False, name)
        elif name == "pin_memory":
            host = True
        elif name in WAITS and any(not owner.is_host(t) for t in tensors):
            owner.sync(f"waits for {name}")
        elif name in FACTORIES and not (name.endswith("_like") and tensors):
            host = _means_host(kwargs.get("device")) is not False
        before = owner.call
        owner.call = ("charged" if owner.counts.uploads + owner.counts.downloads + owner.counts.host_syncs > charged
                      else "host" if host or (host is None and tensors and all(owner.is_host(t) for t in tensors)) else None)
        owner.inside += 1
        try:
            out = func(*args, **kwargs)
        finally:
            owner.inside -= 1
            call, owner.call = owner.call, before
        if host is None:
            host = call == "host"
        if (call == "charged" and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)
                and out.numel() and _storage(out) == _storage(args[0]) and name != "copy_"):
            # a copy between host and device that this CPU made in place (same memory): give it
            # memory of its own, as CUDA would, so that host and device memory stay apart
            owner.silent += 1
            try:
                out = out.clone()
            finally:
                owner.silent -= 1
        owner.mark(out, host)
        return out


def _to_target(owner: "DispatchCounter", rest: tuple, kwargs: dict) -> tuple[bool | None, bool]:
    """``Tensor.to``'s destination (see ``_means_host``; a tensor argument: its memory) and ``non_blocking``."""
    where, non_blocking = _means_host(kwargs.get("device")), kwargs.get("non_blocking", False)
    for i, a in enumerate(rest):
        if isinstance(a, (str, torch.device)):
            where = _means_host(a)
        elif isinstance(a, torch.Tensor):
            where = owner.is_host(a)
        elif isinstance(a, bool) and i > 0:
            non_blocking = a
    return where, bool(non_blocking)


class DispatchCounter(TorchDispatchMode):
    """``with DispatchCounter() as counter: ...`` then ``counter.counts`` (see the module docstring).

    host: tensors made before the counter started that live in host memory."""

    def __init__(self, host: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.counts = Counts()
        self.inside = 0
        self.silent = 0
        self.call: str | None = None
        """The torch-level call running: "charged" (its copy or sync counted), "host" (on host memory), None."""
        self._memory: dict[int, bool] = {}  # storage address -> in host memory
        for t in host:
            self._memory[_storage(t)] = True
        self._functions = _Functions(self)
        self._launch_patch = None
        self._from_numpy = None

    def __enter__(self):
        self._patch_triton()
        self._pinned_before = getattr(device, "PINNED_WHERE_CUDA", None)
        if hasattr(device, "PINNED_WHERE_CUDA"):
            device.PINNED_WHERE_CUDA = {}  # staged's stand-ins for pinned memory, recorded while counting
        self._from_numpy = torch.from_numpy
        counter = self

        def from_numpy(array):
            out = counter._from_numpy(array)
            counter.mark(out, True)
            return out

        torch.from_numpy = from_numpy
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)
            torch.from_numpy = self._from_numpy
            self._unpatch_triton()
            if hasattr(device, "PINNED_WHERE_CUDA"):
                device.PINNED_WHERE_CUDA = self._pinned_before

    # -- memory and copies --------------------------------------------------------------------

    def is_host(self, t: torch.Tensor) -> bool:
        return self._memory.get(_storage(t), False)

    def mark(self, values, host: bool) -> None:
        for t in _tensors(values):
            self._memory[_storage(t)] = host

    def sync(self, why: str) -> None:
        c = self.counts
        c.host_syncs += 1
        c.syncs[why] = c.syncs.get(why, 0) + 1

    def upload(self, pinned: bool, non_blocking: bool, why: str) -> None:
        c = self.counts
        c.uploads += 1
        c.kernel_ops += 1
        c.ops["upload"] = c.ops.get("upload", 0) + 1
        if not (pinned and non_blocking):
            self.sync(f"upload ({'pageable' if not pinned else 'blocking'}): {why}")

    def download(self, why: str) -> None:
        c = self.counts
        c.downloads += 1
        c.kernel_ops += 1
        c.ops["download"] = c.ops.get("download", 0) + 1
        self.sync(f"download: {why}")

    def copy_to(self, source: torch.Tensor, to_host: bool | None, non_blocking: bool, why: str) -> bool:
        """Charge a copy of ``source`` to the host (``to_host``), to the device, or nowhere (None:
        a dtype change where it is); returns where the result lives."""
        from_host = self.is_host(source)
        if to_host is None or to_host == from_host:
            return from_host
        if to_host:
            self.download(why)
        else:
            self.upload(_pinned(source), non_blocking, why)
        return to_host

    # -- dispatch -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if self.silent or getattr(func, "is_view", False) or name in FREE:
            return out
        inputs = _tensors((args, kwargs))
        if self.call == "charged" and (name in SYNCS or name in ("aten._to_copy.default", "aten.copy_.default")):
            return out  # the copy or wait the torch-level call was charged
        if (inputs and all(self.is_host(t) for t in inputs)) or (not inputs and self.call == "host"):
            self.mark(out, True)
            return out  # host work: no device operation
        c = self.counts
        c.kernel_ops += 1
        c.ops[name] = c.ops.get(name, 0) + 1
        if name in SYNCS:
            self.sync(f"{name} (escaped the torch-level calls)")
        op = name.rsplit(".", 1)[0].replace(".", "::", 1)
        if op in device.OP_BYTES:
            c.bytes_moved += device.OP_BYTES[op](*args, **kwargs)
        else:
            c.bytes_moved += _bytes((args, kwargs)) + _bytes(out)
        return out

    def _patch_triton(self) -> None:
        """Count every Triton launch (compiled, or in Triton's interpreter) and, in the
        interpreter, every load and store."""
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

            self._launch_patch.append((cls, "run", original))
            cls.run = run
        import os

        if os.environ.get("TRITON_INTERPRET") == "1":
            self._patch_memory()

    def _patch_memory(self) -> None:
        """Wrap the interpreter's masked load and store: bytes per access, addresses kept for
        ``distinct_bytes`` (the unmasked ones)."""
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder

        counts = self.counts
        counts.bytes_loaded = counts.bytes_stored = counts.table_bytes_loaded = 0
        addresses: list = []
        self._addresses = addresses
        load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

        def touched(ptrs, mask) -> tuple[int, int]:
            item = ptrs.get_element_ty().primitive_bitwidth // 8
            at = np.asarray(ptrs.data).reshape(-1)
            on = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1)
            chosen = at[on]
            addresses.append((chosen, item))
            return int(chosen.size) * item, item

        def masked_load(builder, ptrs, mask, other, *args):
            n, _ = touched(ptrs, mask)
            counts.bytes_loaded += n
            if ptrs.get_element_ty().is_int():
                counts.table_bytes_loaded += n
            return load(builder, ptrs, mask, other, *args)

        def masked_store(builder, ptrs, value, mask, *args):
            counts.bytes_stored += touched(ptrs, mask)[0]
            return store(builder, ptrs, value, mask, *args)

        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store
        self._launch_patch.append((InterpreterBuilder, "create_masked_load", load))
        self._launch_patch.append((InterpreterBuilder, "create_masked_store", store))

    def _unpatch_triton(self) -> None:
        for cls, name, original in reversed(self._launch_patch or ()):
            setattr(cls, name, original)
        self._launch_patch = None
        addresses = getattr(self, "_addresses", None)
        if addresses is not None:
            import numpy as np

            distinct = 0
            for item in {i for _, i in addresses}:
                at = [a for a, i in addresses if i == item]
                distinct += int(np.unique(np.concatenate(at)).size) * item if at else 0
            self.counts.distinct_bytes = distinct
            self._addresses = None
