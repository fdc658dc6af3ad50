"""What the engine needs from a model runtime (transformers, vLLM): the executor protocol."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from kvcomm.core.kv import KV
from kvcomm.reuse.pipeline import Slot
from kvcomm.reuse.plan import BlendRequest
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Segment


OnToken = Callable[[int], "bool | None"]
"""Called with each generated token as it is decoded (streaming); returning False stops
decoding after that token (cancellation). The reply keeps the tokens decoded so far."""


@dataclass(frozen=True)
class Generation:
    """One agent call's result.

    reply_ids: generated tokens, end-of-turn token excluded.
    computed: real KV of the prompt tokens after the injected prefix, rotated at their positions.
    reply_kv: real KV of ``reply_ids`` at positions ``[len(prompt), len(prompt) + len(reply))``.
    ttft_s: seconds from ``started`` to the first token's logits.
    prompt_logprobs: with ``keep_logprobs``, log-softmax of the next-token distribution at
        every computed prompt position ``[prefix.length, len(prompt))``: ``[positions, vocab]``
        float32 (row ``i`` predicts token ``prefix.length + i + 1``); None otherwise.
    recomputed: prompt positions inside the injected prefix that a ``BlendRequest`` had
        recomputed, sorted (empty when none was asked).
    cached_tokens: prompt tokens after the injected prefix that the runtime's own prefix cache
        served instead of computing them (vLLM's ``num_cached_tokens`` less the injected
        prefix); always 0 on a runtime without one (transformers).
    preamble: real KV of the preamble ``generate`` was asked to compute first (its ``preamble`` range),
        rotated at its positions; None without one.
    """

    reply_ids: tuple[int, ...]
    computed: KV
    reply_kv: KV | None
    ttft_s: float
    prompt_logprobs: torch.Tensor | None = None
    recomputed: tuple[int, ...] = ()
    cached_tokens: int = 0
    preamble: KV | None = None


class Executor(Protocol):
    """A model runtime. One with a prefix cache of its own (vLLM) may also offer
    ``with_salt(salt) -> Executor``: the same runtime, with the calls that inject nothing
    sharing that cache only with calls made under the same salt (``namespaced``). One that
    sets ``computes_preambles = True`` takes ``generate(..., preamble=(start, end))``: plans for it may
    compute new text before the reused content (``ReusePlan.preamble_length``)."""

    rotary: Rotary
    """The model's rotary embedding, self-checked; executors refuse to exist for models that fail."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render(self, system: str, parts: Sequence[str | Slot]) -> list[str | Slot]:
        """Wrap a system message and a user message made of text and slots in the chat
        template; text comes back split around the same slots, in order."""
        ...

    def base_kv(self, segment: Segment) -> KV:
        """Position-free KV of a shared segment prefilled without any consumer context."""
        ...

    def generate(
        self, token_ids: Sequence[int], prefix: KV | None, max_new_tokens: int, started: float,
        keep_logprobs: bool = False, blend: BlendRequest | None = None, on_token: OnToken | None = None,
    ) -> Generation:
        """Inject ``prefix`` (KV of the first ``prefix.length`` tokens, rotated), compute the
        rest of the prompt densely and decode greedily. ``prefix`` may be memory lent for this
        call only (``ReuseEngine.materialized``): copy what must outlive it, and return
        nothing that views it.

        keep_logprobs: fill ``Generation.prompt_logprobs``. blend: before the tail, recompute
        the selected tokens of ``prefix`` (CacheBlend) and correct their cached KV. on_token:
        see ``OnToken``. preamble ``(start, end)``: the prompt positions ``[start, end)`` inside
        ``prefix`` hold nothing yet: compute them first, behind ``prefix``'s first ``start``
        tokens, and return their KV (``Generation.preamble``). All four are optional: callers pass
        them only when set, so executors without them keep working for the plans that do not
        need them.
        """
        ...


def check_preamble(prefix: KV | None, start: int, end: int) -> KV:
    """``prefix`` if a preamble ``[start, end)`` fits inside it with reused tokens after it; else ValueError."""
    if prefix is None or not 0 <= start < end < prefix.length:
        raise ValueError(f"preamble [{start}, {end}) must lie inside the {0 if prefix is None else prefix.length}-token "
                         "prefix with reused tokens after it")
    return prefix


def fill_preamble(prefix: KV, start: int, preamble: KV) -> KV:
    """Write ``preamble`` (the preamble's KV) into ``prefix`` from position ``start`` (in its
    dtype and device) and return ``preamble``."""
    end = start + preamble.length
    prefix.keys[:, :, start:end] = preamble.keys.to(prefix.keys.device, prefix.keys.dtype)
    prefix.values[:, :, start:end] = preamble.values.to(prefix.values.device, prefix.values.dtype)
    return preamble


def namespaced(executor, label: str):
    """``executor`` in a prefix-cache namespace of its own, new at every call: the calls made
    through the result that inject nothing share the runtime's own prefix cache (vLLM's) only
    with each other. Each system of a side-by-side comparison on one engine takes one, so
    neither is served blocks the other computed, while each keeps the prefix caching a user of
    that runtime has among their own calls; calls that inject KV are isolated anyway. A runtime
    without a prefix cache (no ``with_salt``) comes back unchanged. ``label`` names the
    namespace (``kvcomm-<label>-<random>``), for logs."""
    with_salt = getattr(executor, "with_salt", None)
    return executor if with_salt is None else with_salt(f"kvcomm-{label}-{uuid.uuid4().hex[:12]}")
