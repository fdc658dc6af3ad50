"""What a ``ReuseEngine`` is configured with: ``ReuseConfig`` and the names its fields take
(modes, base sources, reuse scopes, what happens behind an estimate)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.recompute import RECOMPUTE_SELECTIONS

BASE_SOURCES = ("standalone", "first_use")
"""Where new shared content's base KV comes from (``ReuseConfig.base_source``).

- ``first_use`` (default): the first request that contains it computes it densely (reuse
  stops there) and its KV there, de-rotated, becomes the base; no extra forward pass, so a
  miss costs what dense costs.
- ``standalone`` (KVCOMM's base): the executor prefills it alone behind a short lead-in when
  the request that first sees it is planned; that request can estimate it already, but pays
  one more forward pass over the content first.

Replies get their base from the producer's decode either way. How the two compare in
quality and reuse: docs/measurements/2026-12-02-frontier.md.
"""

MODES = ("kvcomm", "exact", "realign", "cacheblend", "kvblend")
"""Reuse modes (dense prefill is no mode: it is running without an engine).

- ``kvcomm``: exact prefix + anchor-estimated shared segments (KVCOMM); behind the first
  estimate, what the anchors cannot estimate is served realigned (``BEHIND_ESTIMATE``).
- ``exact``: exact prefix reuse only (prefix store, template first segment); never estimates.
- ``realign``: every shared segment (and every fixed segment with a stored base) is reused
  as its RoPE-realigned base KV, no deviation, no anchors; reuse stops at the first fixed
  segment without a stored base.
- ``cacheblend``: ``realign``, then the executor recomputes the ``recompute_ratio`` of the
  estimated tokens whose keys deviate most at ``check_layer`` (CacheBlend, Yao et al. 2024).
- ``kvblend``: ``kvcomm``'s plan (exact prefix + anchor estimates, the same decisions), then
  a selective recompute of ``recompute_ratio`` of its estimated tokens, picked as
  ``recompute_selection`` says: CacheBlend's rule as in ``cacheblend``, or where the anchors
  disagree most (``kvcomm.reuse.recompute``).
"""

BLEND_MODES = ("cacheblend", "kvblend")
"""Modes whose plans ask the executor for a selective recompute (``ReusePlan.blend``)."""

REUSE_SCOPES: dict[str, dict[str, bool]] = {
    "all": {},
    "all-reader-replies": {"decode_reply_bases": False, "bases_after_estimates": True},
    "content": {"compute_trailing_text": True},
    "reader-replies": {"compute_trailing_text": True, "decode_reply_bases": False, "bases_after_estimates": True},
    "inputs": {"compute_trailing_text": True, "decode_reply_bases": False},
}
"""What a plan serves from stored KV, as ``ReuseConfig`` settings (``kvcomm run/demo/serve
--reuse-scope``; measured in docs/measurements/2026-12-05-where-the-error-is.md):

- ``all`` (default): every token with a base: the template's text, the shared inputs, the
  other agents' replies (their producers' decode KV as base).
- ``all-reader-replies``: ``all``, but a reply's base is not its producer's decode KV but its
  first reader's computation of it (``decode_reply_bases`` False, ``bases_after_estimates``):
  the first reader computes it (and, reuse being a prefix, what follows it), later readers
  reuse it.
- ``content``: shared content only; the template text after the last reused shared segment
  (the instructions the reply follows) is computed (``compute_trailing_text``).
- ``reader-replies``: ``content`` with ``all-reader-replies``' reply bases.
- ``inputs``: ``content``, and each reply computed by its readers until one that computed
  it cleanly gives it a base (``decode_reply_bases`` False): in a pipeline of agents that
  estimate, the workload's own inputs are what is reused.
"""


DEFAULT_REUSE_SCOPE = "all"
"""The scope of every entry point (CLI, connector, benchmarks) when none is named."""


def scope_settings(scope: str) -> dict[str, bool]:
    """The ``ReuseConfig`` settings of reuse scope ``scope`` (one of ``REUSE_SCOPES``)."""
    if scope not in REUSE_SCOPES:
        raise ValueError(f"unknown reuse scope {scope!r}; valid: {', '.join(REUSE_SCOPES)}")
    return dict(REUSE_SCOPES[scope])


BEHIND_ESTIMATE = ("realign", "learn", "stop")
"""What a "kvcomm"/"kvblend" plan does once it has estimated a piece (``ReuseConfig.behind_estimate``).
A request that has estimated learns nothing (KV behind an estimate carries its error), so a
dense fallback there teaches the pool nothing.

- ``realign`` (default): a segment the pool would send dense, the uncovered tail of a partly
  covered one and a fixed segment without the anchors' following deviations are served as
  their realigned bases (no offset), as mode "realign" serves them, and reuse goes on (up to
  new content without a base, or a fixed segment with no stored base).
- ``learn``: a segment the pool would send dense drops the plan's estimates (its exact prefix
  stays), so the request is computed cleanly from there and the segment becomes an anchor,
  as KVCOMM prefills an agent with an unshareable placeholder densely; uncovered tails and
  fixed segments as ``realign``.
