"""Reuse scopes: what a plan serves from stored KV, as named presets (``ReuseConfig.scope``).

Where reuse's error is (docs/measurements/2026-12-05-where-the-error-is.md): hardly in the
estimated inputs, mostly in the template text after the shared content and in replies served
from their producer's decode KV. A scope says which of those a plan computes instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scope:
    """What a plan computes rather than serves.

    decode_reply_bases: a reply's base is the KV its producer decoded it with; False: a reply
        is content like any other, its base taken from the first reader that computes it.
    bases_after_estimates: new content's base is the KV of the first request that computes it,
        even behind estimated content (nothing else is learned from such a request); with
        ``decode_reply_bases`` False this lets a reply's second reader reuse it.
    compute_trailing_text: reuse ends with the last shared segment a plan reuses; the template
        text after it (the instructions the reply follows) is computed, not served.
    """

    decode_reply_bases: bool = True
    bases_after_estimates: bool = False
    compute_trailing_text: bool = False


SCOPES: dict[str, Scope] = {
    "all": Scope(),
    "all-reader-replies": Scope(decode_reply_bases=False, bases_after_estimates=True),
    "content": Scope(compute_trailing_text=True),
    "reader-replies": Scope(decode_reply_bases=False, bases_after_estimates=True, compute_trailing_text=True),
    "inputs": Scope(decode_reply_bases=False, compute_trailing_text=True),
}
"""The presets, roughly from the most reuse to the closest to dense:

- ``all``: every token with a base: the template's text, the shared inputs, the other agents'
  replies (their producers' decode KV as base).
- ``all-reader-replies``: ``all``, but a reply is computed by its first reader, whose
  computation becomes its base.
- ``content``: shared content only; the template text after it is computed.
- ``reader-replies``: ``content`` with ``all-reader-replies``' reply bases.
- ``inputs``: ``content``, and each reply computed by its readers until one computes it
  cleanly: the workload's own inputs are what is reused.
"""

DEFAULT_SCOPE = "all"
"""The scope of every entry point (CLI, connector, benchmarks) when none is named."""


def check_scope(name: str) -> str:
    """``name`` if it names a scope; else ValueError listing the valid ones."""
    if name not in SCOPES:
        raise ValueError(f"unknown reuse scope {name!r}; valid: {', '.join(SCOPES)}")
    return name
