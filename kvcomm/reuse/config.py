"""What a ``ReuseEngine`` is configured with: ``ReuseConfig``, and the names its fields take."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.scopes import DEFAULT_SCOPE, SCOPES
from kvcomm.reuse.strategies import MODES

BASE_SOURCES = ("first_use", "standalone")
"""Where new shared content's base KV comes from (``ReuseConfig.base_source``).

- ``first_use`` (default): the first request that contains it computes it densely (reuse
  stops there) and its KV there, de-rotated, becomes the base; no extra forward pass, so a
  miss costs what dense costs.
- ``standalone`` (KVCOMM's base): the executor prefills it alone behind a short lead-in when
  the request that first sees it is planned; that request can estimate it already, but pays
  one more forward pass over the content first.

Replies get their base as the scope says (``kvcomm.reuse.scopes``). How the two compare:
docs/measurements/2026-12-02-frontier.md.
"""


@dataclass(frozen=True)
class ReuseConfig:
    """What one tenant's ``ReuseEngine`` reuses and how. Frozen; ``__post_init__`` refuses a
    bad value with every problem named."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    """Admission and estimation settings of every slot's anchor pool."""
    mode: str = "kvcomm"
    """One of ``MODES`` (``kvcomm.reuse.strategies``): how a plan serves shared content."""
    scope: str = DEFAULT_SCOPE
    """One of ``SCOPES`` (``kvcomm.reuse.scopes``): what a plan serves from stored KV."""
    recompute_ratio: float = 0.15
    """Share of the estimated tokens the modes with a selective recompute ("cacheblend",
    "kvblend") recompute, in (0, 1]."""
    base_source: str = "first_use"
    """One of ``BASE_SOURCES``."""
    prefix_store_bytes: int = 1 << 30
    """Budget of the exact prefix store, bytes."""
    workspace_bytes: int = 512 << 20
    """Most memory ``materialized`` keeps between requests for reuse (``KVWorkspace``; 0 keeps
    none), bytes."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            hint = " (dense prefill is running without an engine)" if self.mode == "dense" else ""
            problems.append(f"unknown mode {self.mode!r}{hint}; valid modes: {', '.join(MODES)}")
        if self.scope not in SCOPES:
            problems.append(f"unknown reuse scope {self.scope!r}; valid: {', '.join(SCOPES)}")
        if self.base_source not in BASE_SOURCES:
            problems.append(f"unknown base_source {self.base_source!r}; valid: {', '.join(BASE_SOURCES)}")
        if not 0 < self.recompute_ratio <= 1:
            problems.append(f"recompute_ratio must be in (0, 1] (got {self.recompute_ratio})")
        for name in ("prefix_store_bytes", "workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be an integer >= 0 (got {value!r})")
        if problems:
            raise ValueError("invalid reuse config: " + "; ".join(problems))
