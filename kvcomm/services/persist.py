"""Save and load an engine's anchor pools and the bases they need, so a restarted server
does not start cold.

A save (format version 3) is a directory holding ``manifest.json`` and one file per stored
object, ``obj-<sha256 of the file>.safetensors``: an anchor's base KV with its embedding, one
deviation, a fixed-segment base, a shared-content base with its embedding, and one small file
of the pools' shrinkage-fit sums. The manifest holds the small mutable state (serials, access
counts, eviction counts, fit pair counts, each slot's estimate-or-realign evidence, which
deviation belongs to which anchor and slot) and names every object file with its size; a file's name is its checksum. Objects are
immutable: nothing in kvcomm changes a stored base or deviation in place (an anchor's new
deviation for a slot is a new object; eviction drops objects), so a save writes only the
objects that are not on disk yet, and a tenant that learned one anchor writes about that
anchor's bytes. "On disk" is known by identity: the tensors this process wrote (or loaded)
for an object are the ones it holds, their version counters unchanged (a tensor changed in
place, through any view, counts as new), and the folder's manifest is still the one this
process committed (else everything is written again).

Every file is written atomically (temp file in the same directory, fsync, rename; the folder
fsynced once after the objects); the manifest, written last, is the commit point, so a crash
at any moment leaves the previous save loadable. Files the committed manifest does not name
(objects of evicted anchors, a version 1/2 tensor file) are removed only after it is durable;
temp files of a killed save are removed before the next save and by ``tidy``. One writer per
directory.

Loading checks everything before touching the engine: format, the model fingerprint (and
the engine's own RoPE against it), each object file's size and checksum, every tensor's
presence, shape and dtype, that every file holds nothing the manifest does not describe, and
the pools' invariants. Any failure raises ``PersistError`` naming the file and leaves the
engine as it was; on success pools, shared-content bases and fixed-segment bases are replaced
together, under the engine's lock. Objects named twice (an anchor's base that is also the
engine's base of its content) are loaded once and shared, as they were when saved. Versions 1
and 2 (one ``tensors-<sha256>.safetensors`` for everything) still load; the next save writes
version 3 and removes the old file. The exact prefix store is not saved.

Restored KV (bases, deviations, fixed bases) goes to the device the loader names, which must
be the one the engine's model hands it KV on: the engine works where its KV lives, so a GPU
engine given host-memory anchors would mix devices in its next estimate. Shrinkage sums
stay in host memory, as the engine keeps them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save as serialize

from kvcomm.anchors.anchor import Anchor, Deviation
from kvcomm.anchors.evidence import Evidence
from kvcomm.anchors.pool import AnchorPool
from kvcomm.anchors.shrinkage import ShrinkageFit
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.core.fingerprint import ModelFingerprint, rope_digest
from kvcomm.core.kv import KV
from kvcomm.services.state_files import fsync_dir, remove_temp_files, temp_path, write_text_atomically

__all__ = ["FORMAT", "VERSION", "READS", "MANIFEST", "PersistError", "LoadSummary", "SaveSummary", "save_engine",
           "load_engine", "last_save", "object_refs", "tidy", "write_text_atomically"]

FORMAT = "kvcomm-anchors"
VERSION = 3
READS = (1, 2, 3)
"""Versions this kvcomm loads: 1 stored every layer of a deviation in one tensor file, 2 says
where each starts, 3 stores one file per object."""
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
OBJECT_FILE = re.compile(r"obj-([0-9a-f]{64})\.safetensors")
LEGACY_FILE = re.compile(r"tensors-[0-9a-f]{32}\.safetensors")


class PersistError(ValueError):
    """A save that cannot be loaded here: another model, or a corrupt / truncated file."""


@dataclass(frozen=True)
class LoadSummary:
    pools: dict[str, int]  # slot -> anchors
    bases: int
    fixed_bases: int
    bytes: int


@dataclass(frozen=True)
class SaveSummary:
    """What one save did: object files written and their bytes, object files already on disk
    and reused, and the bytes of every file the manifest names (the save's size)."""

    written: int
    written_bytes: int
    reused: int
    total_bytes: int


# -- what a directory holds already ----------------------------------------------------------

def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place-change counter (shared by its views). Inference tensors (made under
    ``torch.inference_mode``) have none and can only change inside inference mode, which no
    kvcomm code does to a stored tensor: -1."""
    return -1 if tensor.is_inference() else tensor._version


@dataclass(eq=False)
class _Object:
    """One stored object: its tensors as the engine holds them (no copy) and the bytes of
    what identity does not cover (an embedding). ``ref`` ({"file", "bytes"}) once on disk."""

    tensors: dict[str, torch.Tensor]
    embedding: np.ndarray | None = None
    versions: tuple[int, ...] = ()
    ref: dict | None = None

    def __post_init__(self) -> None:
        self.versions = tuple(_version(t) for t in self.tensors.values())

    @property
    def key(self) -> tuple:
        extra = None if self.embedding is None else self.embedding.tobytes()
        return tuple((name, id(t)) for name, t in self.tensors.items()) + (extra,)

    def payload(self) -> dict[str, torch.Tensor]:
        out = {name: t.contiguous() for name, t in self.tensors.items()}
        if self.embedding is not None:
            out["embedding"] = torch.from_numpy(self.embedding.copy())
        return out

    def changed(self) -> bool:
        return tuple(_version(t) for t in self.tensors.values()) != self.versions


@dataclass
class _Held:
    """An object on disk: weak references to the tensors it was written from, their versions then."""

    refs: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    ref: dict

    def matches(self, obj: _Object) -> bool:
        return (len(self.refs) == len(obj.tensors) and all(r() is t for r, t in zip(self.refs, obj.tensors.values()))
                and self.versions == obj.versions)


@dataclass
class _Disk:
    """What one directory holds for one engine: the identity (``os.stat``) of the manifest this
    process committed or loaded, and the objects it names."""

    manifest: tuple | None = None
    objects: dict[tuple, _Held] = field(default_factory=dict)
    last: SaveSummary | None = None


_DISKS: "weakref.WeakKeyDictionary[ReuseEngine, dict[Path, _Disk]]" = weakref.WeakKeyDictionary()
_DISKS_LOCK = threading.Lock()


def _identity(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _disk(engine: ReuseEngine, directory: Path) -> _Disk:
    """What ``directory`` holds for ``engine``; emptied when its manifest is not the one this
    process last committed or loaded there (another writer, a folder moved aside)."""
    with _DISKS_LOCK:
        disks = _DISKS.setdefault(engine, {})
        disk = disks.setdefault(directory, _Disk())
    if disk.manifest is None or disk.manifest != _identity(directory / MANIFEST):
        disk.manifest, disk.objects = None, {}
    return disk


def _remember(disk: _Disk, directory: Path, objects: list[_Object]) -> None:
    disk.objects = {obj.key: _Held(tuple(weakref.ref(t) for t in obj.tensors.values()), obj.versions, obj.ref)
                    for obj in objects if obj.tensors}
    disk.manifest = _identity(directory / MANIFEST)


# -- writing ---------------------------------------------------------------------------------

def _kv(kv: KV, embedding: np.ndarray | None = None) -> _Object:
    return _Object({"kv.k": kv.keys, "kv.v": kv.values},
                   None if embedding is None else np.array(embedding, dtype=np.float32))


def _deviation(deviation: Deviation) -> _Object:
    tensors = {"shared.k": deviation.shared.keys, "shared.v": deviation.shared.values}
    if deviation.following is not None:
        tensors.update({"following.k": deviation.following.keys, "following.v": deviation.following.values})
    return _Object(tensors)


def _snapshot(engine: ReuseEngine) -> tuple[dict, list[_Object]]:
    """The manifest body of ``engine``'s pools and bases, its objects in place of file refs,
    taken under the engine's lock (no KV is copied: stored KV never changes in place; the
    fit sums, which do, are copied)."""
    objects: list[_Object] = []

    def add(obj: _Object) -> _Object:
        objects.append(obj)
        return obj

    pools, fixed, bases, fit_sums = [], [], [], {}
    with engine._lock:
        for p, (slot, pool) in enumerate(sorted(engine.pools.items())):
            anchors = []
            for anchor in pool.anchors:
                deviations = [{"template": template, "slot": slot_name, "following": deviation.following is not None,
                               "following_base": deviation.following_base, "first_layer": deviation.first_layer,
                               "file": add(_deviation(deviation))}
                              for (template, slot_name), deviation in anchor.deviations.items()]
                anchors.append({"segment_id": anchor.segment_id, "serial": anchor.serial, "accesses": anchor.accesses,
                                "base": add(_kv(anchor.base, anchor.embedding)), "deviations": deviations})
            fits = []
            for f, (((template, slot_name), part), fit) in enumerate(sorted(pool.fits.items())):
                for field_name in ("cross", "estimate_sq", "real_sq"):
                    fit_sums[f"pool{p}.fit{f}.{field_name}"] = getattr(fit, field_name).clone()
                fits.append({"template": template, "slot": slot_name, "part": part, "pairs": fit.pairs})
            evidence = [{"template": template, "slot": slot_name, "part": part, "estimate_sq": list(e.estimate_sq),
                         "realign_sq": list(e.realign_sq), "pairs": e.pairs}
                        for ((template, slot_name), part), e in sorted(pool.evidence.items())]
            pools.append({"slot": slot, "next_serial": pool.next_serial, "evictions": pool.evictions, "anchors": anchors,
                          "fits": fits, "evidence": evidence})
        for (template, content), kv in engine._fixed_bases.items():
            fixed.append({"template": template, "content": content, "file": add(_kv(kv))})
        for shared_id, (kv, embedding) in engine._bases.items():
            bases.append({"shared_id": shared_id, "file": add(_kv(kv, embedding))})
    # the fit sums change in place, so they are copies: a new object at every save, written
    # only when its bytes (so its name) differ from a file on disk
    fits_file = add(_Object(fit_sums)) if fit_sums else None
    return {"pools": pools, "fixed_bases": fixed, "bases": bases, "fits_file": fits_file}, objects


def _write_object(path: Path, data: bytes) -> Path:
    """``data`` to a new temp file beside ``path``; returns it (``_commit_objects`` makes it ``path``)."""
    tmp = temp_path(path.parent, ".safetensors")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
    except BaseException:  # disk full: the save fails and leaves nothing of its own
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _commit_objects(pending: list[tuple[Path, Path]]) -> None:
    """fsync every temp file (in parallel: the file system commits them together, where one at a
    time costs a journal commit each), then rename each over its final name. The folder's fsync
    after makes the renames durable."""
    if not pending:
        return

    def sync(tmp: Path) -> None:
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())

    try:
        with ThreadPoolExecutor(min(16, len(pending))) as pool:
            list(pool.map(sync, [tmp for tmp, _ in pending]))
    except RuntimeError:  # no new threads while the interpreter exits (the save at exit): one at a time
        for tmp, _ in pending:
            sync(tmp)
    for tmp, final in pending:
        os.replace(tmp, final)


def save_engine(engine: ReuseEngine, directory: str | os.PathLike, fingerprint: ModelFingerprint) -> Path:
    """Save ``engine``'s anchor pools, shared-content bases and fixed-segment bases under
    ``directory`` (created if missing, mode 0700) for the model ``fingerprint`` names, writing
    only the objects not on disk there yet. Returns the manifest path; ``last_save(engine,
    directory)`` says what was written."""
    if fingerprint.rope != rope_digest(engine.rotary):
        raise PersistError("the fingerprint's RoPE does not match the engine's rotary: pass this model's fingerprint")
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # private whatever the umask: a save holds KV computed from user content
    remove_temp_files(directory)
    key = directory.resolve()
    disk = _disk(engine, key)
    body, objects = _snapshot(engine)
    present = _object_files(directory)
    new_files: list[Path] = []
    pending: list[tuple[Path, Path]] = []  # (temp file, object file)
    before = _identity(directory / MANIFEST)
    try:
        written, written_bytes, reused = _write_objects(directory, objects, disk, present, new_files, pending)
        _commit_objects(pending)
        fsync_dir(directory)  # every object's rename is durable before the manifest names it
        config = engine.config
        manifest = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint.to_json(),
                    "config": {"mode": config.mode, "scope": config.scope, "pool": asdict(config.pool)}, **body}
        text = json.dumps(manifest, indent=1, sort_keys=True, default=lambda obj: obj.ref)
        write_text_atomically(directory / MANIFEST, text)
    except BaseException:  # a failed save (disk full, a signal) leaves the folder as it was, if its manifest is
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        if _identity(directory / MANIFEST) == before:
            for path in new_files:
                path.unlink(missing_ok=True)
        raise
    _remember(disk, key, objects)
    named = {obj.ref["file"] for obj in objects}
    _remove_unnamed(directory, named)  # after the manifest is durable
    total = sum(present[name] for name in named)
    disk.last = SaveSummary(written, written_bytes, reused, total + len(text.encode("utf-8")))
    return directory / MANIFEST


def _write_objects(directory: Path, objects: list[_Object], disk: _Disk, present: dict[str, int],
                   new_files: list[Path], pending: list[tuple[Path, Path]]) -> tuple[int, int, int]:
    """Give every object its file ref, writing the files not on disk yet to temp files (appended
    to ``pending`` with their final names; those new to the folder to ``new_files``); returns
    (files written, their bytes, objects reused)."""
    committed = {held.ref["file"] for held in disk.objects.values()}  # checked on load or written by this process
    unique: dict[tuple, _Object] = {}
    written = written_bytes = reused = 0
    for obj in objects:
        twin = unique.get(obj.key) if obj.tensors else None
        if twin is not None:  # the same tensors named twice (an anchor's base that is also the engine's)
            obj.ref = twin.ref
            continue
        held = disk.objects.get(obj.key)
        if held is not None and held.matches(obj) and present.get(held.ref["file"]) == held.ref["bytes"]:
            obj.ref = held.ref
            reused += 1
        else:
            data = serialize(obj.payload())
            if obj.changed():
                raise PersistError(f"{directory}: a stored tensor changed in place while it was being saved; "
                                   "nothing was committed, the previous save stands")
            name = f"obj-{hashlib.sha256(data).hexdigest()}.safetensors"
            obj.ref = {"file": name, "bytes": len(data)}
            if present.get(name) != len(data) or name not in committed:
                if name not in present:  # a file of that name holds those bytes (or was torn): kept on failure
                    new_files.append(directory / name)
                pending.append((_write_object(directory / name, data), directory / name))
                present[name] = len(data)
                written += 1
                written_bytes += len(data)
            else:
                reused += 1
        unique[obj.key] = obj
    return written, written_bytes, reused


def last_save(engine: ReuseEngine, directory: str | os.PathLike) -> SaveSummary | None:
    """What the last ``save_engine(engine, directory)`` of this process did (None: none)."""
    with _DISKS_LOCK:
        disk = _DISKS.get(engine, {}).get(Path(directory).resolve())
    return None if disk is None else disk.last


def _object_files(directory: Path) -> dict[str, int]:
    """Object files in ``directory`` and their sizes."""
    found = {}
    for path in directory.iterdir():
        if OBJECT_FILE.fullmatch(path.name):
            try:
                found[path.name] = path.stat().st_size
            except FileNotFoundError:
                pass
    return found


def tidy(directory: str | os.PathLike) -> list[Path]:
    """Remove from a save's ``directory`` the temp files of a killed save and, when its manifest
    reads, the object and tensor files it does not name (written by a save killed before its
    commit). Returns what was removed. One writer per directory: call it where nothing else
    writes there (at start-up; ``save_engine`` does it as it goes)."""
    directory = Path(directory)
    removed = list(remove_temp_files(directory))
    try:
        manifest = _read_manifest(directory)
    except PersistError:
        return removed  # nothing known to be live: leave the files for whoever looks at the save
    return removed + _remove_unnamed(directory, set(_named_files(manifest)))


def _remove_unnamed(directory: Path, named: set[str]) -> list[Path]:
    """Delete the object and version 1/2 tensor files of ``directory`` not in ``named``."""
    removed = []
    for path in directory.iterdir():
        if (OBJECT_FILE.fullmatch(path.name) or LEGACY_FILE.fullmatch(path.name)) and path.name not in named:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def object_refs(manifest: dict) -> list[dict]:
    """Every object file reference (``{"file": name, "bytes": size}``) a version 3 ``manifest``
    names, in manifest order (an object named twice appears twice; malformed entries skipped)."""
    refs = []

    def walk(obj) -> None:
        if isinstance(obj, dict):
            if isinstance(obj.get("file"), str) and "bytes" in obj:
                refs.append(obj)
            for value in obj.values():
                walk(value)
        elif isinstance(obj, list):
            for value in obj:
                walk(value)
    walk({k: v for k, v in manifest.items() if k != "fingerprint"})
    return refs


def _named_files(manifest: dict) -> list[str]:
    """Every file name ``manifest`` refers to (any version; malformed entries skipped)."""
    if manifest.get("version") in (1, 2):
        info = manifest.get("tensors")
        return [info["file"]] if isinstance(info, dict) and isinstance(info.get("file"), str) else []
    return [ref["file"] for ref in object_refs(manifest)]


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_legacy_tensors(manifest: dict, directory: Path) -> dict[str, torch.Tensor]:
    """Versions 1 and 2: every tensor in one file the manifest names with its size and checksum."""
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
    """Takes tensors by name, checking shapes and dtypes as it goes. Version 1/2 names are those
    of the one tensor file; version 3 names are ``<object file>:<tensor>``, each object file read
    (size, checksum, format) the first time one of its tensors is asked for."""

    def __init__(self, tensors: dict[str, torch.Tensor], head_dim: int, where: Path, device: torch.device,
                 directory: Path | None = None):
        self.tensors, self.head_dim, self.where, self.used = tensors, head_dim, where, set()
        self.device, self.directory = device, directory
        self.sizes: dict[str, int] = {}  # object file -> bytes, as read
        self.shape: tuple[int, int] | None = None  # (layers, kv_heads), the same for every KV
        self._kvs: dict[str, KV] = {}

    def fail(self, message: str):
        raise PersistError(f"{self.where}: {message}; the save is corrupt")

    def ref(self, entry: object, key: str) -> str:
        """Version 3: the object file ``entry[key]`` names (``{"file", "bytes"}``), read now; its name + ":"."""
        ref = entry.get(key) if isinstance(entry, dict) else None
        name, size = (ref.get("file"), ref.get("bytes")) if isinstance(ref, dict) else (None, None)
        if not isinstance(name, str) or not OBJECT_FILE.fullmatch(name) or not isinstance(size, int) or isinstance(size, bool):
            self.fail(f"manifest entry {key!r} must name an object file and its size, got {str(ref)[:120]}")
        if name in self.sizes:
            if self.sizes[name] != size:
                self.fail(f"{name} is named with {size} and {self.sizes[name]} bytes")
            return name + ":"
        path = self.directory / name
        try:
            actual = path.stat().st_size
            if actual != size:
                raise PersistError(f"{path}: {actual} bytes, the manifest says {size} (truncated?)")
            if _sha256(path) != OBJECT_FILE.fullmatch(name).group(1):
                raise PersistError(f"{path}: checksum mismatch; the object file is corrupt")
        except FileNotFoundError:
            raise PersistError(f"{path}: object file missing; the save is incomplete") from None
        except OSError as error:
            raise PersistError(f"{path}: unreadable ({error})") from None
        try:
            loaded = load_file(str(path))
        except Exception as error:  # safetensors raises its own error types for malformed files
            raise PersistError(f"{path}: unreadable safetensors ({type(error).__name__}: {error})") from None
        self.sizes[name] = size
        self.tensors.update({f"{name}:{tensor}": value for tensor, value in loaded.items()})
        return name + ":"

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
        KV read before unless ``layers`` is given (a deviation stored from a later layer). The
        same name twice gives the same KV (one object named twice stays one)."""
        keys, values = self.tensor(name + ".k"), self.tensor(name + ".v")
        if keys.ndim != 4 or keys.shape != values.shape or keys.dtype != values.dtype or keys.shape[3] != self.head_dim:
            self.fail(f"{name} has keys {tuple(keys.shape)} / values {tuple(values.shape)}, expected equal "
                      f"[layers, kv_heads, T, {self.head_dim}]")
        if self.shape is None:
            self.shape = tuple(keys.shape[:2])
        expected = self.shape if layers is None else (layers, self.shape[1])
        if tuple(keys.shape[:2]) != expected or keys.shape[2] == 0 or (length is not None and keys.shape[2] != length):
            self.fail(f"{name} has shape {tuple(keys.shape)}, inconsistent with the rest of the save")
        if name not in self._kvs:
            self._kvs[name] = KV(keys.to(self.device), values.to(self.device))
        return self._kvs[name]

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


