"""What the remote chat backend sends to ``kvcomm serve`` and reads back (OpenAI ``/v1/completions``).

The client renders the conversation locally (``local.segments``), so the request's prompt is
token ids and each shared message is a span ``[start, end)`` of them, annotated in
``kv_transfer_params["kvcomm"]`` (schema: ``vllm.wire.params``). The server plans those spans with
its own reuse engine and answers with ``{"kvcomm": {"prompt_tokens", "exact_tokens",
"estimated_tokens", "realigned_tokens", "computed_tokens", "preamble_tokens", "fallback",
"reply_base", "note", "reason"}}`` (or ``{"error": ...}``; ``realigned_tokens``, the part of
``estimated_tokens`` served without an anchor's deviation, and ``reply_base``, whether the server
keeps the reply's decode KV as its base, are absent from older servers: 0 and False).

Slot names on the wire must match ``[A-Za-z_][A-Za-z0-9_.-]{0,63}``: the local slot
``"{author}#{k}"`` travels as ``"{author}.{k}"``, an author name outside that alphabet as its
sanitized form plus a short hash of the original (so two authors never share a pool by
accident). The template id (``"chat:<hash>"``) travels as is.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from kvcomm.reuse.plan import Provenance
from kvcomm.integrations.local.segments import ChatPrompt

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*\Z")  # \Z: "$" also matches before a final newline
_BAD = re.compile(r"[^A-Za-z0-9_.-]")
MAX_SLOT = 64


def wire_slot(slot: str) -> str:
    """``"{author}#{k}"`` -> a slot name the server accepts (deterministic, collision-averse)."""
    author, _, k = slot.rpartition("#")
    if not author:
        author, k = slot, ""
    suffix = f".{k}" if k else ""
    if _NAME.match(author) and len(author) + len(suffix) <= MAX_SLOT:
        return author + suffix
    digest = hashlib.sha1(author.encode()).hexdigest()[:8]
    clean = _BAD.sub("_", author)
    if not clean or not (clean[0].isalpha() or clean[0] == "_"):
        clean = "_" + clean
    clean = clean[: MAX_SLOT - len(suffix) - 9]
    return f"{clean}_{digest}{suffix}"


def annotations(chat: ChatPrompt, tenant: str = "default", contexts: dict[str, str] | None = None) -> dict[str, Any]:
    """``kv_transfer_params["kvcomm"]`` for a rendered chat: every shared message's span, in
    order, for the server's reuse engine of ``tenant`` (a server with API keys overrides it).
    ``contexts``: content id -> the retained context (``kvcomm serve``'s context API) that the
    first message with that content names (``"context"`` on its span)."""
    prompt = chat.prompt
    spans, named = [], dict(contexts or {})
    for index in sorted(chat.turn_segments.values()):
        segment, start = prompt.segments[index], prompt.starts[index]
        span = {"start": start, "end": start + len(segment), "slot": wire_slot(segment.slot)}
        if segment.shared_id in named:
            span["context"] = named.pop(segment.shared_id)
        spans.append(span)
    return {"template": prompt.template_id, "tenant": tenant, "segments": spans}


def completion_body(
    model: str, chat: ChatPrompt, max_tokens: int, *, reuse: bool, tenant: str = "default", stream: bool = False,
    contexts: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request for ``chat``'s token ids. Reuse: the annotations
    and a per-tenant ``cache_salt`` (approximate KV only goes to salted requests; `kvcomm
    serve` with API keys replaces both tenant and salt by the key's; ``contexts``: as for
    ``annotations``). Dense (``reuse``
    False): no kvcomm options and no salt, exactly what a plain OpenAI client would send."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(chat.prompt.token_ids), "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True, "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if reuse:
        body["kv_transfer_params"] = {"kvcomm": annotations(chat, tenant, contexts)}
        body["cache_salt"] = f"kvcomm-{tenant}"
    return body


def provenance(
    chat: ChatPrompt, prompt_tokens: int, summary: dict[str, Any] | None, reuse: bool, *,
    cached_tokens: int | None = None, ttft_s: float | None = None, why_unknown: str = "",
) -> Provenance:
    """The call's provenance from the server's ``kv_transfer_params["kvcomm"]`` summary.

    Where the server reported no split (dense call, streamed call, rejected annotations),
    every prompt token counts as computed and the note says why. The counts are kvcomm's plan;
    ``cached_tokens`` (vLLM's ``usage.prompt_tokens_details.cached_tokens``, when the server
    reports it) is vLLM's own count, quoted in the note with what separates the two
    (``cached_note``); ``Provenance.cached_tokens`` is the part of kvcomm's computed tokens that
    vLLM's prefix cache served instead (as the in-process vLLM executor reports it).
    """
    shared = sum(len(chat.prompt.segments[i]) for i in chat.turn_segments.values())
    reused = None if summary is None or "error" in summary else (
        int(summary.get("exact_tokens", 0)) + int(summary.get("estimated_tokens", 0)))
    extra = cached_note(cached_tokens, reused if summary is not None and "exact_tokens" in summary else None,
                        int((summary or {}).get("preamble_tokens", 0) or 0), annotated=reuse)
    if summary is not None and "error" in summary:
        why_unknown = f"server rejected the kvcomm options (served without reuse): {summary['error']}"
        summary = None
    if summary is not None and not {"prompt_tokens", "exact_tokens", "estimated_tokens", "computed_tokens"} <= set(summary):
        why_unknown = f"the server's kvcomm summary lacks token counts: {summary}"
        summary = None
    if summary is None:
        if not why_unknown:
            why_unknown = "dense: no kvcomm options sent" if not reuse else (
                "the server returned no kvcomm provenance (started with --no-plan, or not `kvcomm serve`?)")
        # an annotated request's cached count may hold KV kvcomm loaded: no prefix-cache count to report
        return Provenance(prompt_tokens, 0, 0, prompt_tokens, shared, 0, False, _join(why_unknown, extra), ttft_s,
                          cached_tokens=0 if reuse else cached_tokens or 0)
    exact, estimated = int(summary["exact_tokens"]), int(summary["estimated_tokens"])
    preamble = int(summary.get("preamble_tokens", 0))  # computed before the served pieces, in a request of its own
    end = exact + preamble + estimated
    reused_shared = 0
    for index in chat.turn_segments.values():
        start, stop = chat.prompt.starts[index], chat.prompt.starts[index] + len(chat.prompt.segments[index])
        reused_shared += _overlap(start, stop, 0, exact) + _overlap(start, stop, exact + preamble, end)
    note = _join(str(summary.get("note") or ""), extra)
    return Provenance(
        int(summary["prompt_tokens"]), exact, estimated, int(summary["computed_tokens"]), shared, reused_shared,
        bool(summary.get("fallback", False)), note, ttft_s,
        cached_tokens=max(0, cached_tokens - end) if cached_tokens is not None else 0, preamble_tokens=preamble,
        realigned_tokens=min(estimated, int(summary.get("realigned_tokens", 0) or 0)),
    )


def _overlap(a: int, b: int, c: int, d: int) -> int:
    """Length of ``[a, b) & [c, d)``."""
    return max(0, min(b, d) - max(a, c))


def cached_note(cached: int | None, reused: int | None, preamble: int = 0, annotated: bool = False) -> str:
    """vLLM's cached count next to kvcomm's, saying which is which. vLLM's ``cached_tokens`` are
    the prompt tokens vLLM did not compute in this request: its own prefix-cache hit (under
    kvcomm's salt its blocks may hold KV kvcomm wrote earlier, estimated included), which
    covers a preamble (``preamble``: computed by the preamble request the server ran first), plus
    the KV kvcomm's connector loaded past that hit. kvcomm's exact + estimated (``reused``) are
    what its plan served; the plan does not see vLLM's hit, so where the hit reaches further
    than the plan and its preamble, vLLM computed fewer tokens than kvcomm's computed count says:
    that excess is ``Provenance.cached_tokens``, and the note names the same number. Without
    kvcomm's split (``reused`` None) of an ``annotated`` request (e.g. a streamed one) the count
    cannot be told apart, and the note says so in words the reason keeps."""
    if cached is None:
        return ""
    if reused is None and annotated:
        return "" if not cached else (f"vLLM did not compute {cached:,} of the prompt tokens (its prefix cache or KV kvcomm loaded "
                "served them; this response has no split)")
    if reused is None:
        return f"vLLM cached_tokens {cached}: vLLM's prefix-cache hit (kvcomm reported no split)"
    planned = reused + preamble
    note = (f"vLLM cached_tokens {cached} (vLLM's prefix-cache hit plus KV kvcomm loaded past it) vs kvcomm's plan "
            f"{reused} exact+estimated" + (f" + {preamble} preamble (computed by the preamble request)" if preamble else ""))
    if cached > planned:
        note += f": {cached - planned} of kvcomm's computed tokens were a vLLM prefix-cache hit"
    elif cached < planned:
        note += f": vLLM counts {planned - cached} fewer than kvcomm's plan served"
    return note


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def kvcomm_summary(response: dict[str, Any]) -> dict[str, Any] | None:
    params = response.get("kv_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("kvcomm"), dict):
        return params["kvcomm"]
    return None


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details")
    return int(details["cached_tokens"]) if isinstance(details, dict) and details.get("cached_tokens") is not None else None


def ttft_seconds(response: dict[str, Any]) -> float | None:
    """Server-measured TTFT (``--enable-per-request-metrics``), seconds: vLLM's, from when the
    engine scheduled the request to its first token, so it leaves out what came before (the
    queue, kvcomm's planning and the preamble request it ran first). ``end_to_end_ttft`` is the caller's."""
    metrics = response.get("metrics")
    value = metrics.get("time_to_first_token_ms") if isinstance(metrics, dict) else None
    return float(value) / 1e3 if value is not None else None


def end_to_end_ttft(response: dict[str, Any], elapsed_s: float) -> float | None:
    """Seconds from the start of the client's call to the first reply token, for a response
    that arrived whole ``elapsed_s`` after the call started: ``elapsed_s`` less the server's
    decode interval (vLLM's ``generation_time_ms``, first to last output token). What is left
    is everything before the first token, whatever the server did (queue, planning, a computed
    preamble's request), plus sending the finished response back. None without the server's
    per-request metrics (``kvcomm serve --disable-log-stats``). A streamed call measures its
    first token directly (``StreamedCompletion.first_token_at``)."""
    metrics = response.get("metrics")
    decode = metrics.get("generation_time_ms") if isinstance(metrics, dict) else None
    if decode is None:
        return None
    return max(0.0, elapsed_s - float(decode) / 1e3)


class StreamedCompletion:
    """Accumulates a streamed completion into the shape of a non-streamed response."""

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.metrics: dict[str, Any] | None = None
        self.contexts: dict[str, str] | None = None
        """The ``x-kvcomm-contexts`` header: context id -> "live" or "fallback"."""
        self.first_token_at: float | None = None
        """``perf_counter()`` when the first chunk with a reply token (or text) arrived."""

    def add(self, chunk: dict[str, Any]) -> str:
        if self.first_token_at is None and any(c.get("token_ids") or c.get("text") for c in chunk.get("choices") or []):
            self.first_token_at = time.perf_counter()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("metrics"):
            self.metrics = chunk["metrics"]
        text = ""
        for choice in chunk.get("choices") or []:
            text += choice.get("text") or ""
            self.token_ids += choice.get("token_ids") or []
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.text.append(text)
        return text

    def response(self) -> dict[str, Any]:
        choice = {"text": "".join(self.text), "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        return {"choices": [choice], "usage": self.usage, "metrics": self.metrics, "contexts": self.contexts}
