"""Automatic detection of shared segments: token runs already seen as shared content
(annotated segments, replies) found again, verbatim, in a new prompt.

This is how a request that opts in without annotations (``{"kvcomm": {}}``) gets reuse, e.g.
an unmodified OpenAI client of a multi-agent framework whose server adds the option. A run
is only found if it re-tokenizes to the same ids inside the new prompt (BPE can merge across
its edges: a run tokenized alone starts with "A" where the prompt has " A" after "Task:").
So each run is also indexed without its first and last token, which finds those interiors;
a run is missed when BPE merges reach further in, never mismatched.
"""

from __future__ import annotations

import threading
from typing import Sequence

from kvcomm.integrations.vllm.params import SpanAnnotation


class RunIndex:
    """Known shared token runs (at least ``min_length`` tokens), indexed by first token.

    ``find`` scans a prompt left to right and takes, at each position, the longest known run
    starting there; found spans never overlap. Bounded to ``max_runs`` (oldest dropped).
    """

    def __init__(self, min_length: int = 8, max_runs: int = 4096):
        if min_length < 1 or max_runs < 1:
            raise ValueError(f"min_length and max_runs must be >= 1 (got {min_length}, {max_runs})")
        self.min_length = min_length
        self.max_runs = max_runs
        self._runs: dict[tuple[int, ...], str] = {}  # run -> slot, insertion ordered
        self._by_first: dict[int, set[tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, token_ids: Sequence[int], slot: str) -> None:
        """Index the run and its interior (first and last token dropped)."""
        run = tuple(int(t) for t in token_ids)
        self._add(run, slot)
        self._add(run[1:-1], slot)

    def _add(self, run: tuple[int, ...], slot: str) -> None:
        if len(run) < self.min_length:
            return
        with self._lock:
            if run in self._runs:
                return
            if len(self._runs) >= self.max_runs:
                oldest = next(iter(self._runs))
                del self._runs[oldest]
                self._by_first[oldest[0]].discard(oldest)
            self._runs[run] = slot
            self._by_first.setdefault(run[0], set()).add(run)

    def find(self, token_ids: Sequence[int]) -> tuple[SpanAnnotation, ...]:
        """Known runs inside ``token_ids``, in order; each span's slot is the run's slot."""
        ids = tuple(int(t) for t in token_ids)
        found: list[SpanAnnotation] = []
        at = 0
        with self._lock:
            while at < len(ids):
                best = None
                for run in self._by_first.get(ids[at], ()):
                    if (best is None or len(run) > len(best)) and ids[at : at + len(run)] == run:
                        best = run
                if best is None:
                    at += 1
                    continue
                found.append(SpanAnnotation(at, at + len(best), self._runs[best]))
                at += len(best)
        return tuple(found)
