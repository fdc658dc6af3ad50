"""The store of retained contexts (``kvcomm.services.contexts``): byte caps, TTL, tenants,
release bookkeeping and the records read back after a restart."""

from __future__ import annotations

import json
import logging

import pytest

from kvcomm.services.contexts import ContextStore, NotFound, OverCap


def _create(store, tenant="t", tokens=(1, 2, 3), nbytes=100, ttl_s=None):
    return store.create(tenant, tokens, "c" + "-".join(map(str, tokens)), model="m", fingerprint="f", adapter=None,
                        nbytes=nbytes, ttl_s=ttl_s)


def test_retains_over_the_tenant_or_total_cap_are_refused_and_change_nothing():
    store = ContextStore(max_tenant_bytes=250, max_total_bytes=400)
    first = _create(store, tokens=(1,), nbytes=200)
    with pytest.raises(OverCap, match="this tenant's retained contexts to 300 bytes, over the cap of 250"):
        _create(store, tokens=(2,), nbytes=100)
    assert [c.id for c in store.list("t")] == [first.id] and store.retained_bytes("t") == 200
    _create(store, tokens=(1,), nbytes=200)  # the same content again: no new bytes
    _create(store, "u", tokens=(3,), nbytes=200)
    with pytest.raises(OverCap, match="all tenants'"):
        _create(store, "v", tokens=(4,), nbytes=1)
    assert store.retained_bytes() == 400


def test_release_frees_the_bytes_and_drops_the_content_only_when_no_other_context_keeps_it():
    store = ContextStore(max_tenant_bytes=250)
    one, two = _create(store, nbytes=200), _create(store, nbytes=200)
    assert store.evict("t", one.id, "released")[1:] == (True, False)  # two still keeps the content
    assert store.evict("t", one.id, "released")[1:] == (False, False)  # already released
    assert store.evict("t", two.id, "released")[1:] == (True, True)
    assert store.retained_bytes("t") == 0 and store.get("t", two.id).reason == "released"
    context, was_evicted = store.retain("t", two.id)
    assert was_evicted and context.state == "retained" and store.retained_bytes("t") == 200


def test_contexts_are_per_tenant():
    store = ContextStore()
    mine = _create(store, "a")
    with pytest.raises(NotFound):
        store.get("b", mine.id)
    with pytest.raises(NotFound):
        store.evict("b", mine.id, "released")
    assert store.list("b") == [] and store.get("a", mine.id).state == "retained"


def test_ttl_expiry_evicts_and_frees():
    now = [1000.0]
    store = ContextStore(max_tenant_bytes=150, clock=lambda: now[0])
    short = _create(store, tokens=(1,), ttl_s=5)
    assert store.next_expiry() == 1005.0 and store.expire() == []
    now[0] = 1005.0
    assert [(c.id, dropped) for c, _, dropped in store.expire()] == [(short.id, True)]
    assert store.get("t", short.id).reason == "expired" and store.next_expiry() is None
    _create(store, tokens=(2,))  # the expired context's bytes are free again


def test_records_survive_a_restart_as_evicted(tmp_path):
    path = tmp_path / "contexts"
    store = ContextStore(path=path)
    kept = _create(store, tokens=(5, 6))
    released = _create(store, tokens=(7,))
    store.evict("t", released.id, "released")
    again = ContextStore(path=path)
    assert (again.get("t", kept.id).state, again.get("t", kept.id).reason) == ("evicted", "restart")
    assert again.get("t", kept.id).token_ids == (5, 6) and again.get("t", released.id).reason == "released"
    assert again.retained_bytes() == 0
    assert again.retain("t", kept.id)[1] is True


def _inodes(folder) -> dict[str, int]:
    """Record file -> inode: a file written again (renamed over) gets a new one."""
    return {p.name: p.stat().st_ino for p in folder.iterdir()}


def test_a_change_writes_only_that_contexts_file(tmp_path):
    """contexts.json was rewritten whole on every change (every record, every token id); now a
    change writes the changed context's file, and the use counts of those used since theirs."""
    store = ContextStore(path=tmp_path / "contexts")
    contexts = [_create(store, tokens=tuple(range(i, i + 500))) for i in range(40)]
    before = _inodes(tmp_path / "contexts")
    assert sorted(before) == sorted(f"{c.id}.json" for c in contexts)
    store.evict("t", contexts[7].id, "released")
    after = _inodes(tmp_path / "contexts")
    assert [n for n in after if after[n] != before[n]] == [f"{contexts[7].id}.json"]
    store.count(contexts[3], "hit")  # counted in memory; written with the next change
    store.retain("t", contexts[9].id, ttl_s=60)
    again = _inodes(tmp_path / "contexts")
    assert sorted(n for n in again if again[n] != after[n]) == sorted(f"{contexts[i].id}.json" for i in (3, 9))
    reread = ContextStore(path=tmp_path / "contexts")
    assert reread.get("t", contexts[3].id).uses["hit"] == 1 and reread.get("t", contexts[7].id).reason == "released"


