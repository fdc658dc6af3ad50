"""Automatic detection of shared segments: token runs already seen as shared content
(annotated segments, replies) found again, verbatim, in a new prompt.

This is how a request that opts in without annotations (``{"kvcomm": {}}``) gets reuse, e.g.
an unmodified OpenAI client of a multi-agent framework whose server adds the option. A run
is only found if it re-tokenizes to the same ids inside the new prompt (BPE can merge across
its edges: a run tokenized alone starts with "A" where the prompt has " A" after "Task:").
So each run is also indexed without its first and last token, which finds those interiors;
a run is missed when BPE merges reach further in, never mismatched.

Cost: ``find`` runs inside vLLM's engine step (the planner plans there), so its work must not
grow with what the index holds. Runs are indexed by their first ``min_length`` tokens (a
k-gram), at most ``bucket`` runs per k-gram (the oldest of a full bucket is dropped), and
compared through polynomial prefix hashes of the prompt computed once, so a candidate costs
O(1) and a prompt of n tokens costs O(n * (min_length + bucket)) operations plus the tokens of
the runs it finds (verified verbatim), whatever the number of stored runs. ``work`` counts
them for the last ``find``.
"""

from __future__ import annotations

import random
import threading
from typing import Sequence

from kvcomm.integrations.vllm.wire.params import SpanAnnotation

_MOD = (1 << 61) - 1


class RunIndex:
    """Known shared token runs (at least ``min_length`` tokens), indexed by their first
    ``min_length`` tokens.

    ``find`` scans a prompt left to right and takes, at each position, the longest known run
    starting there; found spans never overlap. Bounded to ``max_runs`` runs holding at most
    ``max_tokens`` tokens together (oldest dropped first) and ``bucket`` runs per k-gram.
    """

    def __init__(self, min_length: int = 8, max_runs: int = 4096, max_tokens: int = 1 << 20, bucket: int = 16):
        if min_length < 1 or max_runs < 1 or max_tokens < 1 or bucket < 1:
            raise ValueError(f"min_length, max_runs, max_tokens and bucket must be >= 1 "
                             f"(got {min_length}, {max_runs}, {max_tokens}, {bucket})")
        self.min_length = min_length
        self.max_runs = max_runs
        self.max_tokens = max_tokens
        self.bucket = bucket
        self.tokens = 0
        """Tokens of all runs held."""
        self.work = 0
        """Operations of the last ``find``: k-grams hashed, candidates compared, tokens verified."""
        self._base = random.Random().randrange(1 << 20, _MOD - 1)
        self._runs: dict[tuple[int, ...], tuple[str, int]] = {}  # run -> (slot, hash), insertion ordered
        self._by_gram: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    def _hash(self, run: Sequence[int]) -> int:
        h = 0
        for t in run:
            h = (h * self._base + t + 1) % _MOD
        return h

    def add(self, token_ids: Sequence[int], slot: str) -> None:
        """Index the run and its interior (first and last token dropped)."""
        run = tuple(int(t) for t in token_ids)
        self._add(run, slot)
        self._add(run[1:-1], slot)

    def _add(self, run: tuple[int, ...], slot: str) -> None:
        if len(run) < self.min_length or len(run) > self.max_tokens:
            return
        digest = self._hash(run)
        with self._lock:
            if run in self._runs:
                return
            bucket = self._by_gram.setdefault(run[: self.min_length], [])
            if len(bucket) >= self.bucket:
                self._drop(bucket[0])
            while self._runs and (len(self._runs) >= self.max_runs or self.tokens + len(run) > self.max_tokens):
                self._drop(next(iter(self._runs)))
            self._runs[run] = (slot, digest)
            self._by_gram.setdefault(run[: self.min_length], []).append(run)
            self.tokens += len(run)

    def _drop(self, run: tuple[int, ...]) -> None:
        del self._runs[run]
        self.tokens -= len(run)
        gram = run[: self.min_length]
        bucket = self._by_gram[gram]
        bucket.remove(run)
        if not bucket:
            del self._by_gram[gram]

    def find(self, token_ids: Sequence[int]) -> tuple[SpanAnnotation, ...]:
        """Known runs inside ``token_ids``, in order; each span's slot is the run's slot."""
        ids = tuple(int(t) for t in token_ids)
        n, k = len(ids), self.min_length
        prefix, power = [0] * (n + 1), [1] * (n + 1)
        for i, t in enumerate(ids):
            prefix[i + 1] = (prefix[i] * self._base + t + 1) % _MOD
            power[i + 1] = power[i] * self._base % _MOD
        work = 2 * n
        found: list[SpanAnnotation] = []
        at = 0
        with self._lock:
            while at + k <= n:
                work += k
                best = None
                for run in self._by_gram.get(ids[at : at + k], ()):
                    work += 1
                    end = at + len(run)
                    if end <= n and (best is None or len(run) > len(best)) and \
                            (prefix[end] - prefix[at] * power[len(run)]) % _MOD == self._runs[run][1]:
                        work += len(run)
                        if ids[at:end] == run:  # a hash collision is never a match
                            best = run
                if best is None:
                    at += 1
                    continue
                found.append(SpanAnnotation(at, at + len(best), self._runs[best][0]))
                at += len(best)
        self.work = work
        return tuple(found)
