"""The kvcomm connector's scheduler side: which opted-in requests it tracks, how many prompt
tokens it claims beyond vLLM's own prefix hit, and each step's ``KvcommMetadata`` for the
worker side (``vllm.connector.worker``). It never holds a tensor of KV.

A request opts in with ``kv_transfer_params["kvcomm"]`` (``vllm.wire.params``). An in-process order
(``handle``) is read from the engine's ``Channel``; an annotated request is planned by the worker:
the first lookup answers vLLM "not yet" and queues a ``PlanAsk``, the worker's ``PlanAnswer``
arrives through ``update_connector_output``, and the next lookup claims the tokens
(``vllm.wire.messages``). When the request finishes its reply goes down in a ``Finished`` and its
summary (or error) goes back in its ``kv_transfer_params``.

Captured KV (an annotated request's or an in-process order's positions ``capture_from`` to
``capture_to``, prompt and reply) is copied once, when the request finishes: ``request_finished``
asks vLLM to keep the request's blocks (delay-free True), the next step's metadata names them
(``FinalCapture``: block ids and positions), and the worker copies them in one go and reports the
request finished-sending, which frees them. Nothing is copied while the request runs: a
preempted request gives its blocks back and computes them again when it resumes, so the KV that
exists at the end is the KV its reply was decoded with. A request that finishes with nothing to
capture (aborted before its plan came back or while preempted, an in-process caller that took its
order back, a rejected request) is freed at once.

Capture memory is admitted here: the worker keeps an annotated request's real KV, every layer,
keys and values (``capture_bytes_per_token`` a position), on the KV device and outside vLLM's KV
budget, for the positions learning needs (``PlanAnswer.capture_from`` to ``capture_to``: the
prompt's computed tail, and the reply only when the scope learns its decode KV).
``max_capture_bytes`` (``vllm.wire.config``, default ``DEFAULT_MAX_CAPTURE_BYTES``)
bounds the captures of all requests in flight together: a request is reserved prompt +
``max_tokens`` positions when asked for, cut to its plan's capture when the answer comes, and
released when the worker reports it let the capture go (``KvcommWorkerMetadata.released``:
learned from, which may be some steps after its ``Finished`` went down, ``vllm.planning.worker_plans``).
A request that would not fit is not planned: it is served as stock vLLM serves it, the reason
in its ``kv_transfer_params``.

vLLM's own prefix hit and learning: the worker learns from the KV of positions ``capture_from``
on, as if computed. Where vLLM's prefix cache serves some of them (its hit reaches past
``capture_from``), those blocks may hold approximate KV: KV kvcomm injected with estimates, or KV
computed after it, in an earlier opted-in request with the same salt (and so in the same
tenant). The scheduler remembers the block hashes of such requests (every full block from the
first loaded one on, up to ``MAX_APPROXIMATE_BLOCKS``, oldest forgotten first); a request whose
hit past ``capture_from`` touches one of them learns nothing from its prompt (its capture starts
at the hit, so the worker finds the prompt incomplete), and its note says so. Hits on blocks of
requests that reused exactly or computed everything are learned from as before.

LoRA adapters: an opted-in request under an adapter (vLLM's ``request.lora_request``) is
planned in its tenant's engine for that adapter (``adapter_identity``, carried in its
``PlanAsk``; ``kvcomm.services.tenants.adapter_key``): KV computed under one adapter never
serves another adapter or the base model, requests under the same adapter reuse each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import hashlib
import os
from collections import OrderedDict

import torch
from vllm.logger import init_logger

from kvcomm.integrations.vllm.wire.channel import Channel
from kvcomm.integrations.vllm.wire.config import ConnectorConfig
from kvcomm.integrations.vllm.wire.messages import (
    FinalCapture, Finished, KvcommMetadata, KvcommWorkerMetadata, PlanAsk, StepRequest, handle_of,
)
from kvcomm.integrations.vllm.planning.metrics import record_rejected, record_served
from kvcomm.integrations.vllm.wire.params import KvcommParamsError, parse_params, shown
from kvcomm.integrations.vllm.connector.refusals import apply_refusal

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
_EMPTY = torch.zeros(0, dtype=torch.int64)


def capture_bytes_per_token(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes the worker's capture holds per position: keys and values of every attention layer
    this process holds (a full-attention page is ``2 * block_size * kv_heads * head_dim * dtype``)."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += len(group.layer_names) * (spec.page_size_bytes // spec.block_size)
    return total


MAX_APPROXIMATE_BLOCKS = 1 << 16
"""Block hashes of blocks that may hold approximate KV remembered (about 2 MiB)."""
_ADAPTER_DIGESTS: dict[tuple, str] = {}


def adapter_identity(lora) -> str | None:
    """Who an adapter is, for keying stored KV: ``<digest>`` of its name, its path and, when the
    path is a folder, its files' names, sizes and modification times (so an adapter whose
    weights were replaced at the same path and name is another adapter; a restart with the
    same files is the same one). 24 hex characters; None for no adapter."""
    if lora is None:
        return None
    path = str(getattr(lora, "lora_path", None) or getattr(lora, "path", "") or "")
    files: tuple = ()
    if path and os.path.isdir(path):
        with os.scandir(path) as entries:
            files = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file()))
    key = (str(getattr(lora, "lora_name", "")), path, files)
    if key not in _ADAPTER_DIGESTS:
        _ADAPTER_DIGESTS[key] = hashlib.blake2b(repr(key).encode("utf-8"), digest_size=12).hexdigest()
    return _ADAPTER_DIGESTS[key]


@dataclass
class _Tracked:
    """Scheduler-side state of one opted-in request (until it finishes).

    inject: prompt positions ``[0, inject)`` the connector supplies; capture_from, capture_to:
    prompt+output positions whose real KV the worker keeps. ``planned``: an annotated request
    (planned by the worker; ``pending`` until its answer came back, ``summary`` from it);
    otherwise an in-process order read from the channel.
    """

    handle: str
    prompt_len: int
    inject: int = 0
    capture_from: int = 0
    capture_to: int = 0
    planned: bool = False
    pending: bool = False
    summary: dict | None = None
    hit: int = 0  # vLLM's own (block-aligned) prefix hit, as last offered to us
    load_start: int = 0
    load_count: int = 0
    loaded_from: int | None = None  # the first position the connector loaded (None: nothing loaded)


class KvcommConnectorScheduler:
    """The scheduler-side hooks of ``KvcommConnector`` (see the module docstring).

    refused: why the connector is off (None: on); here the engine configuration's refusal, else
    the one the worker side recorded on the channel (in one process it registered its layers
    first). ``config``: the connector's settings. ``kv_cache_manager`` is bound by the connector
    once vLLM built it.
    """

    def __init__(self, kv_cache_config: "KVCacheConfig", channel: Channel, refused: str | None,
                 config: ConnectorConfig):
        self.channel = channel
        self.refused = refused if refused is not None else channel.refusal
        apply_refusal(channel, self.refused, config.strict)
        self.kv_cache_manager: KVCacheManager | None = None
        self._kv_cache_config = kv_cache_config
        self._plan = config.plan
        self.max_capture_bytes = config.max_capture_bytes
        self._token_bytes = capture_bytes_per_token(kv_cache_config)
        self._known_slots = config.slots
        self._tracked: dict[str, _Tracked] = {}
        self._rejected: dict[str, str] = {}
        self._asks: list[PlanAsk] = []
        self._finished: list[Finished] = []
        self._final: list[FinalCapture] = []
        self._asked: set[str] = set()  # annotated requests whose plan was asked of the worker, until they finish
        self._capture_held: dict[str, int] = {}  # bytes of capture reserved per request id
        self._approximate: OrderedDict = OrderedDict()  # block hash -> None: blocks that may hold approximate KV

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the connector supplies beyond vLLM's hit; None ("ask again") while the worker
        has not answered an annotated request's plan yet."""
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        if tracked.pending:
            return None, False
        tracked.hit = num_computed_tokens
        if tracked.planned and num_computed_tokens > tracked.capture_from and self._hits_approximate(request, tracked):
            tracked.capture_from = num_computed_tokens  # the prompt stays incomplete: nothing learned from it
            if tracked.summary is not None and "approximate" not in tracked.summary.get("note", ""):
                tracked.summary = {**tracked.summary, "note": (tracked.summary.get("note") or "") + (
                    "; vLLM's prefix cache served planned-computed positions from blocks that may hold approximate "
                    "KV: not learned from")}
        return max(0, tracked.inject - num_computed_tokens), False

    def _hits_approximate(self, request: "Request", tracked: _Tracked) -> bool:
        """Whether vLLM's hit past ``capture_from`` covers a block that may hold approximate KV."""
        block_size = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        hashes = getattr(request, "block_hashes", None) or []
        first, last = tracked.capture_from // block_size, min(tracked.hit // block_size, len(hashes))
        return any(hashes[i] in self._approximate for i in range(first, last))

    def _remember_approximate(self, request: "Request", tracked: _Tracked) -> None:
        """The request's full blocks from the first loaded one on may hold approximate KV (loaded
        with estimates, or computed after them); remember their hashes."""
        block_size = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        for block_hash in (getattr(request, "block_hashes", None) or [])[tracked.loaded_from // block_size:]:
            self._approximate[block_hash] = None
            self._approximate.move_to_end(block_hash)
        while len(self._approximate) > MAX_APPROXIMATE_BLOCKS:
            self._approximate.popitem(last=False)

    def _track(self, request: "Request") -> _Tracked | None:
        if request.request_id in self._tracked:
            return self._tracked[request.request_id]
        if request.request_id in self._rejected:
            return None
        if self.refused is not None:
            if isinstance(request.kv_transfer_params, dict) and "kvcomm" in request.kv_transfer_params:
                self._rejected[request.request_id] = f"kvcomm is off in this engine: {self.refused}"
                record_rejected()
            return None
        try:
            params = parse_params(request.kv_transfer_params, request.num_prompt_tokens, self._known_slots)
            if params is None:
                return None
            if params.handle is not None:
                order = self.channel.order(params.handle)
                if order is None:
                    raise KvcommParamsError(
                        f"kv_transfer_params.kvcomm.handle {params.handle!r} names no pending order of this "
                        "engine (handles come from in-process callers such as VllmExecutor, in the engine's process)"
                    )
                if getattr(request, "lora_request", None) is not None:
                    raise KvcommParamsError(
                        "served without reuse: an in-process order's KV is not keyed by LoRA adapter "
                        f"(this request uses {shown(getattr(request.lora_request, 'lora_name', '?'))})")
                inject = 0 if order.inject is None else order.inject.length
                tracked = _Tracked(params.handle, request.num_prompt_tokens, inject, order.capture_from, order.capture_to)
            else:
                tracked = self._ask_plan(request, params)
        except KvcommParamsError as error:
            self._reject(request.request_id, str(error))
            return None
        self._tracked[request.request_id] = tracked
        return tracked

    def _reject(self, req_id: str, error: str) -> None:
        """This request only: no reuse, the error travels back in its kv_transfer_params."""
        self._rejected[req_id] = error
        record_rejected()
        logger.warning("kvcomm: request %s gets no reuse: %s", req_id, error)

    def _ask_plan(self, request: "Request", params) -> _Tracked:
        """Queue the request's plan for the worker (sent with this step's metadata)."""
        if not self._plan:
            raise KvcommParamsError(
                "server-side planning is off in this engine; start it with `kvcomm serve` or set "
                'kv_connector_extra_config={"plan": true}'
            )
        n = request.num_prompt_tokens
        needed = (n + request.max_tokens) * self._token_bytes
        if needed > self.max_capture_bytes:
            raise KvcommParamsError(
                f"served without reuse: learning from this request would capture {needed} bytes of KV "
                f"({n} prompt + {request.max_tokens} max_tokens positions x {self._token_bytes} bytes), over "
                f"max_capture_bytes {self.max_capture_bytes}; lower max_tokens or raise the budget")
        held = self.capture_bytes_held
        if held + needed > self.max_capture_bytes:
            raise KvcommParamsError(
                f"served without reuse: requests in flight hold {held} bytes of captured KV, and this one's "
                f"{needed} would exceed max_capture_bytes {self.max_capture_bytes}; retry later, lower max_tokens, "
                "or raise the budget")
        self._capture_held[request.request_id] = needed
        self._asked.add(request.request_id)
        adapter = adapter_identity(getattr(request, "lora_request", None))
        self._asks.append(PlanAsk(request.request_id, tuple(request.prompt_token_ids), params,
                                  request.cache_salt is not None, request.max_tokens, adapter))
        return _Tracked(handle_of(request.request_id), n, capture_to=n + request.max_tokens, planned=True, pending=True)

    @property
    def capture_bytes_held(self) -> int:
        """Bytes of captured KV reserved for requests in flight (at most ``max_capture_bytes``)."""
        return sum(self._capture_held.values())

    def update_connector_output(self, connector_output) -> None:
        """Take the worker's plan answers: claimable tokens, capture start, summary, or error."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvcommWorkerMetadata):
            return
        for req_id in meta.released:
            self._capture_held.pop(req_id, None)
        for req_id, answer in meta.answers.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue  # finished (aborted) before its answer came back
            if answer.error is not None:
                del self._tracked[req_id]
                self._reject(req_id, answer.error)
                continue
            tracked.inject, tracked.capture_from, tracked.summary = answer.inject_length, answer.capture_from, answer.summary
            if answer.capture_to is not None:
                tracked.capture_to = answer.capture_to
            if req_id in self._capture_held:
                self._capture_held[req_id] = max(0, tracked.capture_to - tracked.capture_from) * self._token_bytes
            tracked.pending = False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.load_start, tracked.load_count = tracked.hit, num_external_tokens
        if num_external_tokens:
            tracked.loaded_from = tracked.hit

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvcommMetadata:
        """The step's metadata: per scheduled tracked request that loads or computes its last
        prompt token, a ``StepRequest`` (decode steps send nothing); the final captures, asks
        and finished requests queued since the last step."""
        meta = KvcommMetadata(asks=self._asks, finished=self._finished, final=self._final)
        self._asks, self._finished, self._final = [], [], []
        if not self._tracked:
            return meta
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        block_size = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.pending:
                continue
            start = computed[req_id]
            prompt_done = start < tracked.prompt_len <= start + count
            if not (tracked.load_count or prompt_done):
                continue
            if not tracked.planned and self.channel.order(tracked.handle) is None:
                continue  # the in-process caller took its order back
            load, slots = _EMPTY, _EMPTY
            if tracked.load_count:
                load = torch.arange(tracked.load_start, tracked.load_start + tracked.load_count)
                blocks = torch.tensor(self.kv_cache_manager.get_block_ids(req_id)[0], dtype=torch.int64)
                slots = _slots(blocks, load, block_size)
                tracked.load_count = 0
            meta.requests.append(StepRequest(tracked.handle, load, slots, prompt_done))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` (``block_ids``: the request's blocks of its one KV cache
        group). Returns (delay the blocks' free: a ``FinalCapture`` of them goes down with the
        next step's metadata, and the worker frees them; kv_transfer_params to return)."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None and tracked.loaded_from is not None and (
                not tracked.planned or (tracked.summary or {}).get("estimated_tokens", 1) > 0):
            self._remember_approximate(request, tracked)  # an in-process order's KV: unknown, so counted
        error = self._rejected.pop(request.request_id, None)
        asked = request.request_id in self._asked
        self._asked.discard(request.request_id)
        if error:
            if asked:  # the worker may hold its plan (e.g. ranks that disagreed): let it forget, learning nothing
                self._finished.append(Finished(request.request_id, ()))
            else:
                self._capture_held.pop(request.request_id, None)
            return False, {"kvcomm": {"error": error}}
        delay = tracked is not None and self._capture_at_finish(request, tracked, block_ids)
        if tracked is None or not tracked.planned:
            return delay, None
        # The last sampled token is never fed back, so its KV does not exist: a stop token is
        # dropped from the reply, and so is the last token of a reply cut by max_tokens (the
        # remote chat clients ask for one token more than they keep, so the reply they pass on
        # is the part whose KV exists and becomes its base).
        reply = list(request.output_token_ids)[:-1]
        self._finished.append(Finished(request.request_id, tuple(reply)))  # the worker learns from it
        if tracked.summary is None:
            return delay, None  # aborted before the worker answered its plan (delay is False: nothing captured)
        if request.num_computed_tokens >= tracked.prompt_len:
            record_served(tracked.summary)  # here, before the response leaves; the worker learns a step later
        return delay, {"kvcomm": tracked.summary}

    def _capture_at_finish(self, request: "Request", tracked: _Tracked, block_ids: list[int]) -> bool:
        """Queue the finished request's ``FinalCapture``: positions ``capture_from`` up to what
        was computed (``num_computed_tokens``: the last sampled token is never fed back) or
        ``capture_to``. False (free the blocks now) when there is nothing to capture."""
        if tracked.pending or (not tracked.planned and self.channel.order(tracked.handle) is None):
            return False  # no plan yet, or the in-process caller took its order back
        block_size = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        end = min(request.num_computed_tokens, tracked.capture_to, len(block_ids) * block_size)
        if end <= tracked.capture_from:
            return False  # nothing computed to keep (e.g. preempted: its blocks are gone)
        self._final.append(FinalCapture(request.request_id, tracked.handle, tuple(block_ids), block_size,
                                        tracked.capture_from, end))
        if not tracked.planned:
            self.channel.expect_final(tracked.handle)  # the in-process caller steps the engine until it is copied
        return True


def _slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token ``positions`` given the request's block ids."""
    if positions.numel() == 0:
        return _EMPTY
    return blocks[positions // block_size] * block_size + positions % block_size
