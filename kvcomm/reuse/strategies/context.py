"""What a plan strategy may read while it plans one prompt: ``PlanContext``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvcomm.anchors.matching import Decision
from kvcomm.core.kv import KV
from kvcomm.core.segments import Prompt, Segment
from kvcomm.reuse.plan import Serving


@dataclass(frozen=True)
class PlanContext:
    """The prompt, its exact prefix and the engine's stored KV, as one strategy call sees them;
    a strategy decides from these alone and returns a ``Serving``, changing neither the plan
    nor the engine.

    exact_length: tokens ``[0, exact_length)`` the exact prefix serves. computes_preambles: the
    executor computes a preamble before the pieces (``Executor.computes_preambles``), so the strategy
    may plan one. limit: the first prompt position no piece may reach (``len(prompt) - 1``: the
    last token is computed, so its logits come from a real forward). decisions: the slot pools'
    decisions per shared segment index, made before the walk (modes that estimate;
    ``kvcomm.anchors.matching``); a strategy that serves a match leaves committing it to the
    engine. base(segment): the content's (position-free base KV, embedding), None if it has
    none; with a base provider (``ReuseConfig.base_source`` "standalone") new content's base is
    computed and kept on first asking, a fill of the engine's store that decides nothing.
    fixed_base(index): the template's stored base of fixed segment ``index``, or None;
    fixed_digest(index): ``kv_digest`` of that base (which anchors' following deviations were
    measured against it)."""

    prompt: Prompt
    exact_length: int
    computes_preambles: bool
    limit: int
    decisions: Mapping[int, Decision]
    base: Callable[[Segment], tuple[KV, object] | None]
    fixed_base: Callable[[int], KV | None]
    fixed_digest: Callable[[int], str]

    def serving(self) -> Serving:
        """Nothing served yet after the exact prefix: the ``Serving`` a strategy fills and returns."""
        return Serving(self.exact_length)
