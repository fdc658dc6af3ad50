"""Reuse state of `kvcomm serve` kept across restarts (``--state-dir DIR``), so a restarted
server does not start cold.

Layout: ``DIR/<tenant label>/`` holds one tenant's save (``kvcomm.services.persist``: anchor pools,
shared-content bases and fixed-segment bases as safetensors plus a JSON manifest carrying
the model fingerprint; every file written atomically) and ``tenant.json`` its tenant key (an
API key's tenant is already a digest of the key, never the key). Exact-prefix stores and the
automatic-detection index are not saved: they refill from traffic.

At start, before anything is restored, the temp files of a save that was killed (SIGKILL,
power loss) are removed from ``DIR`` and from every tenant folder (``.refused-`` folders are
left untouched), and after a tenant is restored its folder keeps only the files its manifest
names (``kvcomm.services.persist.tidy``). Every tenant found is restored; a save for another
model, over this engine's limits, or a corrupt one (manifest, ``tenant.json`` or an object
file: the log line names the file) is refused by ``kvcomm.services.persist`` with a clear
error and that tenant starts cold (the server still starts). A refused save is never overwritten: its folder is
moved aside, untouched, to ``DIR/<label>.refused-<UTC time>`` (logged with the reason), and
the tenant's new state is saved in a fresh ``DIR/<label>/``; if it cannot be moved, that tenant
is not saved at all while this process runs. While serving, a background thread saves the
tenants every ``interval_s`` seconds (a positive, finite number) when requests have finished
since the last save, and once more at exit; a save writes only what the tenant learned since
its last save (``kvcomm.services.persist``). Folders this creates are private (mode 0700,
whatever the umask).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import multiprocessing.util
import os
import re
import threading
import time
from pathlib import Path

from kvcomm.core.fingerprint import ModelFingerprint
from kvcomm.services.persist import PersistError, save_engine, tidy, write_text_atomically
from kvcomm.services.state_files import remove_temp_files
from kvcomm.services.tenants import tenant_label
from kvcomm.integrations.vllm.planning.server_planner import ServerPlanner

log = logging.getLogger(__name__)
TENANT_FILE = "tenant.json"
LABEL = re.compile(r"[0-9a-f]{12}")
"""A tenant folder's name (``tenant_label``)."""


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
        self._remove_temp_files()
        for folder in sorted(p for p in self.directory.glob("*") if (p / TENANT_FILE).is_file() and ".refused-" not in p.name):
            try:
                tenant = _read_tenant(folder)
                self.planner.registry.load(tenant, folder, self.fingerprint)
                pools = {slot: len(pool) for slot, pool in self.planner.engine(tenant).pools.items()}
                outcome[folder.name] = f"restored anchors per slot {pools}"
                log.info("kvcomm: tenant %s restored from %s: anchors per slot %s", folder.name, folder, pools)
                left = tidy(folder)
                if left:
                    log.info("kvcomm: removed %d files a killed save left in %s", len(left), folder)
            except (PersistError, OSError, ValueError, KeyError) as error:
                outcome[folder.name] = f"not restored: {error}"
                log.error("kvcomm: tenant %s starts cold: %s; %s", folder.name, error, self._set_aside(folder))
        self._saved_at_requests = self.planner.totals["requests"]
        return outcome

    def _remove_temp_files(self) -> None:
        """Temp files of killed saves, in the state folder and every tenant folder (named by a
        tenant label; not the refused saves kept aside, which stay untouched, nor other writers'
        folders: the retained contexts', another tensor-parallel rank's)."""
        removed: list[tuple[Path, int]] = []
        tenants = sorted(p for p in self.directory.iterdir() if p.is_dir() and LABEL.fullmatch(p.name))
        for folder in [self.directory, *tenants]:
            try:
                removed += remove_temp_files(folder).items()
            except OSError as error:
                log.error("kvcomm: could not remove the temp files of killed saves in %s: %s", folder, error)
        if removed:
            log.info("kvcomm: removed %d temp files of killed saves (%d bytes) under %s: %s", len(removed),
                     sum(size for _, size in removed), self.directory, ", ".join(str(p) for p, _ in removed[:5]))

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
                record = json.dumps({"tenant": tenant})
                if not _holds(folder / TENANT_FILE, record):
                    write_text_atomically(folder / TENANT_FILE, record)
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


def _read_tenant(folder: Path) -> str:
    """The tenant key ``folder/tenant.json`` holds; PersistError naming the file if it cannot be
    read or names a tenant that does not belong in ``folder``."""
    path = folder / TENANT_FILE
    try:
        tenant = json.loads(path.read_text(encoding="utf-8"))["tenant"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise PersistError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
    if not isinstance(tenant, str) or tenant_label(tenant) != folder.name:
        raise PersistError(f"{path} names a tenant that does not belong in {folder.name}")
    return tenant


def _holds(path: Path, text: str) -> bool:
    """Whether ``path`` holds ``text`` already (so it need not be written again)."""
    try:
        return path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        return False