def _build(manifest: dict, read: _Reader, engine: ReuseEngine, where: Path):
    """Pools, fixed bases and bases from ``manifest``; tensors by version 1/2 names (one file)
    or from the object files it names (version 3)."""
    objects = manifest.get("version") == 3
    fits_prefix = read.ref(manifest, "fits_file") if objects and manifest.get("fits_file") is not None else ""
    pools: dict[str, AnchorPool] = {}
    for p, entry in enumerate(_field(manifest, "pools", list, where)):
        slot = _field(entry, "slot", str, where)
        anchors = []
        for a, item in enumerate(_field(entry, "anchors", list, where)):
            name = f"pool{p}.anchor{a}"
            base_kv, embedding = ((read.ref(item, "base") + "kv", read.ref(item, "base") + "embedding") if objects
                                  else (name + ".base", name + ".embedding"))
            base = read.kv(base_kv)
            anchor = Anchor(_field(item, "segment_id", str, where), base,  # a base keeps the KV's dtype
                            read.embedding(embedding), _field(item, "serial", int, where))
            anchor.accesses = _field(item, "accesses", int, where)
            for d, dev in enumerate(_field(item, "deviations", list, where)):
                first_layer = dev.get("first_layer", 0) if isinstance(dev, dict) else 0  # version 1 stored every layer
                if not isinstance(first_layer, int) or isinstance(first_layer, bool) or not 0 <= first_layer < base.keys.shape[0]:
                    read.fail(f"{name}.dev{d}: first_layer {first_layer!r} is not a layer of its base")
                layers = base.keys.shape[0] - first_layer
                prefix = read.ref(dev, "file") if objects else f"{name}.dev{d}."
                shared = read.kv(prefix + "shared", base.length, layers)
                following = read.kv(prefix + "following", layers=layers) if _field(dev, "following", bool, where) else None
                following_base = dev.get("following_base") if isinstance(dev, dict) else None
                if isinstance(dev, dict) and dev.get("context") is True and not objects:  # saved with context weighting (removed): not used
                    read.embedding(f"{name}.dev{d}.context")
                deviation = Deviation(shared, following,
                                      following_base if isinstance(following_base, str) else None, first_layer)
                anchor.deviations[(_field(dev, "template", str, where), _field(dev, "slot", str, where))] = deviation
            anchors.append(anchor)
        if slot in pools:
            read.fail(f"slot {slot!r} appears twice")
        pool = AnchorPool(engine.config.pool, engine.head_shards)
        next_serial, evictions = _field(entry, "next_serial", int, where), _field(entry, "evictions", int, where)
        try:
            pool.restore(anchors, next_serial, evictions)
        except ValueError as error:
            raise PersistError(f"{where}: slot {slot!r}: {error}; raise this engine's limits or prune the save") from None
        for f, item in enumerate(_field(entry, "fits", list, where) if "fits" in entry else []):  # saves before fits had none
            sums = [read.tensor(f"{fits_prefix}pool{p}.fit{f}.{n}") for n in ("cross", "estimate_sq", "real_sq")]
            layers = read.shape[0] if read.shape is not None else sums[0].shape[-1]
            if any(t.shape != (2, layers) or t.dtype != torch.float64 for t in sums):
                read.fail(f"slot {slot!r}: shrinkage fit {f} has sums {[tuple(t.shape) for t in sums]}, expected float64 [2, {layers}]")
            part = _field(item, "part", str, where)
            if part not in ("shared", "following"):
                read.fail(f"slot {slot!r}: shrinkage fit {f} is for part {part!r}, expected 'shared' or 'following'")
            key = ((_field(item, "template", str, where), _field(item, "slot", str, where)), part)
            pool.fits[key] = ShrinkageFit(*sums, pairs=_field(item, "pairs", int, where))
        for item in _field(entry, "evidence", list, where) if "evidence" in entry else []:  # saves before the rule had none
            key = ((_field(item, "template", str, where), _field(item, "slot", str, where)), _field(item, "part", str, where))
            sums = [_field(item, n, list, where) for n in ("estimate_sq", "realign_sq")]
            pairs = _field(item, "pairs", int, where)
            if key[1] not in ("shared", "following") or pairs < 0 or any(
                    len(row) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                             and x >= 0 for x in row) for row in sums):
                read.fail(f"slot {slot!r}: evidence {key} is not a pair count and two [keys, values] sums of squares "
                          "for part 'shared' or 'following'")
            pool.evidence[key] = Evidence([float(x) for x in sums[0]], [float(x) for x in sums[1]], pairs)
        pools[slot] = pool
    fixed = {}
    for f, entry in enumerate(_field(manifest, "fixed_bases", list, where)):
        fixed[(_field(entry, "template", str, where), _field(entry, "content", str, where))] = read.kv(
            read.ref(entry, "file") + "kv" if objects else f"fixed{f}")
    bases = {}
    for b, entry in enumerate(_field(manifest, "bases", list, where)):
        prefix = read.ref(entry, "file") if objects else f"base{b}."
        bases[_field(entry, "shared_id", str, where)] = (read.kv(prefix + "kv" if objects else f"base{b}"),
                                                         read.embedding(prefix + "embedding"))
    extra = set(read.tensors) - read.used
    if extra:
        read.fail(f"{len(extra)} tensors the manifest does not describe (e.g. {sorted(extra)[0]!r})")
    return pools, fixed, bases


