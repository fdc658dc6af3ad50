"""One in-process chat backend shared by the AutoGen and AG2 clients: executor + reuse engine.

Every agent of a team talks to the same backend, so one agent's reply KV (registered as a
base when it is produced) and the anchors its context builds up serve the next agent. A
call renders the conversation per message (``local.segments``), runs ``run_agent`` (plan,
materialize, generate, learn, register the reply as a base) and logs where the prompt's KV
came from. Calls are serialized: the executor runs one request at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from kvcomm.reuse.config import ReuseConfig

from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.executor import OnToken
from kvcomm.reuse.handles import ContextHandle, ContextRegistry
from kvcomm.reuse.plan import Provenance
from kvcomm.services.quality_guard import QualityGuard
from kvcomm.reuse.runner import run_agent
from kvcomm.core.segments import Segment, content_id
from kvcomm.integrations.local.segments import ChatPrompt, ChatTurn, parse_tool_calls, render_chat, supports_tools
from kvcomm.integrations.local.summary import summarize

FinishReason = str  # "stop" | "length" | "function_calls" | "cancelled"


@dataclass(frozen=True)
class ChatCall:
    """Where one completion's prompt KV came from, and what it produced.

    provenance: exact / estimated / computed prompt tokens (they add up to ``prompt_tokens``),
        fallback, note, TTFT (seconds from the call's start to its first reply token: rendering,
        planning and any preamble included). ``reason``: the same in plain words.
    template_id: the agent (hash of its system message). agent: the calling agent's name: what
        its client was told (AutoGen: the team participant that is calling, or ``agent_name=``;
        AG2: ``agent_name=`` at ``register_model_client``), else the name on the agent's own earlier
        replies in this conversation (AutoGen ``source``, AG2 ``name``), else None.
    reply_registered: this call kept its reply's decode KV as the base of the reply's text, so
        its readers reuse it without computing it. True only under a reuse scope that takes
        replies' bases from their decode (``all``, ``content``; not the default
        ``all-reader-replies``, where the reply's first reader computes it and that KV becomes
        its base), for a call whose prompt had nothing estimated, and a reply whose text
        re-tokenizes to the same ids. A reply cut by ``max_tokens`` counts like one that
        stopped: in process the executor feeds its last token back, and a remote client asks
        the server for one token more and keeps ``max_tokens`` (``RemoteChatBackend``), so
        every kept token's KV exists. In process and remotely alike (remotely the server's
        response says whether it keeps the decode KV: ``kv_transfer_params.kvcomm.reply_base``).
        False without reuse and for a streamed remote call (vLLM streams no kvcomm summary).
    contexts: for each ``context_id`` the call named, "hit" (retained and its tokens' KV served
        from stored KV), "unused" (retained, but this call reused none of its tokens: the plan
        stopped before the message, ``provenance.note`` says why), "fallback" (released or
        evicted: recomputed from the text) or "absent" (no message carries it).
    latency_s: wall seconds of the whole call.
    slots: per shared message, its slot (``"{author}#{k}"``) -> (tokens whose KV was reused,
        exact or estimated; tokens in the message).
    """

    template_id: str
    agent: str | None
    provenance: Provenance
    completion_tokens: int
    finish_reason: FinishReason
    reply_registered: bool
    latency_s: float
    contexts: dict[str, str] = field(default_factory=dict)
    render_note: str = ""
    slots: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.provenance.prompt_tokens

    @property
    def reason(self) -> str:
        """What this call reused and why the rest was computed, in words (``Provenance.reason``)."""
        return self.provenance.reason


@dataclass(frozen=True)
class ChatReply:
    """text: the reply, tool-call blocks removed when ``tool_calls`` were parsed out of it.
    tool_calls: ``{"name", "arguments" (JSON string)}`` dicts."""

    text: str
    reply_ids: tuple[int, ...]
    call: ChatCall
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


ANCHOR_BYTES = 256 << 20
"""Default cap on the anchor pools of one ``ChatBackend`` (bytes, all pools together)."""


class Cancelled(Exception):
    """The caller cancelled a completion while it was decoding."""


class ChatBackend:
    """executor: a ``TransformersExecutor`` (anything with ``.tokenizer`` and the executor
    protocol). engine: a ``ReuseEngine`` for reuse, None for dense prefill. max_new_tokens:
    default reply budget. base_bytes: LRU bound on bases of unretained shared content.
    max_log: how many recent calls ``calls`` keeps (and ``summary`` totals). max_context:
    prompt + reply token limit (default: the model's, from its config or vLLM's). guard: a
    ``QualityGuard`` (dense twins) for every call with reuse; export it with
    ``kvcomm.integrations.local.guard_metrics.export``.

    anchor_bytes: cap on the bytes all anchor pools of ``engine`` hold together (default
    ``ANCHOR_BYTES``; None: unbounded). Chat slots are named per author and message index
    (``local.segments``), so every new message of a conversation opens a pool of its own and
    a per-pool V bound does not bound the total. After every call (and ``retain``) the
    largest pool gives up one anchor by its own eviction rule until the total fits, and
    pools left empty are dropped (unless ``guard`` tracks their slot), so the number of
    pools stays bounded too. Invariant between calls: ``anchor_pool_bytes <= anchor_bytes``.
    ``anchor_evictions`` counts the anchors this cap evicted."""

    def __init__(
        self, executor, engine: ReuseEngine | None = None, max_new_tokens: int = 128, base_bytes: int | None = 256 << 20,
        max_log: int = 10_000, max_context: int | None = None, guard: QualityGuard | None = None,
        anchor_bytes: int | None = ANCHOR_BYTES,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if max_log < 1:
            raise ValueError(f"max_log must be >= 1 (got {max_log})")
        if anchor_bytes is not None and (isinstance(anchor_bytes, bool) or not isinstance(anchor_bytes, int) or anchor_bytes < 0):
            raise ValueError(f"anchor_bytes must be a number of bytes >= 0, or None for no cap (got {anchor_bytes!r})")
        self.anchor_bytes = anchor_bytes
        self.anchor_evictions = 0
        self.executor = executor
        self.engine = engine
        self.guard = guard
        self.max_new_tokens = max_new_tokens
        self.contexts = ContextRegistry(engine, base_bytes) if engine is not None else None
        self.calls: deque[ChatCall] = deque(maxlen=max_log)
        self._lock = threading.RLock()
        config = getattr(getattr(executor, "model", None), "config", None)
        self.max_context = max_context or _context_length(executor)
        self.model_name = str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or "kvcomm")

    @classmethod
    def embedded(cls, reuse: bool = True, config: ReuseConfig | None = None, **options) -> "ChatBackend":
        """The embedded SmolLM2-135M-Instruct; ``reuse=False`` runs it dense."""
        from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
        from kvcomm.integrations.transformers.executor import TransformersExecutor

        executor = TransformersExecutor(*load_model_and_tokenizer(), dense_only=not reuse)
        engine = ReuseEngine(executor.rotary, config) if reuse else None
        return cls(executor, engine, **options)

    @property
    def supports_tools(self) -> bool:
        return supports_tools(self.executor.tokenizer)

    @property
    def last(self) -> ChatCall | None:
        return self.calls[-1] if self.calls else None

    # -- prompts ---------------------------------------------------------------------------

    def render(self, turns: Sequence[ChatTurn], tools: Sequence[dict] | None = None) -> ChatPrompt:
        return render_chat(self.executor.tokenizer, self.executor.encode, turns, tools)

    def count_tokens(self, turns: Sequence[ChatTurn], tools: Sequence[dict] | None = None) -> int:
        return len(self.render(turns, tools).prompt)

    # -- context handles -------------------------------------------------------------------

    def retain(self, text: str) -> ContextHandle:
        """Prefill ``text`` (as a message's content) now and keep its KV until ``release``.

        Without reuse the handle is still valid (releasing and fallback work the same); it
        just holds nothing."""
        ids = tuple(self.executor.encode(text))
        if not ids:
            raise ValueError("cannot retain empty text: it has no tokens")
        segment = Segment(ids, slot="_")
        if self.contexts is None:
            return ContextHandle(segment.shared_id, len(ids))
        with self._lock:
            handle = self.contexts.retain(segment, self.executor.base_kv)
            self._cap_anchors()
            return handle

    def release(self, handle: ContextHandle | str) -> bool:
        if self.contexts is None:
            return False
        with self._lock:
            return self.contexts.release(handle)

    # -- completion ------------------------------------------------------------------------

    def complete(
        self, turns: Sequence[ChatTurn], *, tools: Sequence[dict] | None = None, max_new_tokens: int | None = None,
        on_token: OnToken | None = None, context_ids: Sequence[str] = (), agent: str | None = None,
    ) -> ChatReply:
        """One greedy completion of ``turns``. agent: the calling agent's name (``ChatCall.agent``;
        None: the author of the last assistant turn, if any). Raises ``Cancelled`` when
        ``on_token`` returned False (the call is still logged, and what it learned is kept: all
        its KV is real)."""
        budget = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if budget < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {budget})")
        started = time.perf_counter()
        with self._lock:
            chat = self.render(turns, tools)
            prompt = chat.prompt
            if len(prompt) + budget > self.max_context:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens + {budget} new tokens exceeds the model's context of "
                    f"{self.max_context}; shorten the conversation (e.g. a BufferedChatCompletionContext) or max_tokens"
                )
            live = self._live_contexts(chat, context_ids)
            stopped = []

            def watch(token: int) -> bool | None:
                if on_token is not None and on_token(token) is False:
                    stopped.append(True)
                    return False
                return None

            # executors without streaming support still serve callers that pass no on_token
            hook = watch if on_token is not None else None
            call = run_agent if self.guard is None else self.guard.run_agent
            ahead = time.perf_counter() - started  # waiting for the lock and rendering: part of the caller's wait
            generation, provenance = call(self.executor, self.engine, prompt, budget, on_token=hook)
            provenance = _from_call_start(provenance, ahead)
            self._cap_anchors()
            text = self.executor.decode(generation.reply_ids)
            registered = self._keep_reply(generation, text, provenance)
            self._note_bases(chat, generation)
            tool_calls, text_out = parse_tool_calls(text) if tools else ([], text)
            if stopped:
                reason = "cancelled"
            elif tool_calls:
                reason = "function_calls"
            else:
                reason = "length" if len(generation.reply_ids) >= budget else "stop"
            contexts = context_report(chat, provenance, context_ids, live)
            call = ChatCall(
                prompt.template_id, calling_agent(turns, agent), provenance, len(generation.reply_ids), reason, registered,
                time.perf_counter() - started, contexts, chat.note, slot_reuse(chat, provenance),
            )
            self.calls.append(call)
        if stopped:
            raise Cancelled(f"cancelled after {len(generation.reply_ids)} tokens")
        return ChatReply(text_out, generation.reply_ids, call, tool_calls)

    @property
    def anchor_pool_bytes(self) -> int:
        """Bytes held by all anchor pools of the engine (0 without reuse)."""
        if self.engine is None:
            return 0
        with self.engine._lock:
            return sum(pool.nbytes for pool in self.engine.pools.values())

    def _cap_anchors(self) -> int:
        """Apply ``anchor_bytes`` (see the class docstring); returns the anchors evicted."""
        if self.engine is None:
            return 0
        evicted = 0
        with self.engine._lock:
            pools = self.engine.pools
            if self.anchor_bytes is not None:
                held = sum(pool.nbytes for pool in pools.values())
                while held > self.anchor_bytes:
                    pool = max((p for p in pools.values() if len(p)), key=lambda p: p.nbytes, default=None)
                    if pool is None:
                        break
                    before = pool.nbytes
                    if pool.evict() is None:
                        break
                    held -= before - pool.nbytes
                    evicted += 1
            tracked = self.guard.slots if self.guard is not None else {}
            for slot in [s for s, pool in pools.items() if not len(pool) and s not in tracked]:
                del pools[slot]
        self.anchor_evictions += evicted
        return evicted

    def _keep_reply(self, generation, text: str, provenance: Provenance) -> bool:
        """``ChatCall.reply_registered``: whether this call kept its reply's decode KV as the base
        of its text. The engine learned it (``ReuseEngine.learn``) when its scope takes replies'
        bases from their decode and the prompt had nothing estimated (``learns_reply_from``: no
        estimated token, recomputed ones included); it is kept only if readers will tokenize
        the text to the same ids. A base of the same text from elsewhere (a reader that
        computed an identical earlier reply) does not make this call's reply registered."""
        if self.engine is None or not generation.reply_ids or not self.engine.uses_bases:
            return False
        shared_id = content_id(generation.reply_ids)
        if tuple(self.executor.encode(text)) != generation.reply_ids:
            self.engine.drop_base(shared_id)
            return False
        learned = self.engine.scope.decode_reply_bases and provenance.estimated_tokens + provenance.recomputed_tokens == 0
        return learned and self.engine.has_base(shared_id)

    def _note_bases(self, chat: ChatPrompt, generation) -> None:
        """Tell the registry which bases this call used or made (sizes from the KV's
        bytes per token), most recent last, so its LRU bound can drop the oldest."""
        if self.contexts is None or generation.computed.length == 0:
            return
        per_token = generation.computed.nbytes // generation.computed.length
        segments = [chat.prompt.segments[i] for i in chat.turn_segments.values()]
        if generation.reply_ids:
            segments.append(Segment(generation.reply_ids, slot="_"))
        for segment in segments:
            if self.engine.has_base(segment.shared_id):
                self.contexts.note(segment.shared_id, per_token * len(segment))
        self.contexts.touch([s.shared_id for s in segments])

    def _live_contexts(self, chat: ChatPrompt, context_ids: Sequence[str]) -> set[str]:
        """The named handles whose KV is held before the call (its plan may still not use it)."""
        present = set(chat.shared_ids)
        return {c for c in context_ids if c in present and self.contexts is not None and self.contexts.state(c) == "live"}

    def summary(self, baseline: Any = None) -> dict[str, Any]:
        """Totals, times and per-agent figures over the logged calls (``local.summary.summarize``);
        ``baseline``: the same team's summary from another client (e.g. ``reuse=False``), or that client."""
        with self._lock:
            return summarize(list(self.calls), baseline)


