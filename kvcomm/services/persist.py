"""Save and load an engine's anchor pools and the bases they need, so a restarted server
does not start cold.

A save is a directory holding ``manifest.json`` and one ``tensors-<sha256>.safetensors``.
Both are written atomically (temp file in the same directory, fsync, rename, fsync of the
directory); the manifest, written last, is the commit point and names its tensor file with
its checksum, so a crash at any moment leaves the previous save loadable. Older tensor
files are removed only after the new manifest is durable. One writer per directory.

Loading checks everything before touching the engine: format, the model fingerprint (and
the engine's own RoPE against it), the tensor file's size and checksum, every tensor's
presence, shape and dtype, and the pools' invariants. Any failure raises ``PersistError``
and leaves the engine as it was; on success pools, shared-content bases and fixed-segment
bases are replaced together, under the engine's lock. The exact prefix store is not saved.

Restored KV (bases, deviations, fixed bases) goes to the device the loader names, which must
be the one the engine's model hands it KV on: the engine works where its KV lives, so a GPU
engine given host-memory anchors would mix devices in its next estimate. Shrinkage sums
stay in host memory, as the engine keeps them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvcomm.anchors.anchor import Anchor, Deviation
from kvcomm.anchors.pool import AnchorPool
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.fingerprint import ModelFingerprint, rope_digest
from kvcomm.core.kv import KV

FORMAT = "kvcomm-anchors"
VERSION = 2
READS = (1, 2)
"""Versions this kvcomm loads: 1 stored every layer of a deviation, 2 says where each starts."""
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20


class PersistError(ValueError):
    """A save that cannot be loaded here: another model, or a corrupt / truncated file."""


@dataclass(frozen=True)
class LoadSummary:
    pools: dict[str, int]  # slot -> anchors
    bases: int
    fixed_bases: int
    bytes: int


# -- writing ---------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _temp(directory: Path, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=".kvcomm-", suffix=suffix, dir=directory)
    os.close(fd)
    return Path(name)


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` the way saves write their files: a temp file beside
    it, fsync, rename over ``path``, fsync of the folder. A crash leaves the old file or the new."""
    tmp = _temp(path.parent, path.suffix or ".txt")
    try:
        tmp.write_text(text, encoding="utf-8")
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _put(tensors: dict[str, torch.Tensor], name: str, kv: KV) -> None:
    tensors[name + ".k"] = kv.keys.contiguous().clone()
    tensors[name + ".v"] = kv.values.contiguous().clone()


def _put_embedding(tensors: dict[str, torch.Tensor], name: str, vector: np.ndarray) -> None:
    """``vector`` as an fp32 ``[dim]`` tensor (what ``_Reader.embedding`` reads back)."""
    tensors[name] = torch.from_numpy(np.array(vector, dtype=np.float32))


def _snapshot(engine: ReuseEngine) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest body and tensors of ``engine``'s pools and bases (copied under its lock)."""
    tensors: dict[str, torch.Tensor] = {}
    pools, fixed, bases = [], [], []
    with engine._lock:
        for p, (slot, pool) in enumerate(sorted(engine.pools.items())):
            anchors = []
            for a, anchor in enumerate(pool.anchors):
                name = f"pool{p}.anchor{a}"
                _put(tensors, name + ".base", anchor.base)
                _put_embedding(tensors, name + ".embedding", anchor.embedding)
                deviations = []
                for d, ((template, slot_name), deviation) in enumerate(anchor.deviations.items()):
                    _put(tensors, f"{name}.dev{d}.shared", deviation.shared)
                    if deviation.following is not None:
                        _put(tensors, f"{name}.dev{d}.following", deviation.following)
                    deviations.append({"template": template, "slot": slot_name, "following": deviation.following is not None,
                                       "following_base": deviation.following_base, "first_layer": deviation.first_layer})
                anchors.append({"segment_id": anchor.segment_id, "serial": anchor.serial, "accesses": anchor.accesses,
                                "deviations": deviations})
            fits = []
            for f, (((template, slot_name), part), fit) in enumerate(sorted(pool.fits.items())):
                for field_name in ("cross", "estimate_sq", "real_sq"):
                    tensors[f"pool{p}.fit{f}.{field_name}"] = getattr(fit, field_name).clone()
                fits.append({"template": template, "slot": slot_name, "part": part, "pairs": fit.pairs})
            pools.append({"slot": slot, "next_serial": pool.next_serial, "evictions": pool.evictions, "anchors": anchors,
                          "fits": fits})
        for f, ((template, content), kv) in enumerate(engine._fixed_bases.items()):
            _put(tensors, f"fixed{f}", kv)
            fixed.append({"template": template, "content": content})
        for b, (shared_id, (kv, embedding)) in enumerate(engine._bases.items()):
            _put(tensors, f"base{b}", kv)
            _put_embedding(tensors, f"base{b}.embedding", embedding)
            bases.append({"shared_id": shared_id})
    return {"pools": pools, "fixed_bases": fixed, "bases": bases}, tensors


