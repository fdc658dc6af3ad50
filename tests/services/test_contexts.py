"""The store of retained contexts (``kvcomm.services.contexts``): byte caps, TTL, tenants,
release bookkeeping and the records read back after a restart."""

from __future__ import annotations

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
    path = tmp_path / "contexts.json"
    store = ContextStore(path=path)
    kept = _create(store, tokens=(5, 6))
    released = _create(store, tokens=(7,))
    store.evict("t", released.id, "released")
    again = ContextStore(path=path)
    assert (again.get("t", kept.id).state, again.get("t", kept.id).reason) == ("evicted", "restart")
    assert again.get("t", kept.id).token_ids == (5, 6) and again.get("t", released.id).reason == "released"
    assert again.retained_bytes() == 0
    assert again.retain("t", kept.id)[1] is True


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