- ``stop``: reuse stops at the first of them; everything after is computed and not learned.
"""


@dataclass(frozen=True)
class ReuseConfig:
    """What one tenant's ``ReuseEngine`` reuses and how: the mode, the scope of what plans
    serve, where bases come from, what is learned, and the selective recompute of the blend
    modes. Frozen; ``__post_init__`` refuses a bad value with every problem named."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    """Admission and estimation settings of every slot's anchor pool."""
    exact_prefix: bool = True
    """Serve exact prefix hits (prefix store, the template's first segment)."""
    prefix_store_bytes: int = 1 << 30
    """Budget of the exact prefix store, bytes."""
    anchor_dtype: torch.dtype | None = None
    """Dtype anchor deviations are stored in (None: the KV's own; bfloat16/float16 halve their
    memory). An anchor's base is its content's one base, held with the engine's, in the KV's
    dtype."""
    mode: str = "kvcomm"
    """One of ``MODES``."""
    recompute_ratio: float = 0.15
    """Share of the estimated tokens the blend modes recompute, in (0, 1]."""
    check_layer: int = 1
    """The decoder layer (0-based) whose key deviation selects the tokens to recompute
    (CacheBlend's rule; blend modes only)."""
    recompute_selection: str = "check_layer"
    """One of ``RECOMPUTE_SELECTIONS``: how "kvblend" picks the tokens it recomputes
    ("check_layer": CacheBlend's rule; "disagreement", mode "kvblend" only: the first
    ``recompute_boundary`` tokens of every estimated span, then where the anchors disagree
    most)."""
    recompute_boundary: int = 1
    """Tokens at the start of every estimated span recomputed under "disagreement"."""
    base_source: str = "first_use"
    """One of ``BASE_SOURCES``, read by callers that drive an executor (``runner.run_agent``) to
    decide whether to hand ``plan`` a ``BaseProvider``."""
    workspace_bytes: int = 512 << 20
    """Most memory ``materialized`` keeps between requests for reuse (``KVWorkspace``; 0 keeps
    none), bytes."""
    learn_after_estimates: bool = False
    """Also learn bases, fixed bases, anchors and reply bases from KV computed behind estimated
    pieces (False: only from KV whose whole preceding context was exact or computed)."""
    reply_bases_after_estimates: bool = False
    """Register a reply's base even when its request estimated (the reply's KV then carries the
    estimate's error into every later use of that base; False: a reply becomes a base only
    when its request may be learned from, ``ReuseEngine.learns_from``)."""
    bases_after_estimates: bool = False
    """New content's base is the KV of the first request that computes it, even when that
    request estimated content before it (its error then reaches every later use of the base;
    nothing else is learned from such a request). With ``decode_reply_bases`` False this is
    what lets a reply's second reader reuse it when every reader estimates the task."""
    decode_reply_bases: bool = True
    """A reply's base is the KV its producer decoded it with. False: a reply is content like
    any other, its base taken where other content's is (``base_source``: a reader that
    computes it cleanly, or a standalone prefill), so its readers compute it until then."""
    behind_estimate: str = "realign"
    """One of ``BEHIND_ESTIMATE``: what a "kvcomm"/"kvblend" plan that has already estimated
    does with a segment its pool would send dense (with ``learn_after_estimates``, every plan
    stops there and learns instead)."""
    compute_tail: int = 1
    """The last prompt tokens always computed, never served estimated or realigned (>= 1: the
    first reply token is read from the last prompt token's forward; more computes the end of
    the instructions the reply follows, as CacheBlend computes the query after its chunks).
    An exact prefix may still reach the last token but one."""
    compute_trailing_text: bool = False
    """Reuse ends with the last shared segment a plan reuses; the template text after it (the
    instructions, or the label before content that is computed) is computed, not served
    realigned or estimated: it reads the content before it, and its stored KV was computed
    behind other content (False: served)."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            hint = " (dense prefill is running without an engine)" if self.mode == "dense" else ""
            problems.append(f"unknown mode {self.mode!r}{hint}; valid modes: {', '.join(MODES)}")
        if self.base_source not in BASE_SOURCES:
            problems.append(f"unknown base_source {self.base_source!r}; valid: {', '.join(BASE_SOURCES)}")
        if not 0 < self.recompute_ratio <= 1:
            problems.append(f"recompute_ratio must be in (0, 1] (got {self.recompute_ratio})")
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 0:
            problems.append(f"check_layer must be an integer >= 0 (got {self.check_layer!r})")
        if self.recompute_selection not in RECOMPUTE_SELECTIONS:
            problems.append(f"unknown recompute_selection {self.recompute_selection!r}; valid: {', '.join(RECOMPUTE_SELECTIONS)}")
        elif self.recompute_selection == "disagreement" and self.mode != "kvblend":
            problems.append(f"recompute_selection 'disagreement' needs anchor estimates: mode 'kvblend', not {self.mode!r}")
        if isinstance(self.recompute_boundary, bool) or not isinstance(self.recompute_boundary, int) or self.recompute_boundary < 0:
            problems.append(f"recompute_boundary must be an integer >= 0 (got {self.recompute_boundary!r})")
        if self.behind_estimate not in BEHIND_ESTIMATE:
            problems.append(f"unknown behind_estimate {self.behind_estimate!r}; valid: {', '.join(BEHIND_ESTIMATE)}")
        if isinstance(self.compute_tail, bool) or not isinstance(self.compute_tail, int) or self.compute_tail < 1:
            problems.append(f"compute_tail must be an integer >= 1 (got {self.compute_tail!r})")
        for name in ("decode_reply_bases", "bases_after_estimates", "compute_trailing_text"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false (got {getattr(self, name)!r})")
        if self.workspace_bytes < 0:
            problems.append(f"workspace_bytes must be >= 0 (got {self.workspace_bytes})")
        if problems:
            raise ValueError("invalid reuse config: " + "; ".join(problems))