def _loaded_objects(manifest: dict, pools: dict[str, AnchorPool], fixed: dict, bases: dict) -> list[_Object]:
    """The objects a version 3 load put in the engine, with the refs of the files they came from
    (so the next save of the folder writes only what is new)."""
    objects = []
    for entry in manifest["pools"]:
        pool = pools[entry["slot"]]
        for item, anchor in zip(entry["anchors"], pool.anchors):
            objects.append(_kv(anchor.base, anchor.embedding))
            objects[-1].ref = item["base"]
            for dev in item["deviations"]:
                objects.append(_deviation(anchor.deviations[(dev["template"], dev["slot"])]))
                objects[-1].ref = dev["file"]
    if manifest.get("fits_file") is not None:  # its name tells the next save whether the sums changed
        sums = {f"pool{p}.fit{f}.{n}": getattr(fit, n) for p, entry in enumerate(manifest["pools"])
                for f, fit in enumerate(pools[entry["slot"]].fits.values()) for n in ("cross", "estimate_sq", "real_sq")}
        objects.append(_Object(sums, ref=manifest["fits_file"]))
    for entry in manifest["fixed_bases"]:
        objects.append(_kv(fixed[(entry["template"], entry["content"])]))
        objects[-1].ref = entry["file"]
    for entry in manifest["bases"]:
        objects.append(_kv(*bases[entry["shared_id"]]))
        objects[-1].ref = entry["file"]
    return objects


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
    objects = manifest.get("version") == 3
    tensors = {} if objects else _read_legacy_tensors(manifest, directory)
    read = _Reader(tensors, engine.rotary.head_dim, directory / MANIFEST, device, directory)
    pools, fixed, bases = _build(manifest, read, engine, directory / MANIFEST)
    with engine._lock:
        engine.pools, engine._fixed_bases, engine._bases = pools, fixed, bases
    if objects:
        key = directory.resolve()
        disk = _disk(engine, key)
        _remember(disk, key, _loaded_objects(manifest, pools, fixed, bases))
    size = sum(t.nbytes for t in {id(t): t for t in read.tensors.values()}.values())
    return LoadSummary({slot: len(pool) for slot, pool in pools.items()}, len(bases), len(fixed), size)
