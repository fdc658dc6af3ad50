"""Reuse state of `kvcomm serve` kept across restarts (``--state-dir DIR``), so a restarted
server does not start cold.

Layout: ``DIR/<tenant label>/`` holds one tenant's save (``kvcomm.services.persist``: anchor pools,
shared-content bases and fixed-segment bases as safetensors plus a JSON manifest carrying
the model fingerprint; every file written atomically) and ``tenant.json`` its tenant key (an
API key's tenant is already a digest of the key, never the key). Exact-prefix stores and the
automatic-detection index are not saved: they refill from traffic.

At start every tenant found is restored; a save for another model, over this engine's limits,
or a corrupt one, is refused by ``kvcomm.services.persist`` with a clear error and that tenant
starts cold (the server still starts). A refused save is never overwritten: its folder is
moved aside, untouched, to ``DIR/<label>.refused-<UTC time>`` (logged with the reason), and
the tenant's new state is saved in a fresh ``DIR/<label>/``; if it cannot be moved, that tenant
is not saved at all while this process runs. While serving, a background thread saves the
tenants every ``interval_s`` seconds (a positive, finite number) when requests have finished
since the last save, and once more at exit. Folders this creates are private (mode 0700,
whatever the umask).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import multiprocessing.util
import os
import threading
import time
from pathlib import Path

from kvcomm.core.fingerprint import ModelFingerprint
from kvcomm.services.persist import PersistError, save_engine, write_text_atomically
from kvcomm.services.tenants import tenant_label
from kvcomm.integrations.vllm.request_plans import ServerPlanner

log = logging.getLogger(__name__)
TENANT_FILE = "tenant.json"


class PlannerState:
    """Restores and saves the tenants of ``planner`` under ``directory`` for the model ``fingerprint``."""

    def __init__(self, planner: ServerPlanner, directory: str | os.PathLike, fingerprint: ModelFingerprint,
                 interval_s: float = 60.0):
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"the save interval must be a positive, finite number of seconds (got {interval_s!r})")
        self.planner = planner
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        self.saves = 0
        self._saved_at_requests = planner.totals["requests"]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one save at a time (kvcomm.services.persist: one writer per directory)
        self.unsaved: set[str] = set()
        """Labels of tenants whose refused save could not be moved aside: never saved by this process."""

    def restore(self) -> dict[str, str]:
        """Load every saved tenant; returns tenant label -> what happened ("restored ..." or the error)."""
        outcome = {}
        if not self.directory.exists():
            self.directory.mkdir(mode=0o700, parents=True)
            os.chmod(self.directory, 0o700)  # whatever the umask
        for folder in sorted(p for p in self.directory.glob("*") if (p / TENANT_FILE).is_file() and ".refused-" not in p.name):
            try:
                tenant = json.loads((folder / TENANT_FILE).read_text(encoding="utf-8"))["tenant"]
                if not isinstance(tenant, str) or tenant_label(tenant) != folder.name:
                    raise PersistError(f"{folder / TENANT_FILE} names a tenant that does not belong in {folder.name}")
                self.planner.registry.load(tenant, folder, self.fingerprint)
                pools = {slot: len(pool) for slot, pool in self.planner.engine(tenant).pools.items()}
                outcome[folder.name] = f"restored anchors per slot {pools}"
                log.info("kvcomm: tenant %s restored from %s: anchors per slot %s", folder.name, folder, pools)
            except (PersistError, OSError, ValueError, KeyError) as error:
                outcome[folder.name] = f"not restored: {error}"
                log.error("kvcomm: tenant %s starts cold: %s; %s", folder.name, error, self._set_aside(folder))
        self._saved_at_requests = self.planner.totals["requests"]
        return outcome

    def _set_aside(self, folder: Path) -> str:
        """Move a refused save out of the way (never overwritten, never deleted); says where."""
        aside = folder.with_name(f"{folder.name}.refused-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        try:
            for n in range(1, 1000):
                if not aside.exists():
                    break
                aside = aside.with_name(f"{aside.name.split('~')[0]}~{n}")
            folder.rename(aside)
            return f"its save is kept, untouched, in {aside}; the new state is saved in {folder}"
        except OSError as error:
            self.unsaved.add(folder.name)
            return (f"its save could not be moved aside ({error}), so this tenant is not saved until restart "
                    f"(move or delete {folder} to save it again)")

    def save(self) -> int:
        """Save every tenant now; returns how many were saved."""
        with self._lock:
            requests = self.planner.totals["requests"]
            saved = 0
            for tenant in self.planner.registry.tenants:
                if tenant_label(tenant) in self.unsaved:
                    continue
                folder = self.directory / tenant_label(tenant)
                save_engine(self.planner.engine(tenant), folder, self.fingerprint)
                write_text_atomically(folder / TENANT_FILE, json.dumps({"tenant": tenant}))
                saved += 1
            self._saved_at_requests = requests
            self.saves += 1
            return saved

    def save_if_changed(self) -> bool:
        if self.planner.totals["requests"] == self._saved_at_requests:
            return False
        self.save()
        return True

    def start(self) -> None:
        """Save every ``interval_s`` seconds (when something changed) and at exit.

        "At exit" covers the processes the planner runs in: a main process, or vLLM's worker
        process (the engine-core process when the worker runs there), started by "spawn"
        (``atexit``), and one started by "fork", which
        leaves through ``os._exit``, skipping ``atexit`` but running multiprocessing's exit
        finalizers. ``stop`` is idempotent, so where both fire the second finds nothing to
        save. The process must be allowed to exit: `kvcomm serve` gives vLLM a shutdown
        timeout for that (``serve.command.STATE_SHUTDOWN_TIMEOUT_S``)."""
        self._thread = threading.Thread(target=self._run, name="kvcomm-state", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        multiprocessing.util.Finalize(None, self.stop, exitpriority=10)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s)
        try:
            self._guarded_save()
        except BaseException as cut:  # SIGTERM (SystemExit) mid-save: every file is atomic, the previous save stands
            log.error("kvcomm: the save at exit to %s was cut short (%s); the previous save is kept. Give the "
                      "engine more time to stop (vLLM's --shutdown-timeout and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)",
                      self.directory, type(cut).__name__)
            raise

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._guarded_save()

    def _guarded_save(self) -> None:
        try:
            self.save_if_changed()
        except Exception:  # a failed save must not take the server down; the previous save stays intact
            log.exception("kvcomm: saving the reuse state to %s failed", self.directory)
