"""The reuse engine: plans, materializes and learns KV reuse for one tenant (KVCOMM §4).

The engine never runs a model. An executor injects what ``materialize`` returns, computes
the rest densely and hands the real KV back to ``learn``. Shared content the engine has no
base KV for gets one of two ways (``ReuseConfig.base_source``): a standalone prefill by the
executor when it is planned (``BaseProvider``; it can be estimated at once), or the KV this
request computes for it, taken in ``learn`` (no extra forward pass; estimable from the next
request on).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Callable

import torch

from kvcomm.anchors.anchor import Deviation, kv_digest
from kvcomm.anchors.index import Embedder, KVEmbedding
from kvcomm.anchors.matching import Decision, decide_all
from kvcomm.anchors.pool import AnchorPool
from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV, place, to_position_free
from kvcomm.core.rope import RopeError, Rotary
from kvcomm.core.segments import Prompt, Segment, content_id
from kvcomm.reuse.assemble import assemble, reuse_device, reuse_layout
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.plan import ReusePlan
from kvcomm.reuse.prefix_store import PrefixStore
from kvcomm.reuse.scopes import SCOPES
from kvcomm.reuse.strategies import MODES
from kvcomm.reuse.strategies.context import PlanContext
from kvcomm.reuse.workspace import KVWorkspace

BaseProvider = Callable[[Segment], KV]
"""Computes a shared segment's position-free base KV, ``[layers, kv_heads, T, head_dim]``."""


