"""Bounds on a request body before anything parses or pickles it (``read_body``).

vLLM's engine core pickles what it is given, recursively: a body nested ~900 deep inside
``kv_transfer_params`` killed the engine core with ``RecursionError`` and the whole server
exited (with or without kvcomm's options). So `kvcomm serve` parses every body it reads once,
with bounds, and refuses what is over them with a 4xx before vLLM sees it:

- size: at most ``MAX_BODY_BYTES`` (413), checked by the middleware as it reads the body, so
  nothing larger is ever buffered;
- nesting: at most ``MAX_DEPTH`` levels of arrays and objects (400), counted without recursion;
- numbers: integers within 64 bits (``INT_BOUND``, and at most ``MAX_INT_DIGITS`` digits before
  one is even converted), floats finite, no ``NaN`` / ``Infinity`` literals (400).

A body that is not JSON (a multipart upload) is passed on unread; vLLM answers it as usual.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_BODY_BYTES = 64 << 20
"""Bytes of one request body at most: far above a 128k-token prompt as text or token ids."""
MAX_DEPTH = 64
"""Levels of nested arrays and objects at most: a chat request with tools whose JSON schemas nest
20 levels uses under 50; vLLM's engine core fails near 900."""
INT_BOUND = 1 << 63
"""Integers lie in ``[-INT_BOUND, INT_BOUND)``: what vLLM and numpy hold as int64."""
MAX_INT_DIGITS = 20


class BodyError(ValueError):
    """A body over the bounds; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


NOT_JSON = object()
"""``read_body``'s answer for a body that is not JSON (passed on unread)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS or not -INT_BOUND <= (value := int(text)) < INT_BOUND:
        raise BodyError(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range; integers in a "
                        "request are 64-bit")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"the number {text[:24]} is out of range for a 64-bit float")
    return value


def _constant(name: str) -> float:
    raise BodyError(f"{name} is not a JSON number; send a finite number")


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)


def depth(value: Any) -> int:
    """Levels of nested lists and dicts in ``value`` (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def read_body(raw: bytes) -> Any:
    """The parsed JSON body (``raw``: at most ``MAX_BODY_BYTES``, read so by the middleware)
    within the depth and number bounds (module docstring), or ``NOT_JSON``; raises
    ``BodyError`` (with its status) for a body over them."""
    try:
        body = _DECODER.decode(raw.decode("utf-8"))
    except RecursionError:
        raise BodyError(f"the request body nests arrays or objects more than {MAX_DEPTH} levels deep") from None
    except BodyError:
        raise
    except ValueError:  # not UTF-8, not JSON: not ours to judge
        return NOT_JSON
    if depth(body) > MAX_DEPTH:
        raise BodyError(f"the request body nests arrays or objects more than {MAX_DEPTH} levels deep")
    return body
