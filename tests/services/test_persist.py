"""Saving and loading anchor pools: round trips, refusals, corruption, crashes mid-save."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.fingerprint import ModelFingerprint, model_fingerprint, rope_digest
from kvcomm.core.kv import KV
from kvcomm.services.persist import MANIFEST, PersistError, last_save, load_engine, save_engine, tidy
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.core.rope import Rotary
from kvcomm.reuse.runner import run_row
from kvcomm.core.segments import Prompt, Segment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for support.* when run as a script
from support.one_thread import one_thread  # noqa: E402,F401 (autouse fixture)
from support.two_agent_case import PIPELINE, agent_prompt  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 8


# -- synthetic engines: the engine's real plan/learn path, fed random KV -------------------

def synthetic_rotary() -> Rotary:
    return Rotary(1.0 / (10000.0 ** (torch.arange(0, DIM, 2).float() / DIM)), head_dim=DIM)


def synthetic_fingerprint(rotary: Rotary) -> ModelFingerprint:
    return ModelFingerprint("synthetic-checkpoint", "synthetic-tokenizer", "float32", rope_digest(rotary))


def _random_kv(gen: torch.Generator, length: int, dtype: torch.dtype = torch.float32) -> KV:
    return KV(torch.randn(LAYERS, HEADS, length, DIM, generator=gen).to(dtype),
              torch.randn(LAYERS, HEADS, length, DIM, generator=gen).to(dtype))


def feed(engine: ReuseEngine, seed: int, calls: int, max_len: int = 6, slots: tuple[str, ...] = ("a", "b"),
         dtype: torch.dtype = torch.float32) -> None:
    """``calls`` requests of random prompts (fixed text, shared slots) through plan and learn,
    with KV of ``dtype``; every other one a calibration call (dense, everything learned: a plan
    serves a slot whose estimate has not earned its place realigned, and learns nothing from it)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for call in range(calls):
        segments = [Segment((1, 2, 3))]
        for slot in rng.sample(slots, rng.randint(1, len(slots))):
            segments.append(Segment(tuple(rng.randrange(50) for _ in range(rng.randint(1, max_len))), slot=slot))
            segments.append(Segment((4, 5)))
        prompt = Prompt(rng.choice(["t1", "t2"]), tuple(segments))
        provide = lambda s: _random_kv(gen, len(s), dtype)  # noqa: E731
        plan = engine.calibration_plan(prompt, provide) if call % 2 else engine.plan(prompt, provide)
        engine.learn(plan, _random_kv(gen, len(prompt) - plan.reuse_end, dtype))


def learn_anchor(engine: ReuseEngine, seed: int, tokens: tuple[int, ...], slot: str = "a") -> None:
    """One calibration request (``ReuseEngine.calibration_plan``: dense, everything learned) with
    content ``tokens`` in ``slot``: its base is computed (random KV), and it becomes an anchor of
    that slot's pool with its deviation."""
    gen = torch.Generator().manual_seed(seed)
    prompt = Prompt("t1", (Segment((1, 2, 3)), Segment(tokens, slot=slot), Segment((4, 5))))
    plan = engine.calibration_plan(prompt, lambda s: _random_kv(gen, len(s)))
    engine.learn(plan, _random_kv(gen, len(prompt) - plan.reuse_end))