def save_engine(engine: ReuseEngine, directory: str | os.PathLike, fingerprint: ModelFingerprint) -> Path:
    """Save ``engine``'s anchor pools, shared-content bases and fixed-segment bases under
    ``directory`` (created if missing, mode 0700) for the model ``fingerprint`` names. Returns the manifest path."""
    if fingerprint.rope != rope_digest(engine.rotary):
        raise PersistError("the fingerprint's RoPE does not match the engine's rotary: pass this model's fingerprint")
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # private whatever the umask: a save holds KV computed from user content
    # temp files of saves that crashed (one writer per directory): ours, and safetensors' own
    # ".tmp*" beside the file it writes (a save killed mid-write left 20+ MB of them behind)
    for stale in [*directory.glob(".kvcomm-*"), *directory.glob(".tmp*")]:
        stale.unlink(missing_ok=True)
    body, tensors = _snapshot(engine)
    tmp = _temp(directory, ".safetensors")
    try:
        save_file(tensors, str(tmp))
        digest = _sha256(tmp)
        name = f"tensors-{digest[:32]}.safetensors"
        size = tmp.stat().st_size
        _commit(tmp, directory / name)
        config = engine.config
        manifest = {
            "format": FORMAT, "version": VERSION, "fingerprint": fingerprint.to_json(),
            "config": {"mode": config.mode, "scope": config.scope, "pool": asdict(config.pool)},
            "tensors": {"file": name, "sha256": digest, "bytes": size}, **body,
        }
        write_text_atomically(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    finally:
        tmp.unlink(missing_ok=True)
    for old in directory.glob("tensors-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return directory / MANIFEST


# -- reading ---------------------------------------------------------------------------------

def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise PersistError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes; not a kvcomm save")
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PersistError(f"{path}: no saved anchors here (manifest missing); save with save_engine first") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PersistError(f"{path}: manifest is not valid JSON ({error}); the save is corrupt, save again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PersistError(f"{path}: not a kvcomm anchor save (format {str(manifest.get('format') if isinstance(manifest, dict) else None)!r})")
    if manifest.get("version") not in READS:
        raise PersistError(f"{path}: format version {manifest.get('version')!r}; this kvcomm reads versions "
                           f"{', '.join(map(str, READS))}")
    return manifest


def _check_fingerprint(manifest: dict, fingerprint: ModelFingerprint, engine: ReuseEngine, where: Path) -> None:
    try:
        saved = ModelFingerprint.from_json(manifest.get("fingerprint"))
    except ValueError as error:
        raise PersistError(f"{where}: bad fingerprint in manifest: {error}") from None
    problems = saved.mismatches(fingerprint)
    if fingerprint.rope != rope_digest(engine.rotary) or saved.rope != rope_digest(engine.rotary):
        problems.append("rope: the target engine's rotary differs from the saved one")
    if problems:
        raise PersistError(
            f"{where}: these anchors were computed by another model ({'; '.join(dict.fromkeys(problems))}); anchors "
            "are only valid for the checkpoint, tokenizer, KV dtype and RoPE that produced them: load them into "
            "that model, or start this one with an empty pool"
        )


def _read_tensors(manifest: dict, directory: Path) -> dict[str, torch.Tensor]:
    info = manifest.get("tensors")
    if not isinstance(info, dict) or not isinstance(info.get("file"), str) or "/" in info["file"] or "\\" in info["file"]:
        raise PersistError(f"{directory}: manifest does not name a tensor file; the save is corrupt")
    path = directory / info["file"]
    if not path.is_file():
        raise PersistError(f"{path}: tensor file missing; the save is incomplete")
    if path.stat().st_size != info.get("bytes"):
        raise PersistError(f"{path}: {path.stat().st_size} bytes, the manifest says {info.get('bytes')} (truncated?)")
    if _sha256(path) != info.get("sha256"):
        raise PersistError(f"{path}: checksum mismatch; the tensor file is corrupt")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for malformed files
        raise PersistError(f"{path}: unreadable safetensors ({type(error).__name__}: {error})") from None


class _Reader:
    """Takes tensors by name from a loaded file, checking shapes and dtypes as it goes."""

    def __init__(self, tensors: dict[str, torch.Tensor], head_dim: int, where: Path, device: torch.device):
        self.tensors, self.head_dim, self.where, self.used = tensors, head_dim, where, set()
        self.device = device
        self.shape: tuple[int, int] | None = None  # (layers, kv_heads), the same for every KV

    def fail(self, message: str):
        raise PersistError(f"{self.where}: {message}; the save is corrupt")

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            self.fail(f"tensor {name!r} is missing")
        self.used.add(name)
        tensor = self.tensors[name]
        if not tensor.is_floating_point():
            self.fail(f"tensor {name!r} has dtype {tensor.dtype}, expected a float dtype")
        return tensor

    def kv(self, name: str, length: int | None = None, layers: int | None = None) -> KV:
        """KV ``name``: ``[layers, kv_heads, length, head_dim]``, layers and heads those of every
        KV read before unless ``layers`` is given (a deviation stored from a later layer)."""
        keys, values = self.tensor(name + ".k"), self.tensor(name + ".v")
        if keys.ndim != 4 or keys.shape != values.shape or keys.dtype != values.dtype or keys.shape[3] != self.head_dim:
            self.fail(f"{name} has keys {tuple(keys.shape)} / values {tuple(values.shape)}, expected equal "
                      f"[layers, kv_heads, T, {self.head_dim}]")
        if self.shape is None:
            self.shape = tuple(keys.shape[:2])
        expected = self.shape if layers is None else (layers, self.shape[1])
        if tuple(keys.shape[:2]) != expected or keys.shape[2] == 0 or (length is not None and keys.shape[2] != length):
            self.fail(f"{name} has shape {tuple(keys.shape)}, inconsistent with the rest of the save")
        return KV(keys.to(self.device), values.to(self.device))

    def embedding(self, name: str) -> np.ndarray:
        tensor = self.tensor(name)
        if tensor.ndim != 1 or tensor.dtype != torch.float32:
            self.fail(f"{name} must be a 1-D float32 vector, got {tuple(tensor.shape)} {tensor.dtype}")
        return tensor.numpy()


def _field(obj: object, key: str, kind: type, where: Path):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PersistError(f"{where}: manifest entry {key!r} must be a {kind.__name__}, got {str(value)[:80]}; the save is corrupt")
    return value


def _build(manifest: dict, tensors: dict[str, torch.Tensor], engine: ReuseEngine, where: Path, device: torch.device):
    read = _Reader(tensors, engine.rotary.head_dim, where, device)
    pools: dict[str, AnchorPool] = {}
    for p, entry in enumerate(_field(manifest, "pools", list, where)):
        slot = _field(entry, "slot", str, where)
        anchors = []
        for a, item in enumerate(_field(entry, "anchors", list, where)):
            name = f"pool{p}.anchor{a}"
            base = read.kv(name + ".base")
            anchor = Anchor(_field(item, "segment_id", str, where), base,  # a base keeps the KV's dtype
                            read.embedding(name + ".embedding"), _field(item, "serial", int, where))
            anchor.accesses = _field(item, "accesses", int, where)
            for d, dev in enumerate(_field(item, "deviations", list, where)):
                first_layer = dev.get("first_layer", 0) if isinstance(dev, dict) else 0  # version 1 stored every layer
                if not isinstance(first_layer, int) or isinstance(first_layer, bool) or not 0 <= first_layer < base.keys.shape[0]:
                    read.fail(f"{name}.dev{d}: first_layer {first_layer!r} is not a layer of its base")
                layers = base.keys.shape[0] - first_layer
                shared = read.kv(f"{name}.dev{d}.shared", base.length, layers)
                following = read.kv(f"{name}.dev{d}.following", layers=layers) if _field(dev, "following", bool, where) else None
                following_base = dev.get("following_base") if isinstance(dev, dict) else None
                if isinstance(dev, dict) and dev.get("context") is True:  # saved with context weighting (removed): not used
                    read.embedding(f"{name}.dev{d}.context")
                deviation = Deviation(shared, following,
                                      following_base if isinstance(following_base, str) else None, first_layer)
                anchor.deviations[(_field(dev, "template", str, where), _field(dev, "slot", str, where))] = deviation
            anchors.append(anchor)
        if slot in pools:
            read.fail(f"slot {slot!r} appears twice")
        pool = AnchorPool(engine.config.pool, engine.heads)
        next_serial, evictions = _field(entry, "next_serial", int, where), _field(entry, "evictions", int, where)
        try:
            pool.restore(anchors, next_serial, evictions)
        except ValueError as error:
            raise PersistError(f"{where}: slot {slot!r}: {error}; raise this engine's limits or prune the save") from None
        for f, item in enumerate(entry.get("fits", []) if isinstance(entry, dict) else []):  # saves before fits had none
            sums = [read.tensor(f"pool{p}.fit{f}.{n}") for n in ("cross", "estimate_sq", "real_sq")]
            layers = read.shape[0] if read.shape is not None else sums[0].shape[-1]
            if any(t.shape != (2, layers) or t.dtype != torch.float64 for t in sums):
                read.fail(f"slot {slot!r}: shrinkage fit {f} has sums {[tuple(t.shape) for t in sums]}, expected float64 [2, {layers}]")
            part = _field(item, "part", str, where)
            if part not in ("shared", "following"):
                read.fail(f"slot {slot!r}: shrinkage fit {f} is for part {part!r}, expected 'shared' or 'following'")
            key = ((_field(item, "template", str, where), _field(item, "slot", str, where)), part)
            pool.fits[key] = ShrinkageFit(*sums, pairs=_field(item, "pairs", int, where))
        pools[slot] = pool
    fixed = {}
    for f, entry in enumerate(_field(manifest, "fixed_bases", list, where)):
        fixed[(_field(entry, "template", str, where), _field(entry, "content", str, where))] = read.kv(f"fixed{f}")
    bases = {}
    for b, entry in enumerate(_field(manifest, "bases", list, where)):
        bases[_field(entry, "shared_id", str, where)] = (read.kv(f"base{b}"), read.embedding(f"base{b}.embedding"))
    extra = set(tensors) - read.used
    if extra:
        read.fail(f"{len(extra)} tensors the manifest does not describe (e.g. {sorted(extra)[0]!r})")
    return pools, fixed, bases


def load_engine(directory: str | os.PathLike, engine: ReuseEngine, fingerprint: ModelFingerprint,
                device: torch.device | str = "cpu") -> LoadSummary:
    """Replace ``engine``'s pools and bases with the save in ``directory``, made by the model
    ``fingerprint`` names (this engine's model), their KV on ``device``: the device the
    engine's model computes its KV on (``cuda:0`` for a model on the first GPU). Raises
    ``PersistError`` (engine unchanged) for another model or a corrupt, truncated or
    incomplete save, and ``ValueError`` for a device torch cannot use here."""
    try:  # an unknown or absent device fails here, before anything is read
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch raises both for devices it cannot use
        raise ValueError(f"cannot restore a kvcomm save onto device {str(device)!r}: {error}; name the device "
                         "the model runs on (cpu, cuda, cuda:N)") from None
    directory = Path(directory)
    manifest = _read_manifest(directory)
    _check_fingerprint(manifest, fingerprint, engine, directory / MANIFEST)
    tensors = _read_tensors(manifest, directory)
    pools, fixed, bases = _build(manifest, tensors, engine, directory / MANIFEST, device)
    with engine._lock:
        engine.pools, engine._fixed_bases, engine._bases = pools, fixed, bases
    size = sum(t.nbytes for t in tensors.values())
    return LoadSummary({slot: len(pool) for slot, pool in pools.items()}, len(bases), len(fixed), size)
