"""Files of kvcomm's saved state: written atomically, temp files of killed writes removed,
unreadable files moved aside.

Every file is written to a temp file beside it (``.kvcomm-*``), fsynced, renamed over its
name, and the folder fsynced: a crash leaves the old file or the new one, plus at worst a temp
file, which ``remove_temp_files`` deletes (at start-up, and before each save of a folder).
One writer per folder.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

TEMP_PREFIX = ".kvcomm-"
TEMP_GLOBS = (TEMP_PREFIX + "*", ".tmp*")
"""Temp files of a write that never finished: kvcomm's own, and safetensors' ``.tmp*`` beside
the file it writes (a save killed mid-write left them behind)."""


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(directory: Path, suffix: str) -> Path:
    """A new empty temp file in ``directory`` (removed by ``remove_temp_files`` if left behind)."""
    fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=suffix, dir=directory)
    os.close(fd)
    return Path(name)


def commit(tmp: Path, final: Path, sync_dir: bool = True) -> None:
    """fsync ``tmp``, rename it over ``final``; fsync the folder unless the caller does it once
    for many files (``sync_dir=False``: the rename is durable only after ``fsync_dir``)."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    if sync_dir:
        fsync_dir(final.parent)


def write_bytes_atomically(path: Path, data: bytes, sync_dir: bool = True) -> None:
    """``data`` to ``path`` through a temp file beside it (see ``commit`` for ``sync_dir``)."""
    tmp = temp_path(path.parent, path.suffix or ".bin")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        commit(tmp, path, sync_dir)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` the way saves write their files: a temp file beside
    it, fsync, rename over ``path``, fsync of the folder. A crash leaves the old file or the new."""
    write_bytes_atomically(path, text.encode("utf-8"))


def remove_temp_files(directory: Path) -> dict[Path, int]:
    """Delete the temp files a killed write left in ``directory`` (plain files matching
    ``TEMP_GLOBS``; nothing else, no subfolder); returns them with their sizes in bytes. Only
    while no write to the folder is in flight (one writer per folder: at its start, or before
    its next write)."""
    removed = {}
    for pattern in TEMP_GLOBS:
        for stale in directory.glob(pattern):
            if stale.is_file() and not stale.is_symlink():
                try:
                    removed[stale] = stale.stat().st_size
                    stale.unlink()
                except FileNotFoundError:
                    removed.pop(stale, None)
    return removed


def move_aside(path: Path, label: str = "unreadable") -> Path:
    """Rename ``path`` (a file or folder that cannot be used) to ``<name>.<label>-<UTC time>``
    beside it, never over anything (``~N`` added); returns the new path. OSError if it cannot."""
    aside = path.with_name(f"{path.name}.{label}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    stem = aside.name
    for n in range(1, 1000):
        if not aside.exists():
            break
        aside = aside.with_name(f"{stem}~{n}")
    path.rename(aside)
    return aside
