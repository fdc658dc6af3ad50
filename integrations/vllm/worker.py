"""The kvcomm connector's worker side: checks every attention layer and learns its cache layout
at start-up (``register_kv_caches``: ``vllm.refusals``, ``vllm.layout``, ``vllm.rotary``), then
does each step's device work: writes the injected KV before a layer runs, gathers the captured
KV after it ran, stamps when a prompt's last token was computed. At the end of every step it
learns from finished annotated requests and plans new ones (``vllm.worker_plans``), answering
the scheduler side (``vllm.scheduler``) through the worker metadata (``vllm.messages``).

The KV to inject and the captured KV are found on the engine's ``Channel`` under each
``StepRequest``'s handle. Hooks receive the step's bound ``KvcommMetadata`` from the connector.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcomm.core.rope import RopeError
from kvcomm.integrations.vllm.channel import Capture, Channel
from kvcomm.integrations.vllm.layout import KvIO, LayoutError
from kvcomm.integrations.vllm.messages import KvcommMetadata, KvcommWorkerMetadata, StepRequest
from kvcomm.integrations.vllm.refusals import apply_refusal, layer_refusal, refusal_of_any_rank
from kvcomm.integrations.vllm.worker_plans import WorkerPlans

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

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


class KvcommConnectorWorker:
    """The worker-side hooks of ``KvcommConnector`` (see the module docstring).

    refused: why the connector is off (None: on); the engine configuration's refusal at first,
    then also any layer's, the layout self-check's or the rotary self-check's, on any rank.
    """

    def __init__(self, vllm_config: "VllmConfig", channel: Channel, refused: str | None, strict: bool):
        self._vllm_config = vllm_config
        self.channel = channel
        self._strict = strict
        self.refused = refused
        apply_refusal(channel, refused, strict)
        self._io: dict[str, KvIO] = {}
        self._layer_index: dict[str, int] = {}
        self._device_steps: list[_DeviceStep] = []
        self._work_meta: KvcommMetadata | None = None
        self._device: torch.device | None = None
        self._plans = WorkerPlans(vllm_config, channel)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check every attention layer and learn its cache layout (start-up, once); on any
        refusal the connector goes inert (``refusals.apply_refusal``)."""
        self.channel.refusal = self.refused
        if self.refused is not None:
            return
        try:
            self._register(kv_caches)
            from kvcomm.integrations.vllm.rotary import served_rotary

            self.channel.rotary, self.channel.rope_check = served_rotary(self._vllm_config)
        except (LayoutError, RopeError) as error:
            self.refused = str(error)
        self.refused = refusal_of_any_rank(self.refused, self._vllm_config)
        apply_refusal(self.channel, self.refused, self._strict)

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

    def _work(self, meta: "KVConnectorMetadata") -> list[_DeviceStep]:
        """This step's work on the cache's device, prepared once per bound metadata by whichever
        hook of the step runs first: the injected KV and slot lists moved there (one copy per
        tensor; pinned and asynchronous on accelerators). Empty when the connector is off."""
        if self._work_meta is meta:
            return self._device_steps
        assert isinstance(meta, KvcommMetadata)
        self._work_meta, self._device_steps = meta, []
        if self.refused is not None:
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

    def wait_for_layer_load(self, layer_name: str, meta: "KVConnectorMetadata") -> None:
        """Write the layer's injected KV into its cache before the layer runs."""
        work = self._work(meta)
        if not work:
            return
        io = self._io[layer_name]
        layer = self._layer_index[layer_name]
        for item in work:
            if item.keys is not None:
                io.write(item.keys[layer], item.values[layer], item.load_slots)

    def save_kv_layer(self, layer_name: str, meta: "KVConnectorMetadata") -> None:
        """After the layer ran, gather its KV at the capture slots into the capture buffers."""
        work = self._work(meta)
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

    def build_connector_worker_meta(self, meta: "KVConnectorMetadata | None") -> KvcommWorkerMetadata | None:
        """End of every step (also steps with nothing scheduled): learn from the requests that
        finished, then plan the new annotated ones; their answers go to the scheduler."""
        if not isinstance(meta, KvcommMetadata) or not (meta.asks or meta.finished):
            return None
        for done in meta.finished:
            self._plans.finish(done)
        answers = {ask.req_id: self._plans.answer(ask, self.refused) for ask in meta.asks}
        return KvcommWorkerMetadata(answers) if answers else None

    def wait_for_save(self, meta: "KVConnectorMetadata | None") -> None:
        """End of the step's forward: mark the captured positions filled and stamp the prompts
        whose last token was computed (after waiting for the device: the TTFT end point)."""
        if meta is None:
            return
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
