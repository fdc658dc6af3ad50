"""`kvcomm serve --state-dir`: the planner's tenants are saved and restored, so a restarted
server does not start cold; a save for another model is refused and that tenant starts cold.
Driven like the connector drives the planner (tiny random Llama, real forwards)."""

from __future__ import annotations

import dataclasses
import json
import logging

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.core.fingerprint import model_fingerprint
from kvcomm.integrations.vllm.planning.planner_state import TENANT_FILE, PlannerState
from kvcomm.integrations.vllm.planning.server_planner import ServerPlanner
from kvcomm.services.tenants import adapter_key, tenant_label
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from ..vllm.test_server_planner import request, serve


def _planner(executor) -> ServerPlanner:
    return ServerPlanner(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))


def test_a_restarted_planner_restores_every_tenant_and_plans_the_same(tiny_executor, tmp_path, caplog):
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    first = _planner(tiny_executor)
    state = PlannerState(first, tmp_path, fingerprint, interval_s=3600)
    assert state.save_if_changed() is False  # nothing served yet
    for seed in range(3):  # each content twice, at two offsets: the second sighting makes anchors
        serve(first, tiny_executor, *request(seed), "team-a")
        serve(first, tiny_executor, *request(seed, lead=9), "team-a")
    serve(first, tiny_executor, *request(5), "team-a")
    serve(first, tiny_executor, *request(9), "team-b")
    assert state.save_if_changed() is True and state.save_if_changed() is False
    probe = request(5, lead=9)  # content seen before (its base is known), at another offset
    warm = serve(first, tiny_executor, *probe, "team-a")
    assert warm["estimated_tokens"] > 0  # team-a's anchors estimate it
    assert json.loads((tmp_path / tenant_label("team-a") / TENANT_FILE).read_text())["tenant"] == "team-a"

    restarted = _planner(tiny_executor)
    outcome = PlannerState(restarted, tmp_path, fingerprint).restore()
    assert set(outcome) == {tenant_label("team-a"), tenant_label("team-b")}
    assert all(text.startswith("restored") for text in outcome.values())
    # the same anchors as when saved (before the probe), so the probe is planned the same way
    again = serve(restarted, tiny_executor, *probe, "team-a")
    assert again == warm
    cold = serve(_planner(tiny_executor), tiny_executor, *probe, "team-a")
    assert cold["estimated_tokens"] == 0 < warm["estimated_tokens"]  # a restart without the state

    other_model = dataclasses.replace(fingerprint, checkpoint="another checkpoint")
    elsewhere = _planner(tiny_executor)
    with caplog.at_level(logging.ERROR, logger="kvcomm.integrations.vllm.planning.planner_state"):
        refused = PlannerState(elsewhere, tmp_path, other_model).restore()
    assert all(text.startswith("not restored") for text in refused.values()) and "starts cold" in caplog.text
    assert elsewhere.registry.tenants == () or all(not e.pools for e in elsewhere.engines.values())


def test_an_adapters_engine_is_saved_and_restored_under_its_own_key(tiny_executor, tmp_path):
    """A tenant's engine for a LoRA adapter is saved in a folder of its own (its key names the
    adapter's identity) and restored there: after a restart the adapter's requests plan as
    before and the tenant's base-model requests still get nothing of it."""
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    first = _planner(tiny_executor)
    for seed in range(3):  # as in the test above, under the adapter
        serve(first, tiny_executor, *request(seed), "team-a", adapter="critic-digest")
        serve(first, tiny_executor, *request(seed, lead=9), "team-a", adapter="critic-digest")
    serve(first, tiny_executor, *request(5), "team-a", adapter="critic-digest")
    PlannerState(first, tmp_path, fingerprint, interval_s=3600).save()
    key = adapter_key("team-a", "critic-digest")
    assert json.loads((tmp_path / tenant_label(key) / TENANT_FILE).read_text())["tenant"] == key
    probe = request(5, lead=9)
    restarted = _planner(tiny_executor)
    assert PlannerState(restarted, tmp_path, fingerprint).restore() == {tenant_label(key): "restored anchors per slot {'task': 1}"}
    warm = serve(restarted, tiny_executor, *probe, "team-a", adapter="critic-digest")
    assert warm["estimated_tokens"] > 0
    base = serve(restarted, tiny_executor, *probe, "team-a")
    assert base["estimated_tokens"] == base["exact_tokens"] == 0


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_refused_save_is_moved_aside_untouched_and_never_overwritten(tiny_executor, tmp_path, caplog):
    """A restart on another model, or with limits the save is over, refuses the save; the tenant
    starts cold, and its next save used to overwrite the refused one with an empty engine
    (measured: 2 anchors / 6 bases -> 0 / 0). Now the refused folder is moved aside, byte for
    byte, and the new state goes to a fresh folder."""
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    first = _planner(tiny_executor)
    for seed in range(3):  # calibration requests: each content an anchor (more than max_anchors 1 below)
        serve(first, tiny_executor, *request(seed), "team-a")
        serve(first, tiny_executor, *request(seed, lead=9), "team-a", calibrate=True)
    PlannerState(first, tmp_path, fingerprint).save()
    folder = tmp_path / tenant_label("team-a")
    saved = _files(folder)
    assert sum(len(p["anchors"]) for p in json.loads(saved["manifest.json"])["pools"]) >= 2

    for name, planner, where in (
        ("another model", _planner(tiny_executor), dataclasses.replace(fingerprint, checkpoint="another checkpoint")),
        ("over the limits", ServerPlanner(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=1))), fingerprint),
    ):
        state = PlannerState(planner, tmp_path, where, interval_s=3600)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvcomm.integrations.vllm.planning.planner_state"):
            outcome = state.restore()
        assert outcome[folder.name].startswith("not restored"), (name, outcome)
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{folder.name}.refused-")]
        assert len(aside) == 1 and _files(aside[0]) == saved, name
        assert f"its save is kept, untouched, in {aside[0]}" in caplog.text, name
        serve(planner, tiny_executor, *request(7), "team-a")  # the cold tenant learns something new
        assert state.save() == 1
        assert _files(aside[0]) == saved and folder.is_dir() and _files(folder) != saved, name
        aside[0].rename(folder.with_name("kept-" + name.replace(" ", "-")))  # the operator takes it; next case
        folder.rename(folder.with_name("fresh-" + name.replace(" ", "-")))
        (tmp_path / ("kept-" + name.replace(" ", "-"))).rename(folder)
    assert PlannerState(_planner(tiny_executor), tmp_path, fingerprint).restore()[folder.name].startswith("restored")


