"""kvcomm's vLLM V1 KV connector: inject reused KV, capture real KV, on any standard backend.

Load it with ``KVTransferConfig(kv_connector="KvcommConnector", kv_role="kv_both",
kv_connector_module_path="kvcomm.integrations.vllm.connector")`` (``vllm.llm.make_llm``
does). No patching of vLLM.

Per request, an ``Order`` says which KV to inject for prompt positions ``[0, P)`` and which
positions' real KV to capture. It comes from one of two places (``kv_transfer_params["kvcomm"]``,
see ``vllm.params``):

- **Annotated requests** (``kvcomm serve``, ``plan`` on): planned in the worker, which owns the
  ``ServerPlanner`` and every tensor (``vllm.worker_plans``); the scheduler side sends only
  metadata (``vllm.messages``). The first lookup answers vLLM "not yet" (``None``) and puts a
  ``PlanAsk`` in the step's metadata; the worker plans at the end of that step
  (``build_connector_worker_meta``, which vLLM also runs on steps with nothing scheduled) and
  answers the inject length through the worker metadata (``update_connector_output``); the
  next lookup claims the tokens. When the request finishes its reply ids go down in a
  ``Finished`` and the worker learns. Works with the worker in the engine-core process
  (``uni``) or in a process of its own (``mp``, vLLM's default).
- **In-process orders** (``handle``, placed on the process's ``Channel`` by callers such as
  ``VllmExecutor``): need the caller, scheduler and worker in one process.

- Scheduler side: ``get_num_new_matched_tokens`` claims ``P - h`` tokens beyond vLLM's own
  prefix hit ``h`` (0 when ``h >= P``); ``build_connector_meta`` turns each scheduled
  request's loads and captures into slot lists from its current block table.
- Worker side: the first hook of a step moves the step's injected KV and slot lists to the
  KV cache's device (one copy per tensor per step); ``wait_for_layer_load`` writes a layer's
  injected KV with the layer's own ``impl.do_kv_cache_update`` before the layer runs;
  ``save_kv_layer`` gathers the layer's KV at the capture slots after it ran into a capture
  buffer on the same device (``vllm.layout``: no layout is hand-coded, nothing goes
  through the host per layer); ``wait_for_save`` stamps when a prompt's last token was
  computed, after waiting for the device (the TTFT end point).

Tensor parallelism: every rank's worker gets the same metadata, holds its own heads of every
base, anchor, exact prefix and capture, and plans and learns the same requests in lockstep;
decisions that read KV are made from per-head partials gathered over vLLM's tensor-parallel
CPU group (``kvcomm.core.heads``), so all ranks decide as one process holding every head would.
Only KV of this rank's heads is ever injected or captured on it.

CUDA graphs: full-graph replay would skip the per-layer hooks, so
``requires_piecewise_for_cudagraph`` is True and vLLM runs piecewise graphs (or eager).

Refusals happen at start-up, never inside a forward (``vllm.refusals``,
the layout self-check, ``vllm.rotary``'s RoPE self-check against vLLM's own rotary module):
rotary embeddings kvcomm cannot realign exactly, unsupported attention backends (MLA and any
backend without ``do_kv_cache_update``), sliding-window, chunked-local or hybrid layers, more than one KV
cache group, KV sharing between layers, quantized (fp8) KV caches, pipeline parallelism > 1,
tensor parallelism that would replicate KV heads, executors other than ``uni`` and ``mp``
(under tensor parallelism a refusal on any rank turns every rank off). A refused connector stays
loaded but inert: requests that do not opt in are served exactly as by stock vLLM, and
requests that opt in are served without reuse, their ``kv_transfer_params["kvcomm"]["error"]``
saying why. With ``kv_connector_extra_config={"strict": true}`` the engine fails to start
instead, with the same message.

Requests without ``kv_transfer_params["kvcomm"]`` are not touched: nothing claimed, nothing
loaded, nothing captured. Backends read against vLLM 0.32's source and covered by
``benchmarks/gpu_check.py``: CPU_ATTN (tested in CI), FLASH_ATTN, TRITON_ATTN, FLASHINFER
(GPU untested unless that check was run).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from kvcomm.core.rope import RopeError
from kvcomm.reuse.config import DEFAULT_REUSE_SCOPE, scope_settings
from kvcomm.integrations.vllm.channel import Capture, Channel, channel
from kvcomm.integrations.vllm.layout import KvIO, LayoutError
from kvcomm.integrations.vllm.messages import Finished, KvcommMetadata, KvcommWorkerMetadata, PlanAsk, StepRequest, handle_of
from kvcomm.integrations.vllm.metrics import record_rejected, record_served
from kvcomm.integrations.vllm.params import KvcommParamsError, parse_params
from kvcomm.integrations.vllm.refusals import config_refusal, layer_refusal, refusal_of_any_rank
from kvcomm.integrations.vllm.worker_plans import WorkerPlans

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")

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
    first_step: bool = True


@dataclass
class _DeviceStep:
    """A step's work for one request, on the KV cache's device.

    keys/values: injected KV ``[layers, N, kv_heads, head_dim]`` (cache dtype, contiguous
    per layer) for ``load_slots`` (``[N]``), or None; capture_slots ``[M]`` and
    capture_positions ``[M]`` (positions index the capture buffer, also on the device).
    read_indices: where the capture slots' KV is stored, per layer geometry (``KvIO.geometry``;
    computed by the first layer of each, reused by the rest).
    """

    step: StepRequest
    keys: torch.Tensor | None
    values: torch.Tensor | None
    load_slots: torch.Tensor
    capture_slots: torch.Tensor
    capture_positions: torch.Tensor
    read_indices: dict = field(default_factory=dict)


_EMPTY = torch.zeros(0, dtype=torch.int64)


class KvcommConnector(KVConnectorBase_V1):
    """Both roles of kvcomm's connector; see the module docstring."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always True: the connector writes and reads KV in per-layer hooks, which full CUDA
        graph replay would skip (the injected KV would never be written)."""
        return True

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.channel: Channel = channel(self.engine_id)
        self._strict = bool(self._kv_transfer_config.get_from_extra_config("strict", False))
        scope_settings(self._kv_transfer_config.get_from_extra_config("reuse_scope", DEFAULT_REUSE_SCOPE))  # refuse an unknown one now
        parallel = vllm_config.parallel_config
        groups = None if kv_cache_config is None else kv_cache_config.kv_cache_groups
        model = vllm_config.model_config
        self._refused = config_refusal(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                       parallel.distributed_executor_backend, vllm_config.cache_config.cache_dtype, groups,
                                       None if model is None else model.get_total_num_kv_heads())
        if self._refused is None and role == KVConnectorRole.SCHEDULER:
            self._refused = self.channel.refusal  # the worker side (same process) registered its layers first
        self._refuse_if_needed()
        self._tracked: dict[str, _Tracked] = {}
        self._rejected: dict[str, str] = {}
        self._io: dict[str, KvIO] = {}
        self._layer_index: dict[str, int] = {}
        self._device_steps: list[_DeviceStep] = []
        self._work_meta: KvcommMetadata | None = None
        self._device: torch.device | None = None
        self._plan = bool(self._kv_transfer_config.get_from_extra_config("plan", False))
        self._asks: list[PlanAsk] = []
        self._finished: list[Finished] = []
        self._asked: set[str] = set()  # annotated requests whose plan was asked of the worker, until they finish
        self._plans = WorkerPlans(vllm_config, self.channel)
        slots = self._kv_transfer_config.get_from_extra_config("slots", None)
        self._known_slots = None if slots is None else frozenset(slots)

    def _refuse_if_needed(self) -> None:
        if self._refused is None:
            return
        self.channel.refusal = self._refused
        if self._strict:
            raise ValueError(f"kvcomm connector: {self._refused}")
        logger.warning("kvcomm connector is off for this engine: %s. Requests without kvcomm options are served as "
                       "usual; requests with them are served without reuse and get this message as their error.",
                       self._refused)

    @property
    def refused(self) -> str | None:
        """Why this connector is off (None: it is on)."""
        return self._refused

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the connector supplies beyond vLLM's hit; None ("ask again") while the worker
        has not answered an annotated request's plan yet."""
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        if tracked.pending:
            return None, False
        tracked.hit = num_computed_tokens
        return max(0, tracked.inject - num_computed_tokens), False

    def _track(self, request: "Request") -> _Tracked | None:
        if request.request_id in self._tracked:
            return self._tracked[request.request_id]
        if request.request_id in self._rejected:
            return None
        if self._refused is not None:
            if isinstance(request.kv_transfer_params, dict) and "kvcomm" in request.kv_transfer_params:
                self._rejected[request.request_id] = f"kvcomm is off in this engine: {self._refused}"
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
        self._asked.add(request.request_id)
        self._asks.append(PlanAsk(request.request_id, tuple(request.prompt_token_ids), params,
                                  request.cache_salt is not None, request.max_tokens))
        return _Tracked(handle_of(request.request_id), n, capture_to=n + request.max_tokens, planned=True, pending=True)

    def update_connector_output(self, connector_output) -> None:
        """Take the worker's plan answers: claimable tokens, capture start, summary, or error."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvcommWorkerMetadata):
            return
        for req_id, answer in meta.answers.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue  # finished (aborted) before its answer came back
            if answer.error is not None:
                del self._tracked[req_id]
                self._reject(req_id, answer.error)
                continue
            tracked.inject, tracked.capture_from, tracked.summary = answer.inject_length, answer.capture_from, answer.summary
            tracked.pending = False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.load_start, tracked.load_count = tracked.hit, num_external_tokens
        tracked.first_step = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcommMetadata(asks=self._asks, finished=self._finished)
        self._asks, self._finished = [], []
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
            if not tracked.planned and self.channel.order(tracked.handle) is None:
                continue  # the in-process caller took its order back
            blocks = torch.tensor(self._kv_cache_manager.get_block_ids(req_id)[0], dtype=torch.int64)
            start = computed[req_id]
            load = _EMPTY
            if tracked.load_count:
                load = torch.arange(tracked.load_start, tracked.load_start + tracked.load_count)
                tracked.load_count = 0
            end = min(start + count, tracked.capture_to)
            low = tracked.capture_from if tracked.first_step else max(tracked.capture_from, start)
            capture = torch.arange(low, end) if end > low else _EMPTY
            tracked.first_step = False
            meta.requests.append(StepRequest(
                tracked.handle, load, _slots(blocks, load, block_size), capture, _slots(blocks, capture, block_size),
                tracked.capture_to, start < tracked.prompt_len <= start + count,
            ))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        error = self._rejected.pop(request.request_id, None)
        asked = request.request_id in self._asked
        self._asked.discard(request.request_id)
        if error:
            if asked:  # the worker may hold its plan (e.g. ranks that disagreed): let it forget, learning nothing
                self._finished.append(Finished(request.request_id, ()))
            return False, {"kvcomm": {"error": error}}
        if tracked is None or not tracked.planned:
            return False, None
        reply = list(request.output_token_ids)
        stops = set(request.sampling_params.all_stop_token_ids) if request.sampling_params else set()
        if reply and reply[-1] in stops:
            reply.pop()
        self._finished.append(Finished(request.request_id, tuple(reply)))  # the worker learns from it
        if tracked.summary is None:
            return False, None  # aborted before the worker answered its plan
        if request.num_computed_tokens >= tracked.prompt_len:
            record_served(tracked.summary)  # here, before the response leaves; the worker learns a step later
        return False, {"kvcomm": tracked.summary}

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check every attention layer and learn its cache layout (start-up, once); on any
        refusal the connector goes inert (see the module docstring)."""
        self.channel.refusal = self._refused
        if self._refused is not None:
            return
        try:
            self._register(kv_caches)
            from kvcomm.integrations.vllm.rotary import served_rotary

            self.channel.rotary, self.channel.rope_check = served_rotary(self._vllm_config)
        except (LayoutError, RopeError) as error:
            self._refused = str(error)
        self._refused = refusal_of_any_rank(self._refused, self._vllm_config)
        self._refuse_if_needed()

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        for name, cache in kv_caches.items():
            found = _LAYER_INDEX.search(name)
            if found is None:
                raise LayoutError(f"cannot tell the decoder layer index of attention layer {name!r}")
            layer = layers.get(name)
            if layer is None:
                raise LayoutError(f"attention layer {name!r} has a KV cache but no module in vLLM's forward context")
            reason = layer_refusal(name, layer)
            if reason is not None:
                raise LayoutError(reason)
            self._layer_index[name] = int(found.group(1))
            self._io[name] = KvIO(layer, cache)
        if sorted(self._layer_index.values()) != list(range(len(kv_caches))):
            raise LayoutError(f"attention layers are not numbered 0..{len(kv_caches) - 1}: {sorted(self._layer_index)}")
        devices = {io.device for io in self._io.values()}
        if len(devices) != 1:
            raise LayoutError(f"attention layers' KV caches are on several devices ({sorted(map(str, devices))})")
        self._device = devices.pop()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Nothing to start: vLLM calls this after the forward on steps without synchronous
        loads, so the step's work is prepared by whichever hook runs first (``_work``)."""
        return

    def _work(self) -> list[_DeviceStep]:
        """This step's work on the cache's device, prepared once per bound metadata: the
        injected KV and slot lists moved there (one copy per tensor; pinned and asynchronous
        on accelerators). Empty when the connector is off."""
        meta = self._get_connector_metadata()
        if self._work_meta is meta:
            return self._device_steps
        assert isinstance(meta, KvcommMetadata)
        self._work_meta, self._device_steps = meta, []
        if self._refused is not None:
            return self._device_steps
        device = self._device
        dtype = next(iter(self._io.values())).dtype
        for step in meta.requests:
            keys = values = None
            if step.load_positions.numel():
                order = self.channel.order(step.handle)
                if order is None or order.inject is None:
                    raise RuntimeError(f"kvcomm: the order for {step.handle!r} vanished before its KV was loaded")
                # [layers, heads, P, dim] -> [layers, N, heads, dim], one copy to the device per tensor
                keys = _to_device(order.inject.keys[:, :, step.load_positions].transpose(1, 2), device, dtype)
                values = _to_device(order.inject.values[:, :, step.load_positions].transpose(1, 2), device, dtype)
            self._device_steps.append(_DeviceStep(
                step, keys, values, _to_device(step.load_slots, device), _to_device(step.capture_slots, device),
                _to_device(step.capture_positions, device),
            ))
        return self._device_steps

    def wait_for_layer_load(self, layer_name: str) -> None:
        work = self._work()
        if not work:
            return
        io = self._io[layer_name]
        layer = self._layer_index[layer_name]
        for item in work:
            if item.keys is not None:
                io.write(item.keys[layer], item.values[layer], item.load_slots)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        work = self._work()
        if not work:
            return
        io = self._io[layer_name]
        layer = self._layer_index[layer_name]
        for item in work:
            if item.capture_slots.numel() == 0:
                continue
            index = item.read_indices.get(io.geometry)
            if index is None:
                index = item.read_indices[io.geometry] = io.read_index(item.capture_slots)
            keys, values = io.read_at(index)
            capture = self._capture(item.step, keys)
            capture.keys[layer].index_copy_(1, item.capture_positions, keys.transpose(0, 1).to(capture.keys.dtype))
            capture.values[layer].index_copy_(1, item.capture_positions, values.transpose(0, 1).to(capture.values.dtype))

    def _capture(self, step: StepRequest, like: torch.Tensor) -> Capture:
        with self.channel.lock:
            capture = self.channel.captures.get(step.handle)
            if capture is None:
                _, heads, dim = like.shape
                capture = Capture.empty(len(self._io), heads, step.capture_capacity, dim, like.dtype, like.device)
                self.channel.captures[step.handle] = capture
            return capture

    def build_connector_worker_meta(self) -> KvcommWorkerMetadata | None:
        """End of every step (also steps with nothing scheduled): learn from the requests that
        finished, then plan the new annotated ones; their answers go to the scheduler."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcommMetadata) or not (meta.asks or meta.finished):
            return None
        for done in meta.finished:
            self._plans.finish(done)
        answers = {ask.req_id: self._plans.answer(ask, self._refused) for ask in meta.asks}
        return KvcommWorkerMetadata(answers) if answers else None

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcommMetadata)
        self._work_meta, self._device_steps = None, []
        if not meta.requests:
            return
        if any(step.prompt_done for step in meta.requests) and self._device is not None and self._device.type != "cpu":
            torch.accelerator.synchronize(self._device)  # the prompt's last token is computed, not just queued
        now = time.perf_counter()
        with self.channel.lock:
            for step in meta.requests:
                capture = self.channel.captures.get(step.handle)
                if capture is not None and step.capture_positions.numel():
                    capture.filled[step.capture_positions] = True
                if step.prompt_done:
                    self.channel.prompt_done_at[step.handle] = now


def _to_device(tensor: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (and ``dtype``), contiguous; from pinned memory and without
    blocking the host when the device is an accelerator."""
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if device is None or device.type == "cpu":
        return tensor.contiguous()
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


def _slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token ``positions`` given the request's block ids."""
    if positions.numel() == 0:
        return _EMPTY
    return blocks[positions // block_size] * block_size + positions % block_size
