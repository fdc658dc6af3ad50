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
from kvcomm.integrations.vllm.messages import KvcommMetadata, KvcommWorkerMetadata, StepRequest
from kvcomm.integrations.vllm.refusals import apply_refusal, engine_refusal, layer_refusal, refusal_of_any_rank
from kvcomm.integrations.vllm.scheduler import KvcommConnectorScheduler
from kvcomm.integrations.vllm.worker_plans import WorkerPlans

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")

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
        self._refused = engine_refusal(vllm_config, kv_cache_config)
        self.connector_scheduler: KvcommConnectorScheduler | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvcommConnectorScheduler(vllm_config, kv_cache_config, self.channel,
                                                                self._refused, self._strict)
            return
        apply_refusal(self.channel, self._refused, self._strict)
        self._io: dict[str, KvIO] = {}
        self._layer_index: dict[str, int] = {}
        self._device_steps: list[_DeviceStep] = []
        self._work_meta: KvcommMetadata | None = None
        self._device: torch.device | None = None
        self._plans = WorkerPlans(vllm_config, self.channel)

    @property
    def refused(self) -> str | None:
        """Why this connector is off (None: it is on)."""
        return self._refused if self.connector_scheduler is None else self.connector_scheduler.refused

    # -- scheduler side ----------------------------------------------------------------------

    @property
    def scheduler(self) -> KvcommConnectorScheduler:
        assert self.connector_scheduler is not None
        return self.connector_scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

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
        apply_refusal(self.channel, self._refused, self._strict)

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