def _saved_state(engine: ReuseEngine, directory: Path) -> dict:
    """The manifest of a save of ``engine``: its object files are named by their checksums, so
    equal manifests are equal saves, byte for byte."""
    save_engine(engine, directory, synthetic_fingerprint(engine.rotary))
    return json.loads((directory / MANIFEST).read_text())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), calls=st.integers(0, 12), gamma=st.sampled_from([0.3, 1.0]),
       max_anchors=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_round_trip_restores_every_tensor_and_counter(seed, calls, gamma, max_anchors, dtype):
    """bfloat16 KV (so bases and deviations) included. The prefix store, which is not saved,
    holds nothing here (``prefix_store_bytes=0``), so both engines can keep evolving alike."""
    rotary = synthetic_rotary()
    pool = PoolConfig(gamma=gamma, max_anchors=max_anchors)
    config = ReuseConfig(pool=pool, prefix_store_bytes=0)
    engine = ReuseEngine(rotary, config)
    feed(engine, seed, calls, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        before = _saved_state(engine, Path(tmp) / "a")
        restored = ReuseEngine(rotary, config)
        summary = load_engine(Path(tmp) / "a", restored, synthetic_fingerprint(rotary))
        assert summary.pools == {slot: len(pool) for slot, pool in engine.pools.items()}
        # the restored engine saves to the very same bytes: every tensor, id, serial, access count
        assert _saved_state(restored, Path(tmp) / "b") == before
        for slot, pool in engine.pools.items():
            assert pool.next_serial == restored.pools[slot].next_serial and restored.pools[slot].problems() == []
        feed(engine, seed + 1, 3, dtype=dtype)  # and both keep evolving identically
        feed(restored, seed + 1, 3, dtype=dtype)
        assert _saved_state(restored, Path(tmp) / "b") == _saved_state(engine, Path(tmp) / "a")


@pytest.mark.slow
def test_restored_engine_makes_the_same_decisions_and_estimates(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    config = ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=0)  # the prefix store is not saved
    engine = ReuseEngine(tiny_executor.rotary, config)
    for row in range(3):
        run_row(spec, row, tiny_executor, engine)
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    with tempfile.TemporaryDirectory() as tmp:
        save_engine(engine, tmp, fingerprint)
        restored = ReuseEngine(tiny_executor.rotary, config)
        load_engine(tmp, restored, fingerprint)
    estimated = 0
    for agent in spec.agents:
        prompt = agent_prompt(tiny_executor, agent, {"doc": spec.inputs[3]["doc"], "reader": "Bananas are fruit."})
        plans = [e.plan(prompt, tiny_executor.base_kv) for e in (engine, restored)]
        assert [(p.exact_length, p.reuse_end, p.learn, p.note) for p in plans][0] == (
            plans[1].exact_length, plans[1].reuse_end, plans[1].learn, plans[1].note)
        kvs = [e.materialize(p) for e, p in zip((engine, restored), plans)]
        assert torch.equal(kvs[0].keys, kvs[1].keys) and torch.equal(kvs[0].values, kvs[1].values)
        estimated += plans[0].estimated_tokens
        for e, p, kv in zip((engine, restored), plans, kvs):
            e.learn(p, tiny_executor.generate(prompt.token_ids, kv, 2).computed)
    assert estimated > 0  # the comparison covered anchor estimates, not only dense fallbacks
    for slot, pool in engine.pools.items():
        assert [(a.segment_id, a.accesses) for a in pool.anchors] == [(a.segment_id, a.accesses) for a in restored.pools[slot].anchors]


@pytest.mark.slow
def test_fingerprint_tells_models_tokenizers_and_dtypes_apart(tiny_executor, smol_executor):
    tiny = tiny_executor
    base = model_fingerprint(tiny.model, tiny.tokenizer, tiny.rotary)
    assert model_fingerprint(tiny.model, tiny.tokenizer, tiny.rotary) == base and base.kv_dtype == "float32"
    smol = model_fingerprint(smol_executor.model, smol_executor.tokenizer, smol_executor.rotary)
    assert smol.checkpoint != base.checkpoint and smol.rope != base.rope and smol.tokenizer == base.tokenizer
    tuned = copy.deepcopy(tiny.model)
    with torch.no_grad():  # a light fine-tune of one layer: same architecture, other weights
        tuned.model.layers[1].mlp.down_proj.weight.add_(1e-4 * torch.randn_like(tuned.model.layers[1].mlp.down_proj.weight))
    other = model_fingerprint(tuned, tiny.tokenizer, tiny.rotary)
    assert other.checkpoint != base.checkpoint and other.mismatches(base) == [
        f"checkpoint: saved {other.checkpoint[:16]}, this model {base.checkpoint[:16]}"]
    retemplated = copy.copy(tiny.tokenizer)
    retemplated.chat_template = (tiny.tokenizer.chat_template or "") + "{{ '!' }}"
    assert model_fingerprint(tiny.model, retemplated, tiny.rotary).tokenizer != base.tokenizer
    assert model_fingerprint(tiny.model, tiny.tokenizer, tiny.rotary, torch.bfloat16).kv_dtype == "bfloat16"


# -- refusals --------------------------------------------------------------------------------

def _state(engine: ReuseEngine):
    return ({s: [(a.segment_id, a.accesses, id(a)) for a in p.anchors] for s, p in engine.pools.items()},
            dict(engine._bases), dict(engine._fixed_bases))


@pytest.fixture()
def saved(tmp_path):
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    feed(engine, 0, 10)
    save_engine(engine, tmp_path, synthetic_fingerprint(rotary))
    target = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    feed(target, 99, 4)  # the target already holds state, which a refused load must leave alone
    return tmp_path, target, _state(target)


def _refused(directory: Path, target: ReuseEngine, before, match: str, fingerprint=None) -> None:
    with pytest.raises(PersistError, match=match):
        load_engine(directory, target, fingerprint or synthetic_fingerprint(target.rotary))
    assert _state(target) == before


def _restored_kv(engine: ReuseEngine) -> list[torch.Tensor]:
    """Every KV tensor a load restores: anchors' bases and deviations, content bases, fixed bases."""
    kvs = [kv for kv, _ in engine._bases.values()] + list(engine._fixed_bases.values())
    for pool in engine.pools.values():
        for anchor in pool.anchors:
            kvs.append(anchor.base)
            for deviation in anchor.deviations.values():
                kvs += [kv for kv in (deviation.shared, deviation.following) if kv is not None]
    return [t for kv in kvs for t in (kv.keys, kv.values)]


def test_load_puts_the_kv_on_the_named_device(saved):
    """An engine whose model runs on a GPU works on the GPU: its restored KV must be there too,
    or its next estimate mixes devices. "meta" stands in for a second device on a CPU machine."""
    directory, target, _ = saved
    load_engine(directory, target, synthetic_fingerprint(target.rotary), device="meta")
    restored = _restored_kv(target)
    assert restored and {t.device.type for t in restored} == {"meta"}
    fits = [t for pool in target.pools.values() for fit in pool.fits.values() for t in (fit.cross, fit.real_sq)]
    assert all(t.device.type == "cpu" for t in fits)  # small statistics stay in host memory
    load_engine(directory, target, synthetic_fingerprint(target.rotary))
    assert {t.device.type for t in _restored_kv(target)} == {"cpu"}


@pytest.mark.parametrize("device", ["no-such-device", "cuda:63"])
def test_a_device_torch_cannot_use_is_refused_before_anything_loads(saved, device):
    directory, target, before = saved
    with pytest.raises(ValueError, match=r"cannot restore a kvcomm save onto device .*name the device"):
        load_engine(directory, target, synthetic_fingerprint(target.rotary), device=device)
    assert _state(target) == before


def test_another_model_is_refused(saved):
    directory, target, before = saved
    good = synthetic_fingerprint(target.rotary)
    for field in ("checkpoint", "tokenizer", "kv_dtype"):
        other = ModelFingerprint(**{**good.to_json(), field: "something else"})
        _refused(directory, target, before, f"another model.*{field}", other)
    other_rotary = Rotary(synthetic_rotary().inv_freq * 2, head_dim=DIM)
    stranger = ReuseEngine(other_rotary)
    with pytest.raises(PersistError, match="another model.*rope"):
        load_engine(directory, stranger, synthetic_fingerprint(other_rotary))
    assert not stranger.pools
    with pytest.raises(PersistError, match="rope"):  # a wrong fingerprint cannot talk the engine into it
        load_engine(directory, stranger, good)


def _first_object(directory: Path) -> str:
    """The object file of the first anchor's base."""
    return json.loads((directory / MANIFEST).read_text())["pools"][0]["anchors"][0]["base"]["file"]


def _tensor_file(directory: Path) -> Path:
    return directory / _first_object(directory)


def _flip(directory: Path) -> None:
    path = _tensor_file(directory)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(directory: Path) -> None:
    path = _tensor_file(directory)
    path.write_bytes(path.read_bytes()[:-100])


def _rewrite_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    edit(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _renamed(obj, old: str, ref: dict):
    """``obj`` (a manifest) with every reference to object file ``old`` replaced by ``ref``."""
    if isinstance(obj, dict):
        return ref if obj.get("file") == old and "bytes" in obj else {k: _renamed(v, old, ref) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_renamed(v, old, ref) for v in obj]
    return obj


def _rewrite_tensors(directory: Path, change) -> None:
    """Replace the first anchor base's object file by ``change(its tensors)``, well formed, named
    by its checksum and recorded with its size in the manifest (a save that reads but is wrong)."""
    import hashlib

    old = _first_object(directory)
    data = save(change(load_file(str(directory / old))))
    name = f"obj-{hashlib.sha256(data).hexdigest()}.safetensors"
    (directory / name).write_bytes(data)
    manifest = _renamed(json.loads((directory / MANIFEST).read_text()), old, {"file": name, "bytes": len(data)})
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _drop_tensor(directory: Path) -> None:
    """A well-formed file with a matching checksum, one tensor short."""
    def one_short(tensors):
        del tensors[min(tensors)]
        return tensors
    _rewrite_tensors(directory, one_short)


VERSION_2 = Path(__file__).resolve().parent / "data" / "version-2-save"
"""A save written by kvcomm's format version 2 (main at fcf4c08, before saves became one file
per object): ``save_engine`` of ``ReuseEngine(synthetic_rotary(), ReuseConfig(pool=PoolConfig(gamma=0.0),
prefix_store_bytes=0))`` after ``feed(engine, 7, 16)``, as ``_version_2_engine`` builds it."""


VERSION_2_REFERENCE = Path(__file__).resolve().parent / "data" / "version-2-reference"
"""A version 3 save of the engine the version 2 save was written from (``feed(engine, 7, 16)``
at gamma 0, no prefix store, one intra-op thread), written by commit db41945: its plans learned from segments that
later plans serve realigned (the estimate-or-realign rule, 2026-12-07), so ``feed`` no longer
rebuilds that state."""


def _version_2_engine() -> ReuseEngine:
    engine = ReuseEngine(synthetic_rotary(), ReuseConfig(pool=PoolConfig(gamma=0.0), prefix_store_bytes=0))
    load_engine(VERSION_2_REFERENCE, engine, synthetic_fingerprint(engine.rotary))
    return engine


def _legacy_rewrite(directory: Path, change, edit) -> None:
    """Version 1/2: replace the one tensor file by ``change(tensors)``, record its checksum and
    size, then ``edit`` the manifest."""
    import hashlib
    manifest = json.loads((directory / MANIFEST).read_text())
    path = directory / manifest["tensors"]["file"]
    save_file(change(load_file(str(path))), str(path))
    manifest["tensors"].update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)
    edit(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def _as_version_1(directory: Path) -> None:
    """Rewrite a version 2 save as version 1 wrote it: every layer of a deviation stored (layer 0
    zero), no first_layer field."""
    def edit(m):
        m.update(version=1)
        for pool in m["pools"]:
            for anchor in pool["anchors"]:
                for dev in anchor["deviations"]:
                    del dev["first_layer"]
    _legacy_rewrite(directory, lambda tensors: {
        name: (torch.cat([t.new_zeros((1, *t.shape[1:])), t]) if ".dev" in name else t) for name, t in tensors.items()}, edit)


def _same_state(a: ReuseEngine, b: ReuseEngine) -> None:
    """Equal pools (ids, serials, accesses, bases, embeddings, deviations, fits), bases and fixed bases."""
    def kv_equal(x: KV, y: KV) -> bool:
        return x.keys.dtype == y.keys.dtype and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)

    assert sorted(a.pools) == sorted(b.pools)
    for slot, pool in a.pools.items():
        other = b.pools[slot]
        assert (pool.next_serial, pool.evictions) == (other.next_serial, other.evictions) and other.problems() == []
        for x, y in zip(pool.anchors, other.anchors, strict=True):
            assert (x.segment_id, x.serial, x.accesses, sorted(x.deviations)) == (y.segment_id, y.serial, y.accesses, sorted(y.deviations))
            assert kv_equal(x.base, y.base) and (x.embedding == y.embedding).all()
            for k, d in x.deviations.items():
                e = y.deviations[k]
                assert kv_equal(d.shared, e.shared) and (d.first_layer, d.following_base) == (e.first_layer, e.following_base)
                assert (d.following is None) == (e.following is None) and (d.following is None or kv_equal(d.following, e.following))
        assert sorted(pool.fits) == sorted(other.fits)
        for k, fit in pool.fits.items():
            assert fit.pairs == other.fits[k].pairs and torch.equal(fit.cross, other.fits[k].cross)
            assert torch.equal(fit.estimate_sq, other.fits[k].estimate_sq) and torch.equal(fit.real_sq, other.fits[k].real_sq)
        assert pool.evidence == other.evidence
    assert sorted(a._bases) == sorted(b._bases) and sorted(a._fixed_bases) == sorted(b._fixed_bases)
    for k, (kv, embedding) in a._bases.items():
        assert kv_equal(kv, b._bases[k][0]) and (embedding == b._bases[k][1]).all()
    for k, kv in a._fixed_bases.items():
        assert kv_equal(kv, b._fixed_bases[k])


def test_a_version_2_save_loads_and_the_next_save_replaces_it(tmp_path):
    """A save written by the previous format loads exactly; saving the folder again writes
    version 3 and removes the old tensor file once the new manifest is in place."""
    import shutil

    directory = tmp_path / "v2"
    shutil.copytree(VERSION_2, directory)
    expected = _version_2_engine()
    assert sum(len(p.fits) for p in expected.pools.values()) > 0  # the fits are covered too
    restored = ReuseEngine(expected.rotary, expected.config)
    load_engine(directory, restored, synthetic_fingerprint(restored.rotary))
    _same_state(expected, restored)
    save_engine(restored, directory, synthetic_fingerprint(restored.rotary))
    assert json.loads((directory / MANIFEST).read_text())["version"] == 3 and not list(directory.glob("tensors-*"))
    again = ReuseEngine(expected.rotary, expected.config)
    load_engine(directory, again, synthetic_fingerprint(again.rotary))
    _same_state(expected, again)


def test_a_version_1_save_loads_with_every_layer_of_its_deviations(tmp_path):
    import shutil

    directory = tmp_path / "v1"
    shutil.copytree(VERSION_2, directory)
    rotary = synthetic_rotary()
    fresh = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    load_engine(directory, fresh, synthetic_fingerprint(rotary))
    _as_version_1(directory)
    old = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    load_engine(directory, old, synthetic_fingerprint(rotary))
    pairs = [(a.deviations[k], b.deviations[k]) for slot in fresh.pools for a, b in
             zip(fresh.pools[slot].anchors, old.pools[slot].anchors, strict=True) for k in a.deviations]
    assert pairs
    for new, v1 in pairs:
        assert (new.first_layer, v1.first_layer) == (1, 0)
        assert not v1.shared.keys[0].any() and torch.equal(v1.shared.keys[1:], new.shared.keys)
        assert torch.equal(v1.shared.values[1:], new.shared.values)


def _first_layer(directory: Path, value) -> None:
    _rewrite_manifest(directory, lambda m: m["pools"][0]["anchors"][0]["deviations"][0].update(first_layer=value))


CORRUPTIONS = {
    "flipped byte": (_flip, "checksum mismatch"),
    "truncated tensors": (_truncate, "truncated"),
    "bad json": (lambda d: (d / MANIFEST).write_text('{"format": "kvcomm-anchors", "vers'), "not valid JSON"),
    "truncated manifest": (lambda d: (d / MANIFEST).write_bytes((d / MANIFEST).read_bytes()[:-40]), "not valid JSON"),
    "missing tensor": (_drop_tensor, "is missing"),
    "missing object file": (lambda d: _tensor_file(d).unlink(), "object file missing"),
    "wrong field type": (lambda d: _rewrite_manifest(d, lambda m: m["pools"][0].update(anchors="x")), "must be a list"),
    "evidence not a list": (lambda d: _rewrite_manifest(d, lambda m: m["pools"][0].update(evidence=5)), "must be a list"),
    "negative evidence": (lambda d: _rewrite_manifest(d, lambda m: m["pools"][0].update(evidence=[
        {"template": "t", "slot": "s", "part": "shared", "estimate_sq": [-1.0, 0.0], "realign_sq": [0.0, 0.0], "pairs": 1}])),
        "sums of squares"),
    "other format": (lambda d: _rewrite_manifest(d, lambda m: m.update(format="x")), "not a kvcomm anchor save"),
    "newer version": (lambda d: _rewrite_manifest(d, lambda m: m.update(version=99)), "format version 99"),
    "first layer out of range": (lambda d: _first_layer(d, LAYERS), "first_layer 2 is not a layer"),
    "first layer not stored": (lambda d: _first_layer(d, 0), "inconsistent with the rest"),
    "no manifest": (lambda d: (d / MANIFEST).unlink(), "manifest missing"),
    "path in file name": (lambda d: _rewrite_manifest(d, lambda m: m["pools"][0]["anchors"][0]["base"].update(
        file="../x")), "must name an object file"),
    "object file of another size": (lambda d: _rewrite_manifest(d, lambda m: m["pools"][0]["anchors"][0]["base"].update(
        bytes=1)), "truncated"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_saves_are_refused_and_nothing_is_half_loaded(saved, corruption):
    directory, target, before = saved
    damage, message = CORRUPTIONS[corruption]
    damage(directory)
    _refused(directory, target, before, message)


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _leaves(value, path + (i,))
    else:
        yield path


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
                           max_leaves=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_load_or_raise_persist_error(saved, data):
    directory, target, _ = saved
    before = _state(target)  # an earlier example may have loaded a valid variant into it
    original = (directory / MANIFEST).read_text()
    manifest = json.loads(original)
    paths = [p for p in _leaves(manifest) if p[0] != "tensors"]
    path = data.draw(st.sampled_from(paths))
    holder = manifest
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = data.draw(json_values)
    (directory / MANIFEST).write_text(json.dumps(manifest))
    try:
        load_engine(directory, target, synthetic_fingerprint(target.rotary))
    except PersistError:
        assert _state(target) == before
    finally:
        (directory / MANIFEST).write_text(original)


def test_pool_over_this_engines_limits_is_refused(saved):
    directory, target, before = saved
    small = ReuseEngine(target.rotary, ReuseConfig(pool=PoolConfig(max_anchors=1)))
    with pytest.raises(PersistError, match="exceed max_anchors"):
        load_engine(directory, small, synthetic_fingerprint(target.rotary))
    assert not small.pools


def test_a_tenant_restored_from_a_save_is_held_to_its_quota(saved):
    from kvcomm.services.tenants import TenantRegistry

    directory, target, _ = saved
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    free = TenantRegistry(target.rotary, config)
    free.load("acme", directory, synthetic_fingerprint(target.rotary))
    quota = free.nbytes // 2
    registry = TenantRegistry(target.rotary, config, max_tenant_bytes=quota)
    registry.load("acme", directory, synthetic_fingerprint(target.rotary))
    engine = registry.engine("acme")
    assert 0 < engine.nbytes <= quota and any(len(p) for p in engine.pools.values())
    assert sum(engine.evicted.values()) > 0  # the save held more than the quota


# -- crash safety ----------------------------------------------------------------------------

class _Crash(BaseException):
    """Stands for the process dying at an injected point (BaseException: nothing catches it)."""


def _half(path) -> None:
    path = Path(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _named(directory: Path) -> set[str]:
    """Object files the manifest names (the fits file included)."""
    return set(re.findall(r'"(obj-[0-9a-f]{64}\.safetensors)"', (directory / MANIFEST).read_text()))


@pytest.mark.parametrize("point", ["object write", "object commit", "manifest write", "removing old files"])
def test_a_crash_at_any_step_of_a_save_leaves_the_previous_save(tmp_path, monkeypatch, point):
    """The save after new learning dies at each step in turn: halfway through an object file,
    after some objects are complete, halfway through the manifest, after the manifest before
    the files it no longer names are gone. The folder loads the previous save until the commit
    (the new one after), and the next save completes and leaves exactly the files it names."""
    import kvcomm.services.persist as persist

    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=6)))
    feed(engine, 0, 10)
    save_engine(engine, tmp_path, synthetic_fingerprint(rotary))
    feed(engine, 1, 8)  # new anchors and deviations, and some evicted: new files, and old ones to remove
    for pool in engine.pools.values():
        for anchor in pool.anchors:
            anchor.accesses = 77
    real_write, real_commit, real_text, writes = persist._write_object, persist._commit_objects, persist.write_text_atomically, []

    def write_object(path, data):
        writes.append(path.name)
        if point == "object write" and len(writes) == 2:  # the second temp file gets halfway, then the process dies
            (path.parent / ".kvcomm-torn.safetensors").write_bytes(data[: len(data) // 2])
            raise _Crash
        return real_write(path, data)

    def commit_objects(pending):  # half the objects in place under their names, then the process dies
        real_commit(pending[: len(pending) // 2])
        raise _Crash

    def write_text(path, text):
        if point == "manifest write":
            (path.parent / ".kvcomm-torn.json").write_text(text[: len(text) // 2])
            raise _Crash
        real_text(path, text)

    def remove_unnamed(directory, named):
        raise _Crash

    monkeypatch.setattr(persist, "_write_object", write_object)
    monkeypatch.setattr(persist, "write_text_atomically", write_text)
    if point == "object commit":
        monkeypatch.setattr(persist, "_commit_objects", commit_objects)
    if point == "removing old files":
        monkeypatch.setattr(persist, "_remove_unnamed", remove_unnamed)
    with pytest.raises(_Crash):
        save_engine(engine, tmp_path, synthetic_fingerprint(rotary))
    monkeypatch.undo()
    assert len(writes) >= 2  # the crash came while objects were being written or after
    restored = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=6)))
    load_engine(tmp_path, restored, synthetic_fingerprint(rotary))
    accesses = {a.accesses for p in restored.pools.values() for a in p.anchors}
    assert accesses == {77} if point == "removing old files" else 77 not in accesses  # the new save, or the previous
    save_engine(engine, tmp_path, synthetic_fingerprint(rotary))  # the next save completes and tidies up
    load_engine(tmp_path, restored, synthetic_fingerprint(rotary))
    assert {a.accesses for p in restored.pools.values() for a in p.anchors} == {77}
    _same_state(engine, restored)
    assert {p.name for p in tmp_path.iterdir()} == {MANIFEST} | _named(tmp_path)


SAVER_CONFIG = ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=24))
"""The killed saver's engine settings; its saves are restored into engines of the same."""


def _saver(directory: str) -> None:
    """Subprocess body: save a ~25 MB engine again and again, learning a few new anchors (new
    object files of up to a few MB, and evictions) and bumping a counter each time."""
    torch.set_num_threads(1)
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, SAVER_CONFIG)
    feed(engine, 0, 40, max_len=3000)
    fingerprint = synthetic_fingerprint(rotary)
    for i in range(10**6):
        feed(engine, 1000 + i, 3, max_len=3000)
        for anchor in [a for p in engine.pools.values() for a in p.anchors]:
            anchor.accesses = i
        save_engine(engine, directory, fingerprint)
        print(i, flush=True)


@pytest.mark.slow
def test_killing_a_save_midway_leaves_the_previous_save_loadable(tmp_path):
    rng = random.Random(0)
    proc = subprocess.Popen([sys.executable, __file__, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # one complete save before the kills start
        assert first.strip() == "0", first
        for _ in range(15):  # random moments, mostly inside a write (the tests above inject crashes deterministically)
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(proc.pid, signal.SIGSTOP)  # freeze it at a random moment, load, then let it go on
            restored = ReuseEngine(synthetic_rotary(), SAVER_CONFIG)
            load_engine(tmp_path, restored, synthetic_fingerprint(restored.rotary))
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = [int(line) for line in [first, *proc.stdout.read().split()] if line.strip()]
        assert len(done) >= 3, done  # several saves ran, so the kills landed at varied points
    finally:
        proc.kill()
    restored = ReuseEngine(synthetic_rotary(), SAVER_CONFIG)
    load_engine(tmp_path, restored, synthetic_fingerprint(restored.rotary))
    (counter,) = {a.accesses for p in restored.pools.values() for a in p.anchors}  # one whole save
    assert done[-1] <= counter <= done[-1] + 1  # the last complete save, or one committed unprinted
    tidy(tmp_path)  # what a restart does: the killed save's temp files and unnamed objects go
    assert {p.name for p in tmp_path.iterdir()} == {MANIFEST} | _named(tmp_path)
    load_engine(tmp_path, restored, synthetic_fingerprint(restored.rotary))


if __name__ == "__main__":
    _saver(sys.argv[1])


def test_shrinkage_fits_and_evidence_survive_a_restart(tmp_path):
    """A restarted server keeps shrinking its slots' estimates as before, not raw until refitted,
    and serves the estimate where its slot had earned it, not the realigned base until earned again."""
    rotary = synthetic_rotary()
    config = ReuseConfig(pool=PoolConfig(gamma=0.0), prefix_store_bytes=0)
    engine = ReuseEngine(rotary, config)
    feed(engine, 7, 16)
    fits = {(slot, key): fit for slot, pool in engine.pools.items() for key, fit in pool.fits.items()}
    assert fits and any(fit.pairs >= 2 for fit in fits.values())
    save_engine(engine, tmp_path / "s", synthetic_fingerprint(rotary))
    restored = ReuseEngine(rotary, config)
    load_engine(tmp_path / "s", restored, synthetic_fingerprint(rotary))
    for (slot, key), fit in fits.items():
        again = restored.pools[slot].fits[key]
        assert again.pairs == fit.pairs and torch.equal(again.cross, fit.cross) and torch.equal(again.real_sq, fit.real_sq)
    evidence = {(slot, key): e for slot, pool in engine.pools.items() for key, e in pool.evidence.items()}
    assert evidence and any(e.pairs >= 2 for e in evidence.values())
    assert {(slot, key): e for slot, pool in restored.pools.items() for key, e in pool.evidence.items()} == evidence
    earned = {(slot, key): engine.pools[slot].earned(*key) for slot, key in evidence}
    assert any(earned.values()) and {(slot, key): restored.pools[slot].earned(*key) for slot, key in evidence} == earned


def test_a_save_removes_temp_files_a_killed_save_left_behind(tmp_path):
    """safetensors writes through a ".tmp*" file of its own beside the target; a save killed
    mid-write leaves it (and kvcomm's own ".kvcomm-*" temp file) behind. The next save of the
    folder (one writer per folder) removes them; other files stay."""
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    feed(engine, 0, 4)
    fingerprint = synthetic_fingerprint(rotary)
    for name in (".tmpAbC123", ".kvcomm-x1y2.safetensors"):
        (tmp_path / name).write_bytes(b"\0" * 1000)
    (tmp_path / "notes.txt").write_text("mine")
    save_engine(engine, tmp_path, fingerprint)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- saves proportional to what changed ------------------------------------------------------

def _files(directory: Path) -> dict[str, int]:
    """Object file -> inode: a file written again (renamed over) gets a new inode."""
    return {p.name: p.stat().st_ino for p in directory.glob("obj-*")}


def test_a_save_after_new_learning_writes_only_the_new_objects(tmp_path, monkeypatch):
    """Objects already on disk are known by identity: not serialized, hashed or written again."""
    import kvcomm.services.persist as persist

    serialized = []
    monkeypatch.setattr(persist, "serialize", lambda tensors: serialized.append(sorted(tensors)) or save(tensors))
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=0))
    feed(engine, 0, 60)
    fingerprint = synthetic_fingerprint(rotary)
    save_engine(engine, tmp_path, fingerprint)
    first, before = last_save(engine, tmp_path), _files(tmp_path)
    assert first.written == len(before) > 20 and first.reused == 0
    assert first.total_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())

    serialized.clear()
    save_engine(engine, tmp_path, fingerprint)  # nothing learned: only the manifest is written
    assert last_save(engine, tmp_path).written == 0 and _files(tmp_path) == before
    assert all(names[0].startswith("pool") for names in serialized)  # the fit sums (copies) at most

    anchors = {id(a): a for p in engine.pools.values() for a in p.anchors}
    learn_anchor(engine, 5, tuple(range(60, 90)))  # one new anchor, with its deviation in one slot
    (anchor,) = [a for p in engine.pools.values() for a in p.anchors if id(a) not in anchors]
    new = [anchor.base] + [d.shared for d in anchor.deviations.values()]
    serialized.clear()
    save_engine(engine, tmp_path, fingerprint)
    objects = [names for names in serialized if not names[0].startswith("pool")]
    assert len(objects) == 1 + len(anchor.deviations)  # the base (the engine's base of it too), its deviations
    third, after = last_save(engine, tmp_path), _files(tmp_path)
    assert {n: i for n, i in after.items() if n in before} == {n: i for n, i in before.items() if n in after}
    assert third.written == len(set(after) - set(before)) >= 1
    # about the new objects' bytes (their KV, an embedding, a following deviation, the fits file)
    assert third.written_bytes < 0.2 * third.total_bytes
    assert third.written_bytes >= sum(kv.nbytes for kv in new)
    restored = ReuseEngine(rotary, engine.config)
    load_engine(tmp_path, restored, fingerprint)
    _same_state(engine, restored)