class ReuseEngine:
    """Reuse state of one tenant: base KV of shared content, fixed-segment bases per
    template, one anchor pool per slot name, and the exact prefix store."""

    def __init__(
        self, rotary: Rotary, config: ReuseConfig | None = None, embedder: Embedder | None = None,
        workspace: KVWorkspace | None = None, head_shards: HeadShards = ALL_HEADS,
    ):
        """embedder: maps shared content to its pool-narrowing vector (default: its pooled base
        values, ``KVEmbedding``). workspace: memory ``materialized`` lends (engines may share
        one); by default the engine's own, keeping at most ``config.workspace_bytes`` idle.
        head_shards: the KV heads this process holds (``kvcomm.core.heads``): every KV the engine
        takes and gives holds those, and its plans are those of one process holding all heads."""
        self.rotary = rotary
        self.config = config or ReuseConfig()
        self.head_shards = head_shards
        self.embedder = embedder if embedder is not None else KVEmbedding(head_shards)
        self.pools: dict[str, AnchorPool] = {}
        self.prefix_store = PrefixStore(self.config.prefix_store_bytes)
        self.workspace = workspace if workspace is not None else KVWorkspace(self.config.workspace_bytes)
        self._bases: dict[str, tuple[KV, object]] = {}  # shared_id -> (position-free KV, embedding)
        self._fixed_bases: dict[tuple[str, str], KV] = {}  # (template id, content id) -> position-free KV
        self._fixed_digests: dict[tuple[str, str], tuple[weakref.ref, str]] = {}  # key -> (its base's keys, kv_digest)
        self._lock = threading.RLock()

    # -- state -------------------------------------------------------------------------------

    def pool(self, slot: str) -> AnchorPool:
        with self._lock:
            if slot not in self.pools:
                self.pools[slot] = AnchorPool(self.config.pool, self.head_shards)
            return self.pools[slot]

    def register_base(self, segment: Segment, base: KV) -> KV:
        """Keep ``base`` (position-free, ``[layers, kv_heads, len(segment), head_dim]``) as the
        base KV of shared content ``segment.shared_id`` and return the base now held for it.

        One base per content: if the engine or an anchor (in any pool) already holds one, that
        base stays and ``base`` is ignored, so every deviation recorded against the content's
        base keeps being applied to that very base."""
        if base.length != len(segment):
            raise ValueError(f"base KV has {base.length} tokens, segment has {len(segment)}")
        with self._lock:
            held = self._held_base(segment.shared_id)
            if held is None:
                held = (base, self.embedder(segment.token_ids, base))
            self._bases[segment.shared_id] = held
            return held[0]

    def _held_base(self, shared_id: str) -> tuple[KV, object] | None:
        """(base, embedding) held for ``shared_id``: the engine's, else an anchor's; None if neither."""
        held = self._bases.get(shared_id)
        if held is not None:
            return held
        for pool in self.pools.values():
            anchor = pool.get(shared_id)
            if anchor is not None:
                return anchor.base, anchor.embedding
        return None

    def has_base(self, shared_id: str) -> bool:
        """Whether a base is held for ``shared_id`` (by the engine or by an anchor of it)."""
        with self._lock:
            return self._held_base(shared_id) is not None

    def base_ids(self) -> tuple[str, ...]:
        """Content ids of the bases the engine itself holds (anchors' bases aside)."""
        with self._lock:
            return tuple(self._bases)

    def stored_base(self, shared_id: str) -> KV | None:
        """The position-free base KV held for shared content ``shared_id``, or None."""
        with self._lock:
            held = self._held_base(shared_id)
            return None if held is None else held[0]

    def drop_base(self, shared_id: str) -> bool:
        """Forget the engine's reference to the base KV of ``shared_id``. An anchor of that
        content keeps its base, and plans go on using it (one base per content); without
        one, a later plan recomputes the base from its tokens. Returns whether one was held."""
        with self._lock:
            return self._bases.pop(shared_id, None) is not None

    def learns_at(self, length: int) -> bool:
        """Whether KV of a ``length``-token sequence may be learned from: its keys use the
        frequencies every realignment assumes (``Rotary.check_length``; dynamic NTK and
        longrope change them past ``max_exact_length``)."""
        try:
            self.rotary.check_length(length)
        except RopeError:
            return False
        return True

    def learns_from(self, plan: ReusePlan) -> bool:
        """Whether the KV a request computes under ``plan`` may become bases, fixed bases or
        anchors: only when everything before it was exact or computed (nothing estimated)."""
        return plan.estimated_tokens == 0

    def learns_reply_from(self, plan: ReusePlan) -> bool:
        """Whether the reply generated after ``plan`` may become its content's base (its decode
        KV): when the scope takes replies' bases from their decode and ``learns_from(plan)``."""
        return self.scope.decode_reply_bases and self.learns_from(plan)

    @property
    def scope(self):
        """The ``Scope`` preset named by ``config.scope``."""
        return SCOPES[self.config.scope]

    def base_provider(self, executor) -> BaseProvider | None:
        """What ``plan`` gets to compute new content's base: the executor's standalone prefill
        (``executor.base_kv``) when ``config.base_source`` is "standalone", else None (the base
        comes from the request that first computes the content)."""
        return executor.base_kv if self.config.base_source == "standalone" else None

    @property
    def uses_bases(self) -> bool:
        """Whether plans reuse shared content from base KV (every mode but "exact"), so
        replies are worth registering as bases."""
        return MODES[self.config.mode].uses_bases

    def base(self, segment: Segment, provide: BaseProvider | None) -> tuple[KV, object] | None:
        """The content's (base, embedding); computed by ``provide`` if new; None if new and no provider."""
        held = self._held_base(segment.shared_id)
        if held is None:
            if provide is None:
                return None
            self.register_base(segment, provide(segment))
            held = self._bases[segment.shared_id]
        return held

    # -- plan --------------------------------------------------------------------------------

    def plan(self, prompt: Prompt, provide_base: BaseProvider | None = None, computes_preambles: bool = False) -> ReusePlan:
        """Decide which prompt tokens are exact, estimated or computed (see ``ReusePlan``).

        Shared content without a base: ``provide_base`` computes it now; without a provider
        the content is computed densely and ``learn`` takes its base from this request
        (``plan.new_bases``). computes_preambles: the executor computes a preamble before the reused pieces
        (``Executor.computes_preambles``), so text the engine cannot serve (an agent's unseen
        system prompt) need not end reuse of the shared content after it."""
        try:
            self.rotary.check_length(len(prompt))
        except RopeError as error:
            # Past the exact length every key of the prompt is computed with other frequencies:
            # no stored KV (exact prefix, template lead, base) matches what dense computes.
            return ReusePlan(prompt, computes_preambles=computes_preambles, note=f"no reuse: {error}")
        length, kv, position_free = self._exact_prefix(prompt)
        mode = MODES[self.config.mode]
        decisions = self._decide(prompt, length, provide_base) if mode.estimates else {}
        plan = ReusePlan(prompt, computes_preambles=computes_preambles, exact_length=length, exact_kv=kv, exact_position_free=position_free,
                         decisions=decisions)
        plan.serve(mode.strategy(PlanContext(
            prompt, length, computes_preambles, self.reuse_limit(prompt), MappingProxyType(decisions),
            base=lambda segment: self.base(segment, provide_base),
            fixed_base=lambda index: self.fixed_base(prompt, index),
            fixed_digest=lambda index: self.fixed_digest(prompt, index),
        )))
        for piece in plan.pieces:
            if piece.match is not None:  # an estimate served: its anchors get an access
                decisions[piece.segment_index].commit()
        if self.scope.compute_trailing_text:
            plan.cut_trailing_text()
        if provide_base is None and mode.uses_bases:
            plan.expect_new_bases(lambda shared_id: self._held_base(shared_id) is not None)
        if mode.recompute:
            plan.ask_recompute(self.config.recompute_ratio, CHECK_LAYER)
        return plan

    def _exact_prefix(self, prompt: Prompt) -> tuple[int, KV | None, bool]:
        """(length, KV, position-free) of the prompt's exact prefix, never its last token: the
        longest stored prefix, else a template's stored first segment (nothing precedes it, so
        its stored base is its exact KV, position-free)."""
        last = len(prompt) - 1
        length, kv = self.prefix_store.longest(prompt)
        if length > last:
            length, kv = last, kv.span(0, last)
        lead = self._fixed_bases.get(_fixed_key(prompt, 0))
        if length == 0 and lead is not None and not prompt.segments[0].is_shared:
            length = min(lead.length, last)
            return length, lead.span(0, length), True
        return length, kv, False

    def calibration_plan(self, prompt: Prompt, provide_base: BaseProvider | None = None) -> ReusePlan:
        """A plan that reuses nothing and learns all a dense prefill of ``prompt`` reveals.

        Like a plan that reused nothing, its ``learn`` takes the bases of new content, the
        fixed bases, the exact prefix and (through the runner) the reply's base; and in the
        anchor modes every shared segment whose content already has a base is recorded in its
        slot's pool, whether or not the pool would have estimated it (a plan records only the
        segments its pool refuses). So a pool fills towards V anchors instead of stopping at
        ``min_compatible``: for calibration traffic (``kvcomm eval --warm-items``), costing
        a dense prefill per call. Content new to the engine becomes a base, not an anchor, as
        in ``plan`` (its deviation against its own first use is zero)."""
        if not self.learns_at(len(prompt)):
            return ReusePlan(prompt, note="calibration: nothing learned, the prompt is past the exact RoPE length")
        anchors, new_bases, learn = MODES[self.config.mode].estimates, [], []
        for index, segment in enumerate(prompt.segments):
            if not segment.is_shared:
                continue
            if self.base(segment, provide_base) is None:
                new_bases.append(index)
            elif anchors:
                learn.append(index)
        return ReusePlan(prompt, learn=learn, new_bases=new_bases, note="calibration: computed densely, learned")

    def _decide(self, prompt: Prompt, exact_length: int, provide: BaseProvider | None) -> dict[int, Decision]:
        """Every slot pool's decision on every shared segment a strategy may reach (those ending
        after the exact prefix whose content has a base), made at once: one host read in all."""
        requests, indices = [], []
        for index, segment in enumerate(prompt.segments):
            known = self.base(segment, provide) if segment.is_shared and prompt.end(index) > exact_length else None
            if known is not None:
                pool = self.pool(segment.slot)
                requests.append(pool.candidates((prompt.template_id, segment.slot), segment.shared_id, *known))
                indices.append(index)
        return dict(zip(indices, decide_all(requests))) if requests else {}

    def reuse_limit(self, prompt: Prompt) -> int:
        """First prompt position no estimated or realigned piece may reach: the last token is
        computed, so its logits come from a real forward."""
        return max(len(prompt) - 1, 0)

    def fixed_base(self, prompt: Prompt, index: int) -> KV | None:
        """The stored base of fixed segment ``index`` of ``prompt`` (its template's), or None."""
        return self._fixed_bases.get(_fixed_key(prompt, index))

    def fixed_digest(self, prompt: Prompt, index: int) -> str:
        """``kv_digest`` of the fixed base held for segment ``index`` (computed once per base)."""
        return self._fixed_digest(_fixed_key(prompt, index))

    def _fixed_digest(self, key: tuple[str, str]) -> str:
        """``kv_digest`` of the fixed base held under ``key`` (computed once per base)."""
        base = self._fixed_bases[key]
        known = self._fixed_digests.get(key)
        if known is None or known[0]() is not base.keys:
            known = (weakref.ref(base.keys), kv_digest(base))
            self._fixed_digests[key] = known
        return known[1]

    # -- materialize -------------------------------------------------------------------------

    def materialize(self, plan: ReusePlan) -> KV | None:
        """KV for prompt tokens ``[0, plan.reuse_end)``, keys rotated at their positions, or None;
        in new memory the caller owns (``materialized`` lends reused memory instead)."""
        shape, key_dtype, value_dtype = reuse_layout(plan)
        if shape is None:
            return None
        device = reuse_device(plan)
        return assemble(plan, KV(torch.empty(shape, dtype=key_dtype, device=device),
                                 torch.empty(shape, dtype=value_dtype, device=device)), self.rotary)

    @contextmanager
    def materialized(self, plan: ReusePlan) -> Iterator[KV | None]:
        """``materialize`` into memory lent by ``self.workspace`` for the ``with`` block: valid only
        inside it (the next request's KV is written there), so inject it, and copy anything
        that must outlive the block, before leaving. Skips the page faults of new memory."""
        shape, key_dtype, value_dtype = reuse_layout(plan)
        if shape is None:
            yield None
            return
        with self.workspace.lease(shape, key_dtype, value_dtype, reuse_device(plan)) as out:
            yield assemble(plan, out, self.rotary)

    # -- learn -------------------------------------------------------------------------------

    def learn(self, plan: ReusePlan, computed: KV, reply_ids: tuple[int, ...] = (), reply_kv: KV | None = None,
              preamble: KV | None = None) -> None:
        """Record what the dense forward revealed; ``computed`` is the real, rotated KV of
        prompt tokens ``[plan.reuse_end, len(prompt))``, ``preamble`` that of the preamble
        ``[plan.exact_length, plan.pieces_start)`` (``Generation.preamble``; required when the plan
        has one). Costs no forward pass.

        reply_ids, reply_kv: the reply generated after the prompt and its real KV at positions
        ``[len(prompt), len(prompt) + len(reply_ids))`` (None: not all of it was computed, e.g. a
        cancelled call); the reply becomes shared content with that KV, de-rotated, as its base
        when ``learns_reply_from(plan)``."""
        if plan.preamble_length:
            self._learn_preamble(plan, preamble)
        self._learn_prompt(plan, computed)
        if reply_kv is not None and reply_ids and self.uses_bases and self.learns_reply_from(plan):
            n = len(plan.prompt)
            if reply_kv.length != len(reply_ids):
                raise ValueError(f"reply KV has {reply_kv.length} tokens, the reply {len(reply_ids)}")
            if self.learns_at(n + len(reply_ids)):
                reply = Segment(tuple(reply_ids), slot="_")
                if not self.has_base(reply.shared_id):
                    self.register_base(reply, to_position_free(reply_kv, self.rotary, n))

    def _learn_prompt(self, plan: ReusePlan, computed: KV) -> None:
        prompt, begin = plan.prompt, plan.reuse_end
        if computed.length != len(prompt) - begin:
            raise ValueError(f"learn needs KV of {len(prompt) - begin} computed tokens, got {computed.length}")
        if not self.learns_at(len(prompt)):
            return  # keys computed with other RoPE frequencies: de-rotating them would corrupt every base

        real = _segment_kv(prompt, computed, begin, self.rotary)
        clean = self.learns_from(plan)
        if not clean and not self.scope.bases_after_estimates:
            return
        with self._lock:
            self._take_new_bases(plan, real, [i for i in plan.new_bases if prompt.starts[i] >= begin])
            if not clean:
                return  # computed behind estimated KV: its errors would become every later estimate's
            if plan.estimated_tokens == 0:
                self._put_prefix(plan, prompt, computed)
            self._take_fixed_bases(prompt, [i for i in range(len(prompt.segments)) if prompt.starts[i] >= begin], real)
            for index in plan.learn:
                if self._held_base(prompt.segments[index].shared_id) is not None:  # else dropped since planning
                    self._record(prompt, index, real)

    def _learn_preamble(self, plan: ReusePlan, preamble: KV | None) -> None:
        """What the preamble revealed, computed behind exact KV only, so clean: bases of new
        content in it, its fixed segments' bases, and the exact prefix up to its end (an agent's
        next call finds its system prompt there)."""
        prompt, begin, end = plan.prompt, plan.exact_length, plan.pieces_start
        if preamble is None or preamble.length != end - begin:
            raise ValueError(f"learn needs KV of the {end - begin}-token preamble, got "
                             f"{'none' if preamble is None else preamble.length}")
        if not self.learns_at(len(prompt)):
            return
        real = _segment_kv(prompt, preamble, begin, self.rotary)
        inside = [i for i in range(len(prompt.segments)) if begin <= prompt.starts[i] and prompt.end(i) <= end]
        with self._lock:
            self._take_new_bases(plan, real, inside)
            self._take_fixed_bases(prompt, inside, real)
            self._put_prefix(plan, Prompt(prompt.template_id, prompt.segments[: inside[-1] + 1]), preamble)

    def _put_prefix(self, plan: ReusePlan, prompt: Prompt, computed: KV) -> None:
        """Store the exact KV of ``prompt`` (the plan's prompt or its first segments): the plan's
        exact prefix, rotated at its positions, then ``computed``, the KV after it."""
        exact = plan.exact_kv
        if exact is not None and plan.exact_position_free:
            exact = place(exact, self.rotary, 0)
        self.prefix_store.put(prompt, computed if exact is None else KV.cat([exact, computed.to(exact.keys.dtype)]))

    def _take_fixed_bases(self, prompt: Prompt, indices: list[int], real: Callable[[int], KV]) -> None:
        """Keep the computed KV of each fixed segment among ``indices`` whose template has no base for it yet."""
        for index in indices:
            key = _fixed_key(prompt, index)
            if not prompt.segments[index].is_shared and key not in self._fixed_bases:
                self._fixed_bases[key] = real(index).clone()

    def _take_new_bases(self, plan: ReusePlan, real: Callable[[int], KV], indices: list[int]) -> None:
        """Register the computed KV of each content in ``plan.new_bases`` among ``indices`` still without a base."""
        for index in plan.new_bases:
            segment = plan.prompt.segments[index]
            if index in indices and self._held_base(segment.shared_id) is None:
                self.register_base(segment, real(index).clone())

    def _record(self, prompt: Prompt, index: int, real: Callable[[int], KV]) -> None:
        """Record segment ``index``'s deviation against the base its anchor holds (a new
        anchor takes the content's held base itself, no copy)."""
        segment = prompt.segments[index]
        pool = self.pool(segment.slot)
        anchor = pool.get(segment.shared_id)
        base, embedding = (anchor.base, anchor.embedding) if anchor is not None else self._held_base(segment.shared_id)
        following, following_base = None, None
        nxt = index + 1
        if nxt < len(prompt.segments) and not prompt.segments[nxt].is_shared:
            key = _fixed_key(prompt, nxt)
            following, following_base = _deep_deviation(real(nxt), self._fixed_bases[key]), self._fixed_digest(key)
        shared = _deep_deviation(real(index), base)
        slot = (prompt.template_id, segment.slot)
        self._observe(pool, slot, segment.shared_id, base, embedding, shared, following, following_base)
        deviation = Deviation(shared, following, following_base, DEVIATION_FIRST_LAYER)
        pool.record(slot, segment.shared_id, base, embedding, deviation)

    @staticmethod
    def _observe(pool: AnchorPool, slot, segment_id: str, base: KV, embedding, shared: KV,
                 following: KV | None, following_base: str | None) -> None:
        """Before a dense segment becomes an anchor: what would the pool have estimated for it?
        Feeds the slot's evidence and shrinkage fit (``AnchorPool.observe``); the following
        segment only when every matched anchor measured its deviation against the same fixed base."""
        match = pool.decide(slot, segment_id, base, embedding, commit=False, admission=False)
        if match is None or match.identical:
            return
        same_following = following is not None and all(
            a.deviations[slot].following_base == following_base for a in match.anchors)
        pool.observe(match, base, shared, following if same_following else None)


