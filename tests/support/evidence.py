"""Evidence that a slot's estimate beats realignment, for tests of what an estimate serves
(``kvcomm.anchors.evidence``): synthetic KV makes random deviations, which never earn it."""

from __future__ import annotations

from kvcomm.anchors.evidence import EVIDENCE_MIN_PAIRS, Evidence


def earn(pool, slot, parts=("shared", "following")) -> None:
    """Record in ``pool`` that ``slot`` (template, slot name) measured its estimate of each part
    at half realignment's squared error over ``EVIDENCE_MIN_PAIRS`` pairs."""
    for part in parts:
        pool.evidence[(slot, part)] = Evidence([1.0, 1.0], [2.0, 2.0], EVIDENCE_MIN_PAIRS)