def _from_call_start(provenance: Provenance, ahead: float) -> Provenance:
    """``provenance`` with its TTFT and planning time counted from the start of ``complete``
    (``ahead``: seconds spent there before ``run_agent`` started) instead of ``run_agent``'s."""
    ttft = None if provenance.ttft_s is None else provenance.ttft_s + ahead
    plan = None if provenance.plan_s is None else provenance.plan_s + ahead
    return replace(provenance, ttft_s=ttft, plan_s=plan)


def context_report(chat: ChatPrompt, provenance: Provenance, context_ids: Sequence[str], live: set[str]) -> dict[str, str]:
    """``ChatCall.contexts``: "absent" when no message carries the id; "fallback" when its KV
    was not held (released or evicted); else "hit" when this call served some of its tokens
    from stored KV, "unused" when the plan reused none of them (e.g. it stopped at an agent's
    new system message before the message: ``provenance.note``)."""
    present = set(chat.shared_ids)
    end, prompt = provenance.reuse_end, chat.prompt
    reused = {prompt.segments[i].shared_id for i in chat.turn_segments.values() if prompt.starts[i] < end}
    report = {}
    for context_id in context_ids:
        if context_id not in present:
            report[context_id] = "absent"
        elif context_id not in live:
            report[context_id] = "fallback"
        else:
            report[context_id] = "hit" if context_id in reused else "unused"
    return report


