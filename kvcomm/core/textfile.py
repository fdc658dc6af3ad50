"""Reading a user's UTF-8 text and JSON files with errors that say what to fix."""

from __future__ import annotations

import json
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


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_json(text: str, source: str, error: type[Exception] = ValueError) -> object:
    """``json.loads`` that rejects duplicate object keys; every failure raises ``error``
    naming ``source`` and, for syntax errors, the line and column."""

    def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise error(f"duplicate key {_bounded(repr(key[:60]), 60)} in a JSON object; keep only one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys)
    except error as e:
        raise error(f"{source}: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{source}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # e.g. nesting too deep, integer literal too long
        raise error(f"{source}: unreadable JSON ({type(e).__name__}: {_bounded(str(e), 120)})") from None