def test_forgotten_records_lose_their_files(tmp_path):
    store = ContextStore(path=tmp_path / "contexts", max_contexts=3)
    first = [_create(store, tokens=(i,)) for i in range(3)]
    store.evict("t", first[0].id, "released")
    _create(store, tokens=(9,))  # the fourth record: the oldest evicted one is forgotten
    assert f"{first[0].id}.json" not in _inodes(tmp_path / "contexts") and len(_inodes(tmp_path / "contexts")) == 3
    with pytest.raises(NotFound):
        ContextStore(path=tmp_path / "contexts").get("t", first[0].id)


BROKEN = {
    "torn": lambda text: text[: len(text) // 2],
    "not json": lambda text: "\0\0\0",
    "wrong type": lambda text: text.replace('"bytes": 100', '"bytes": "many"'),
    "huge token id": lambda text: text.replace("[1, 2, 3]", "[1180591620717411303424]"),
    "another id": lambda text: text.replace('"id": "ctx-', '"id": "ctx-0'),
}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_an_unreadable_record_is_moved_aside_with_a_log_line_and_the_rest_load(tmp_path, caplog, damage):
    folder = tmp_path / "contexts"
    store = ContextStore(path=folder)
    broken, kept = _create(store), _create(store, tokens=(4, 5))
    path = folder / f"{broken.id}.json"
    path.write_text(BROKEN[damage](path.read_text()))
    torn = path.read_bytes()
    (folder / ".kvcomm-abc.json").write_text("{")  # a write that was killed
    with caplog.at_level(logging.ERROR, logger="kvcomm.services.contexts"):
        again = ContextStore(path=folder)
    assert again.get("t", kept.id).token_ids == (4, 5)
    with pytest.raises(NotFound):
        again.get("t", broken.id)
    (aside,) = folder.glob(f"{broken.id}.json.unreadable-*")
    assert aside.read_bytes() == torn and not path.exists() and not (folder / ".kvcomm-abc.json").exists()
    assert f"{path} cannot be read" in caplog.text and f"moved aside to {aside}" in caplog.text


def test_the_single_file_of_earlier_versions_is_moved_into_the_folder(tmp_path, caplog):
    """Records of ``contexts.json`` (format 1, written whole) come back and get one file each;
    the old file goes once they are written. A truncated one (it stopped start-up with
    ``Expecting value: line 1 column 403307`` naming no file) is moved aside, named in the log."""
    old = ContextStore(path=tmp_path / "mem")
    records = [_create(old, tokens=(i, i + 1)) for i in range(3)]
    rows = [{**c.__dict__, "token_ids": list(c.token_ids)} for c in records]
    legacy = tmp_path / "contexts.json"
    legacy.write_text(json.dumps({"format": 1, "contexts": rows}))
    store = ContextStore(path=tmp_path / "contexts", legacy=legacy)
    assert [store.get("t", c.id).reason for c in records] == ["restart"] * 3 and not legacy.exists()
    assert sorted(_inodes(tmp_path / "contexts")) == sorted(f"{c.id}.json" for c in records)
    assert ContextStore(path=tmp_path / "contexts", legacy=legacy).get("t", records[1].id).token_ids == (1, 2)

    legacy.write_text(json.dumps({"format": 1, "contexts": rows})[:-30])
    with caplog.at_level(logging.ERROR, logger="kvcomm.services.contexts"):
        fresh = ContextStore(path=tmp_path / "other", legacy=legacy)
    (aside,) = tmp_path.glob("contexts.json.unreadable-*")
    assert fresh.list("t") == [] and f"{legacy} cannot be read (JSONDecodeError" in caplog.text and str(aside) in caplog.text


def test_a_pinned_base_survives_every_shrink_and_unpinning_drops_it(tiny_executor):
    """The engine side of a retained context (``TenantEngine.pin``/``unpin``)."""
    from kvcomm.core.segments import Segment
    from kvcomm.services.tenants import TenantRegistry

    engine = TenantRegistry(tiny_executor.rotary).engine("t")
    kept, other = Segment((5, 6, 7, 8), slot="a"), Segment((9, 10, 11), slot="a")
    for segment in (kept, other):
        engine.register_base(segment, tiny_executor.base_kv(segment))
    engine.pin(kept.shared_id)
    engine.shrink(0)
    assert engine.has_base(kept.shared_id) and not engine.has_base(other.shared_id)
    assert engine.nbytes > 0 and engine.evicted["bases"] == 1
    assert engine.unpin(kept.shared_id) is True
    assert not engine.has_base(kept.shared_id) and kept.shared_id not in engine.pinned
