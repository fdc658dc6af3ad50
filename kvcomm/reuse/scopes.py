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
}
"""The presets, each the one some measured workload picks under the rule of docs/decisions.md
(2026-12-06, "The default reuse scope, by a rule written down"): its first-token KL at most
CacheBlend's at its defaults, at least as many replies equal to dense's, and the most token
reuse among the scopes that pass there.

- ``all``: every token with a base: the template's text, the shared inputs, the other agents'
  replies (their producers' decode KV as base). Picked by MMLU.
- ``all-reader-replies``: ``all``, but a reply is computed by its first reader, whose
  computation becomes its base. Picked by retrieval; of the scopes that pass on all four
  workloads the one that reuses most, so the default.
- ``content``: shared content only; the template text after it is computed, replies are served
  from their producer's decode KV. Picked by GSM and HumanEval (long replies).

``reader-replies`` and ``inputs`` (both computing the template text, and each reply once or
at every reader) were deleted on 2026-12-06: they pass the bar where measured but no workload
picks them; docs/measurements/2026-12-05-where-the-error-is.md keeps their figures.
"""

DEFAULT_SCOPE = "all-reader-replies"
"""The scope of every entry point (CLI, connector, benchmarks) when none is named: the one the
rule of docs/decisions.md (2026-12-06) picks. It was ``all`` until then."""


def check_scope(name: str) -> str:
    """``name`` if it names a scope; else ValueError listing the valid ones."""
    if name not in SCOPES:
        raise ValueError(f"unknown reuse scope {name!r}; valid: {', '.join(SCOPES)}")
    return name