def calling_agent(turns: Sequence[ChatTurn], agent: str | None) -> str | None:
    """``ChatCall.agent``: the name the client was given, else the author of the last assistant turn."""
    if agent:
        return agent
    return next((t.source for t in reversed(turns) if t.role == "assistant" and t.source), None)


def reply_budget(options: Any, where: str) -> int | None:
    """The reply budget in ``options`` (a mapping): ``max_tokens``, the one name the clients use
    in process and remotely; ``max_new_tokens`` is accepted as a deprecated alias (a
    ``DeprecationWarning``), and both with different values is a ``ValueError``. ``where``
    names the place for messages (e.g. "extra_create_args")."""
    import warnings

    budget, alias = options.get("max_tokens"), options.get("max_new_tokens")
    if alias is None:
        return budget
    if budget is not None and int(budget) != int(alias):
        raise ValueError(f"{where} gives max_tokens={budget} and max_new_tokens={alias}; give only max_tokens (the reply budget)")
    warnings.warn(f"{where}: max_new_tokens is a deprecated alias of max_tokens (the reply budget); use max_tokens",
                  DeprecationWarning, stacklevel=3)
    return alias if budget is None else budget


def slot_reuse(chat: ChatPrompt, provenance: Provenance) -> dict[str, tuple[int, int]]:
    """Slot -> (reused tokens, tokens) for every shared message: reuse is a prefix of the
    prompt (``[0, reuse_end)``), so a message's reused tokens are its part of that prefix."""
    end, prompt = provenance.reuse_end, chat.prompt
    out = {}
    for index in chat.turn_segments.values():
        segment, start = prompt.segments[index], prompt.starts[index]
        out[segment.slot] = (max(0, min(end - start, len(segment))), len(segment))
    return out


def _context_length(executor) -> int:
    """The model's context in tokens: transformers' ``max_position_embeddings``, else vLLM's
    ``max_model_len``, else 2048."""
    config = getattr(getattr(executor, "model", None), "config", None)
    if getattr(config, "max_position_embeddings", None):
        return int(config.max_position_embeddings)
    llm = getattr(executor, "llm", None)
    if llm is not None:
        return int(llm.llm_engine.vllm_config.model_config.max_model_len)
    return 2048