def test_state_folders_are_private_whatever_the_umask(tiny_executor, tmp_path):
    import os
    import stat

    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    planner = _planner(tiny_executor)
    serve(planner, tiny_executor, *request(1), "team-a")
    old = os.umask(0o022)
    try:
        state = PlannerState(planner, tmp_path / "state" / "deeper", fingerprint)
        state.restore()
        state.save()
    finally:
        os.umask(old)
    for folder in (tmp_path / "state" / "deeper", tmp_path / "state" / "deeper" / tenant_label("team-a")):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_save_interval_that_never_comes_is_refused(tiny_executor, tmp_path):
    import pytest

    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    for interval in (float("inf"), float("nan"), 0, -1.0):
        with pytest.raises(ValueError, match="positive, finite number of seconds"):
            PlannerState(_planner(tiny_executor), tmp_path, fingerprint, interval_s=interval)


def test_a_save_that_runs_out_of_space_keeps_the_previous_one_and_a_later_save_succeeds(tiny_executor, tmp_path, caplog):
    """Disk full while saving, made real with the file-size limit (writes past it fail with
    EFBIG, as they fail with ENOSPC on a full disk): the save fails and is logged, the previous
    save still loads, nothing half-written is left, and the next save once space is back works."""
    import resource
    import signal

    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    planner = _planner(tiny_executor)
    for seed in range(2):
        serve(planner, tiny_executor, *request(seed), "team-a")
        serve(planner, tiny_executor, *request(seed, lead=9), "team-a")
    state = PlannerState(planner, tmp_path, fingerprint, interval_s=3600)
    assert state.save() == 1
    folder = tmp_path / tenant_label("team-a")
    before = _files(folder)
    serve(planner, tiny_executor, *request(4), "team-a")  # something new to save
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with caplog.at_level(logging.ERROR, logger="kvcomm.integrations.vllm.planning.planner_state"):
            state._guarded_save()  # what the saver thread and the save at exit call
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert "saving the reuse state" in caplog.text and "File too large" in caplog.text
    assert _files(folder) == before  # the previous save, untouched, and no temp file left
    assert PlannerState(_planner(tiny_executor), tmp_path, fingerprint).restore()[folder.name].startswith("restored")
    assert state.save_if_changed()  # space is back: the pending change is saved
    assert _files(folder) != before
    assert PlannerState(_planner(tiny_executor), tmp_path, fingerprint).restore()[folder.name].startswith("restored")


def test_a_restart_removes_what_killed_saves_left_and_moves_an_unreadable_tenant_file_aside(tiny_executor, tmp_path, caplog):
    """A save killed mid-way leaves temp files (5.5 GB of them in one run) that used to stay
    until that tenant's next save, which might never come. A restart removes them from the
    state folder and every tenant folder, and the object files a killed save renamed into place
    but never committed; refused saves and other writers' folders are left as they are. A
    ``tenant.json`` that cannot be read is named in the log and its folder moved aside."""
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    first = _planner(tiny_executor)
    serve(first, tiny_executor, *request(1), "team-a")
    serve(first, tiny_executor, *request(2), "team-b")
    PlannerState(first, tmp_path, fingerprint, interval_s=3600).save()
    a, b = tmp_path / tenant_label("team-a"), tmp_path / tenant_label("team-b")
    saved = _files(a)
    orphan = "obj-" + "0" * 64 + ".safetensors"
    stale = [a / ".kvcomm-k1.safetensors", a / ".tmpXyZ", a / orphan, tmp_path / ".kvcomm-root.json"]
    kept = [tmp_path / "contexts" / ".kvcomm-ctx.json", tmp_path / "tp2-rank0" / ".kvcomm-r.safetensors",
            tmp_path / f"{a.name}.refused-20260101T000000Z" / ".kvcomm-old.safetensors"]
    for path in stale + kept:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"\0" * 4096)
    (b / TENANT_FILE).write_text('{"tenant": "tea')  # torn
    with caplog.at_level(logging.INFO, logger="kvcomm.integrations.vllm.planning.planner_state"):
        outcome = PlannerState(_planner(tiny_executor), tmp_path, fingerprint).restore()
    assert outcome[a.name].startswith("restored") and outcome[b.name].startswith("not restored")
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert _files(a) == saved
    assert "removed 3 temp files of killed saves (12288 bytes)" in caplog.text
    assert f"{b / TENANT_FILE}: unreadable (JSONDecodeError" in caplog.text
    assert [p.name.split(".refused-")[0] for p in tmp_path.iterdir() if ".refused-" in p.name and p.name.startswith(b.name)] == [b.name]