def test_objects_loaded_at_start_are_not_written_again(tmp_path):
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=0.0), prefix_store_bytes=0))
    feed(engine, 3, 16)
    fingerprint = synthetic_fingerprint(rotary)
    save_engine(engine, tmp_path, fingerprint)
    before = _files(tmp_path)
    restarted = ReuseEngine(rotary, engine.config)
    load_engine(tmp_path, restarted, fingerprint)
    save_engine(restarted, tmp_path, fingerprint)
    assert last_save(restarted, tmp_path).written == 0 and _files(tmp_path) == before
    feed(restarted, 4, 2)
    feed(engine, 4, 2)
    save_engine(restarted, tmp_path, fingerprint)
    assert 0 < last_save(restarted, tmp_path).written < len(before)
    again = ReuseEngine(rotary, engine.config)
    load_engine(tmp_path, again, fingerprint)
    _same_state(engine, again)


def test_a_shared_base_is_one_file_and_one_tensor_after_a_load(tmp_path):
    """An anchor takes its content's base itself (no copy), so the engine's base of that content
    and the anchor's are the same tensors: saved once, and restored shared (not two copies)."""
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=0))
    feed(engine, 0, 12)
    shared = [(a, engine._bases[a.segment_id]) for p in engine.pools.values() for a in p.anchors if a.segment_id in engine._bases]
    assert shared and all(a.base is kv for a, (kv, _) in shared)
    save_engine(engine, tmp_path, synthetic_fingerprint(rotary))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    refs = [r["file"]["file"] for r in manifest["bases"]] + [a["base"]["file"] for p in manifest["pools"] for a in p["anchors"]]
    assert len(set(refs)) < len(refs) and len(_files(tmp_path)) == len(_named(tmp_path))
    restored = ReuseEngine(rotary, engine.config)
    load_engine(tmp_path, restored, synthetic_fingerprint(rotary))
    for anchor, _ in shared:
        again = restored.pools[next(s for s, p in engine.pools.items() if anchor in p.anchors)].get(anchor.segment_id)
        assert again.base is restored._bases[anchor.segment_id][0]