CHECK_LAYER = 1
"""The decoder layer (0-based) whose key deviation picks the tokens a selective recompute
recomputes (CacheBlend's rule: docs/measurements/2026-12-02-disagreement-recompute.md)."""

DEVIATION_FIRST_LAYER = 1
"""Deviations are recorded from this model layer on: layer 0's K/V depend only on each token and
its position, so the realigned base is exact there and any difference is rounding."""


def _segment_kv(prompt: Prompt, kv: KV, begin: int, rotary: Rotary) -> Callable[[int], KV]:
    """Segment index -> its position-free KV, cut from ``kv``, the rotated KV of prompt positions from ``begin`` on."""

    def real(index: int) -> KV:
        start = prompt.starts[index]
        return to_position_free(kv.span(start - begin, prompt.end(index) - begin), rotary, start)

    return real


def _deep_deviation(real: KV, base: KV) -> KV:
    """``real - base`` on layers ``DEVIATION_FIRST_LAYER..`` (both position-free, same shape)."""
    first = DEVIATION_FIRST_LAYER
    return KV(real.keys[first:] - base.keys[first:].to(real.keys.dtype),
              real.values[first:] - base.values[first:].to(real.values.dtype))


def _fixed_key(prompt: Prompt, index: int) -> tuple[str, str]:
    """Fixed segments are known by template and content, so a dropped empty slot cannot
    make one segment's base stand in for another's."""
    return prompt.template_id, content_id(prompt.segments[index].token_ids)

