"""Hand host memory kvcomm let go of back to the operating system (glibc's ``malloc_trim``).

kvcomm's reuse state on a CPU is thousands of tensors of a few MiB each (one segment's KV),
allocated and freed as pools learn and evict and captures come and go. glibc serves such
allocations from its heaps (its mmap threshold rises, up to 32 MiB, with the large blocks freed) and
keeps what is freed there for later allocations, so without a trim the worker's RSS grows past
the bytes kvcomm holds by a few hundred MiB under churn (docs/measurements/2026-12-07-soak-memory.md).
``Trimmer`` asks glibc to return whole free pages, from a daemon thread (``malloc_trim``
releases the GIL), at most once per ``interval_s`` and only after kvcomm released something.
Where the C library is not glibc (musl, macOS) it does nothing and says so in ``available``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 2.0
"""Seconds between two trims at least: a trim's cost is unmapping the pages it returns (its
own thread, docs/measurements/2026-12-07-soak-memory.md), so trimming often keeps each short."""


def _malloc_trim():
    """glibc's ``malloc_trim(size_t pad)``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


class Trimmer:
    """``released()`` after kvcomm let go of host memory; a daemon thread trims within
    ``interval_s`` of the first such call since the last trim. ``trims`` counts the trims made;
    ``stop()`` ends the thread (a trim in progress completes)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self.available = self._trim is not None
        self.trims = 0
        self._pending = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if self.available:
            self._thread = threading.Thread(target=self._run, name="kvcomm-trim", daemon=True)
            self._thread.start()

    def released(self) -> None:
        self._pending.set()

    def stop(self) -> None:
        self._stopped.set()
        self._pending.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            if self._stopped.is_set():
                return
            self._pending.clear()
            try:
                self._trim(0)
            except Exception:  # never take the worker down for a trim
                log.exception("kvcomm: malloc_trim failed; host memory is no longer trimmed")
                return
            self.trims += 1
            if self._stopped.wait(self.interval_s):
                return
