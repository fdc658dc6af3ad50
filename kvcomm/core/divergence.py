"""KL(reference || other) of next-token distributions, bounded on the reference's top-k tokens
plus one "other" bucket, and the same-top-token rate. Used by the evaluation and the quality guard."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KL_TOP_K = 20
MIN_OTHER_MASS = 1e-12


@dataclass(frozen=True)
class TopK:
    """A reference distribution per position, compressed to what the metrics need:
    its ``k`` most likely tokens (``ids``, ``logprobs``: ``[P, k]``), the log of the mass
    outside them (``log_other``: ``[P]``) and its argmax (``top1``: ``[P]``)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    log_other: torch.Tensor
    top1: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def tail(self, count: int) -> "TopK":
        """The last ``count`` positions."""
        start = len(self) - count
        if not 0 <= start <= len(self):
            raise ValueError(f"cannot take the last {count} of {len(self)} positions")
        return TopK(self.ids[start:], self.logprobs[start:], self.log_other[start:], self.top1[start:])

    @staticmethod
    def cat(parts: Sequence["TopK"]) -> "TopK":
        return TopK(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(TopK)))


def _log_mass_outside(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability mass at each row outside the columns ``ids``: a logsumexp over
    the other columns (no cancellation, however small the mass), float64 ``[P]``."""
    masked = logprobs.float().clone().scatter_(1, ids, -math.inf)
    return torch.logsumexp(masked, dim=1).to(torch.float64)


def topk_reference(logprobs: torch.Tensor, k: int = KL_TOP_K) -> TopK:
    """Compress ``[P, V]`` log-probabilities to a ``TopK`` reference."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [positions, vocab], got shape {tuple(logprobs.shape)}")
    k = min(k, logprobs.shape[1])
    values, ids = torch.topk(logprobs, k, dim=1)
    return TopK(ids, values.to(torch.float64), _log_mass_outside(logprobs, ids), torch.argmax(logprobs, dim=1))


def _buckets(top: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``[P, k + 1]`` float64 log-probabilities of the top-k tokens and the "other" bucket,
    renormalized to sum to exactly 1 (float32 log-softmax rows sum to 1 only within ~1e-7;
    exact normalization keeps the KL non-negative and second order in the differences)."""
    logs = torch.cat([top.to(torch.float64), other.to(torch.float64)[:, None]], dim=1)
    return logs - torch.logsumexp(logs, dim=1, keepdim=True)


def kl_topk_other(reference: TopK, logprobs: torch.Tensor) -> torch.Tensor:
    """Per position KL(reference || other) over the reference's top-k tokens plus an "other"
    bucket (everything else). ``logprobs``: the other distribution, ``[P, V]`` log-softmax.

    A lower bound on the full KL (merging outcomes cannot increase it); equal to it when the
    top-k covers the vocabulary. float64, clamped at 0 against rounding.
    """
    if logprobs.shape[0] != len(reference):
        raise ValueError(f"{logprobs.shape[0]} positions vs {len(reference)} in the reference")
    if logprobs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64)
    return _kl(_buckets(reference.logprobs, reference.log_other),
               _buckets(logprobs.gather(1, reference.ids), _log_mass_outside(logprobs, reference.ids)))


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row KL(p || q) of ``_buckets`` rows, clamped at 0 against rounding."""
    terms = torch.where(p > -math.inf, p.exp() * (p - q), torch.zeros_like(p))
    return terms.sum(dim=1).clamp_min(0.0)


def kl_topk_other_of(reference: dict[int, float], other: dict[int, float]) -> float:
    """``kl_topk_other`` of one position from sparse log-probabilities, as a server reports them:
    ``reference``: the reference's top-k tokens -> log-probability; ``other``: the other
    distribution's log-probabilities of (at least) those tokens. The "other" buckets are the mass
    outside the tokens, 1 minus theirs, at least ``MIN_OTHER_MASS`` (rounded log-probabilities can
    sum past 1). Raises ValueError when ``other`` lacks a token."""
    missing = set(reference) - set(other)
    if missing:
        raise ValueError(f"the other distribution lacks the log-probabilities of tokens {sorted(missing)[:5]}")
    ids = list(reference)
    top = [torch.tensor([[reference[i] for i in ids]], dtype=torch.float64),
           torch.tensor([[other[i] for i in ids]], dtype=torch.float64)]
    rest = [torch.log1p(-t.exp().sum(dim=1).clamp(max=1.0 - MIN_OTHER_MASS)) for t in top]
    return float(_kl(_buckets(top[0], rest[0]), _buckets(top[1], rest[1]))[0])


def top1_matches(reference: TopK, logprobs: torch.Tensor) -> torch.Tensor:
    """Per position: does ``logprobs``' most likely token equal the reference's? (bool ``[P]``)"""
    return torch.argmax(logprobs, dim=1) == reference.top1
