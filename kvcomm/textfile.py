"""Reading a user's UTF-8 text file with errors that say what to fix."""

from __future__ import annotations

import os


def read_utf8(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> str:
    """The text of ``path`` (a leading BOM is dropped); ``what`` names the file in messages
    ("pipeline file", "workload file"). Every failure raises ``error`` with the path."""
    source = os.fspath(path)
    if os.path.isdir(source):
        raise error(f"{source}: is a directory; give the path of a {what}")
    try:
        with open(source, encoding="utf-8-sig") as fh:
            return fh.read()
    except FileNotFoundError:
        raise error(f"{source}: {what} not found; check the path") from None
    except UnicodeDecodeError as e:
        raise error(f"{source}: not valid UTF-8 (byte offset {e.start}); re-save the {what} as UTF-8") from None
    except OSError as e:
        raise error(f"{source}: cannot read the {what} ({e.strerror or e})") from None