def test_a_tensor_changed_in_place_is_written_again(tmp_path):
    """Identity alone would miss a stored tensor changed in place (no kvcomm code does; a
    future one might): its version counter tells, and the save writes it again."""
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=0))
    feed(engine, 0, 10)
    fingerprint = synthetic_fingerprint(rotary)
    save_engine(engine, tmp_path, fingerprint)
    anchor = next(a for p in engine.pools.values() for a in p.anchors)
    anchor.base.keys[0, 0, 0].add_(1.0)  # through a view
    next(iter(anchor.deviations.values())).shared.values.mul_(2.0)
    save_engine(engine, tmp_path, fingerprint)
    assert last_save(engine, tmp_path).written >= 2
    restored = ReuseEngine(rotary, engine.config)
    load_engine(tmp_path, restored, fingerprint)
    _same_state(engine, restored)


def test_a_folder_another_writer_changed_is_written_whole(tmp_path):
    """What this process knows about a folder holds only while its manifest is the one it
    committed: after another save there, or with an object file gone, the next save writes
    what the folder lacks."""
    rotary = synthetic_rotary()
    config = ReuseConfig(pool=PoolConfig(gamma=1.0), prefix_store_bytes=0)
    engine, other = ReuseEngine(rotary, config), ReuseEngine(rotary, config)
    feed(engine, 0, 10)
    feed(other, 50, 10)
    fingerprint = synthetic_fingerprint(rotary)
    save_engine(engine, tmp_path, fingerprint)
    count = last_save(engine, tmp_path).written
    save_engine(other, tmp_path, fingerprint)  # removes every file of the first save
    save_engine(engine, tmp_path, fingerprint)
    assert last_save(engine, tmp_path).written == count
    victim = sorted(_named(tmp_path))[0]
    (tmp_path / victim).unlink()
    save_engine(engine, tmp_path, fingerprint)
    assert last_save(engine, tmp_path).written == 1 and (tmp_path / victim).is_file()
    restored = ReuseEngine(rotary, config)
    load_engine(tmp_path, restored, fingerprint)
    _same_state(engine, restored)


