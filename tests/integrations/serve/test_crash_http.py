"""`kvcomm serve --state-dir` killed with SIGKILL (the whole process tree: API server, engine
core, worker) while requests are in flight, three times, then restarted: every save on disk
loads, every tenant is restored at each start, and what is lost is at most what came after the
last interval save (files are written atomically; the manifest is the commit point)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvcomm.services.persist import MANIFEST
from kvcomm.services.tenants import tenant_label
from .test_http import executor  # noqa: F401 (fixture)
from .test_persistence_http import run_row

pytestmark = pytest.mark.slow

KEYS = ("crash-key-1",)
TENANTS = ("crash-a", "crash-b")


def _kill_tree(server) -> None:
    import psutil

    root = psutil.Process(server.process.pid)
    for process in [*root.children(recursive=True), root]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    server.process.wait()


def _load(server, executor, row: int, tenant: str) -> None:  # noqa: F811
    """Requests in flight when the server is killed: their connections break, as expected."""
    try:
        run_row(server, executor, row, tenant, KEYS[0])
    except (OSError, AssertionError):
        pass


def _anchors(state, tenant: str) -> int | None:
    path = state / tenant_label(tenant) / MANIFEST
    return sum(len(p["anchors"]) for p in json.loads(path.read_text())["pools"]) if path.is_file() else None


def test_kill_9_under_load_three_times_loses_at_most_one_interval(executor, tmp_path_factory, smol):  # noqa: F811
    from kvcomm.core.fingerprint import model_fingerprint
    from kvcomm.integrations.transformers.executor import TransformersExecutor
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.services.persist import load_engine
    from kvcomm.services.tenants import TenantRegistry
    from support.serve_client import start_server

    reference = TransformersExecutor(*smol)
    fingerprint = model_fingerprint(reference.model, reference.tokenizer, reference.rotary, kv_dtype=reference.model.dtype)
    state, logs = tmp_path_factory.mktemp("crash-state"), tmp_path_factory.mktemp("crash-logs")
    kills, loaded = 0, 0
    for round_ in range(4):
        server = start_server(logs / f"run{round_}.log", KEYS, "--state-dir", str(state), "--save-interval", "1",
                              "--no-tenant-per-key")
        try:
            log = server.log.read_text()
            assert "starts cold" not in log and "refused" not in log, log[-2000:]
            if round_:  # what was saved before the kill came back: a restored tenant estimates at once
                for tenant in TENANTS:  # the row served (and saved at an interval) before the kill
                    calls = run_row(server, executor, round_ - 1, tenant, KEYS[0])
                    assert any(r["kv_transfer_params"]["kvcomm"]["estimated_tokens"] for _, r in calls), tenant
            if round_ == 3:
                break
            for tenant in TENANTS:
                run_row(server, executor, round_, tenant, KEYS[0])
            served = time.time()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                    (state / tenant_label(t) / MANIFEST).is_file() and (state / tenant_label(t) / MANIFEST).stat().st_mtime > served
                    for t in TENANTS):
                time.sleep(0.5)
            saved = {t: _anchors(state, t) for t in TENANTS}
            assert all(saved.values()), saved  # an interval save after the last request, with anchors
            load = [threading.Thread(target=_load, args=(server, executor, (round_ + 1) % 3, t), daemon=True)
                    for t in TENANTS]
            for thread in load:
                thread.start()
            time.sleep(1.5)  # requests in flight, saves in progress
        finally:
            if round_ < 3:
                _kill_tree(server)
                kills += 1
            else:
                server.stop()
        for tenant in TENANTS:  # every save on disk loads, into a fresh engine of the served model
            registry = TenantRegistry(reference.rotary, ReuseConfig())
            load_engine(state / tenant_label(tenant), registry.engine(tenant), fingerprint)
            assert _anchors(state, tenant) >= saved[tenant]  # nothing before the last interval save was lost
            loaded += 1
        assert not list(state.glob("*.refused-*"))
    # a save killed mid-write leaves temp files; the next save of that folder removes them
    assert not [p for p in state.rglob(".*") if p.is_file()], [str(p) for p in state.rglob(".*")]
    print(f"\nkill -9 under load: {kills} kills, {loaded} saves loaded after them, 0 unloadable, every tenant restored")
