"""One call's provenance in plain words: what was reused, what was computed, and why.

``explain`` turns a ``Provenance`` (token counts by source plus the plan's note) into the one
line a user reads in `kvcomm run`'s table, its ``--json``, the chat clients' call log and
their summaries, e.g.::

    reused 996 of 1,204 tokens (exact 92, estimated 904); computed 208: 34 new text before
    the reused content, 174 from token 1,030 because slot 'notes' is warming up (1 of 2 anchors)

The plan's notes are short technical sentences written where reuse stops
(``kvcomm.reuse.strategies``, ``ReuseEngine.plan``, the server); ``because`` rewrites each
kind in words a user can act on, and passes an unknown note through unchanged, so nothing
a plan says is lost.
"""

from __future__ import annotations

import re

_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), w) for p, w in (
    (r"^slot '(?P<slot>.+)' not shareable \((?P<have>\d+) compatible anchors, (?P<need>\d+) needed\): new anchor$",
     "slot '{slot}' is warming up ({have} of {need} anchors needed to estimate it); this call becomes one"),
    (r"^slot '(?P<slot>.+)' not shareable \((?P<why>.+)\): new anchor$",
     "slot '{slot}' cannot be estimated ({why}); this call becomes an anchor of it"),
    (r"^slot '(?P<slot>.+)': (?P<covered>\d+) of (?P<n>\d+) tokens covered by anchors$",
     "the anchors of slot '{slot}' cover only {covered} of its {n} tokens"),
    (r"^slot '(?P<slot>.+)': new content, its base is taken from this prefill$",
     "slot '{slot}' holds text seen for the first time (this call's KV of it is kept for later calls)"),
    (r"^fixed segment \d+ at (?P<at>\d+) has no base yet$",
     "the template text at token {at} is new (an agent's first call, or a new system message)"),
    (r"^fixed segment \d+ at (?P<at>\d+) is not reusable on its own$",
     "the template text at token {at} is reused only right after estimated content, and none came before it"),
    (r"^the exact prefix ends inside fixed segment \d+, at token (?P<at>\d+).*$",
     "the stored exact prefix ends inside template text at token {at}"),
    (r"^template text after the last reused shared segment is computed \(from (?P<at>\d+)\)$",
     "the reuse scope computes the template text after the shared content"),
    (r"^no reuse: (?P<why>.+)$", "{why}"),
    (r"^dense$", "a dense call (no reuse engine)"),
    (r"^dense: no kvcomm options sent$", "a dense call (no kvcomm options sent)"),
    (r"^mode exact: exact prefix only$", "mode exact serves exact prefixes only"),
))

_COUNTS = frozenset({"at", "have", "need", "covered", "n"})
"""Groups of ``_REWRITES`` that are token counts or positions: written with thousands separators."""

_LAST_TOKEN = "the last prompt token is always computed (its logits start the reply)"


def because(note: str) -> str:
    """The plan's ``note`` in plain words: each ``"; "``-separated part rewritten by its kind
    (unknown parts kept as they are); vLLM's ``cached_tokens`` comparison is left out (the
    counts say it: ``explain``); "" for an empty note."""
    words = []
    for part in (p.strip() for p in note.split(";")):
        if not part or part.startswith("vLLM cached_tokens"):
            continue
        for pattern, template in _REWRITES:
            found = pattern.match(part)
            if found:
                fields = {k: f"{int(v):,}" if k in _COUNTS else v for k, v in found.groupdict().items()}
                part = template.format(**fields)
                break
        words.append(part)
    return "; ".join(words)


def explain(p) -> str:
    """``p`` (a ``Provenance``) in one line: "reused R of N tokens (exact E, estimated S,
    realigned A); computed C: H new text before the reused content, T from token X because
    ...". ``estimated`` counts the tokens an anchor's deviation estimated, ``realigned`` those
    served as their realigned base alone (a cold slot: ``Provenance.realigned_tokens``), so the
    three add up to R. Counts use thousands separators; parts with nothing in them are left out."""
    n = p.prompt_tokens
    reused = p.exact_tokens + p.estimated_tokens
    realigned = p.realigned_tokens
    counts = (("exact", p.exact_tokens), ("estimated", p.estimated_tokens - realigned), ("realigned", realigned))
    sources = ", ".join(f"{name} {count:,}" for name, count in counts if count)
    line = f"reused {reused:,} of {n:,} tokens" + (f" ({sources})" if sources else "")
    why = because(p.note)
    if p.computed_tokens == 0:
        return line + (f"; {why}" if why else "")
    tail = p.computed_tokens - p.preamble_tokens - p.recomputed_tokens
    parts = []
    if p.preamble_tokens:
        parts.append(f"{p.preamble_tokens:,} new text before the reused content")
    if p.recomputed_tokens:
        parts.append(f"{p.recomputed_tokens:,} recomputed inside the reused range (selective recompute)")
    if tail > 0:
        start = n - tail
        if reused + p.preamble_tokens == 0:
            parts.append(f"all {tail:,}" + (f" because {why}" if why else ""))
        elif tail == 1:
            parts.append(f"1 because {_LAST_TOKEN}")
        else:
            parts.append(f"{tail:,} from token {start:,}" + (f" because {why}" if why else ""))
    line += f"; computed {p.computed_tokens:,}: " + ", ".join(parts)
    if p.cached_tokens:
        line += f" ({p.cached_tokens:,} of them served by vLLM's prefix cache)"
    return line