def test_tidy_removes_what_a_killed_save_left_and_nothing_live(tmp_path):
    rotary = synthetic_rotary()
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    feed(engine, 0, 6)
    save_engine(engine, tmp_path, synthetic_fingerprint(rotary))
    live = {p.name for p in tmp_path.iterdir()}
    orphan = "obj-" + "0" * 64 + ".safetensors"  # an object a killed save renamed into place
    for name in (".tmpAbC123", ".kvcomm-x1y2.safetensors", orphan, "tensors-" + "1" * 32 + ".safetensors"):
        (tmp_path / name).write_bytes(b"\0" * 1000)
    (tmp_path / "notes.txt").write_text("mine")
    removed = tidy(tmp_path)
    assert len(removed) == 4 and {p.name for p in tmp_path.iterdir()} == live | {"notes.txt"}
    (tmp_path / MANIFEST).write_text("{")  # unreadable: nothing is known to be dead but temp files
    (tmp_path / orphan).write_bytes(b"\0")
    (tmp_path / ".tmpX").write_bytes(b"\0")
    assert [p.name for p in tidy(tmp_path)] == [".tmpX"] and (tmp_path / orphan).is_file()


def test_a_save_at_interpreter_exit_completes(tmp_path):
    """`kvcomm serve` saves once more at exit (``atexit``), when Python refuses new threads
    for a thread pool: the object files are then synced one at a time, and the save completes."""
    script = f"""
import atexit, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_persist import ReuseEngine, ReuseConfig, PoolConfig, synthetic_rotary, synthetic_fingerprint, feed, save_engine
engine = ReuseEngine(synthetic_rotary(), ReuseConfig(pool=PoolConfig(gamma=1.0)))
feed(engine, 0, 6)
atexit.register(save_engine, engine, {str(tmp_path)!r}, synthetic_fingerprint(engine.rotary))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Error" not in run.stderr, run.stderr[-3000:]
    restored = ReuseEngine(synthetic_rotary(), ReuseConfig(pool=PoolConfig(gamma=1.0)))
    load_engine(tmp_path, restored, synthetic_fingerprint(restored.rotary))
    assert restored.pools
