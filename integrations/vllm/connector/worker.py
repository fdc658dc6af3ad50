"""The kvcomm connector's worker side: checks every attention layer and learns its cache layout
at start-up (``register_kv_caches``: ``vllm.connector.refusals``, ``vllm.connector.layout``, ``vllm.connector.rotary``), then
does each step's device work: writes the injected KV before a layer runs, stamps when a
prompt's last token was computed, and copies the KV of requests that finished (held by vLLM
until then) into their captures, once per request (``FinalCapture``), reporting them
finished-sending so vLLM frees their blocks. At the end of every step it learns from finished
annotated requests and plans new ones (``vllm.planning.worker_plans``), answering the scheduler side
(``vllm.connector.scheduler``) through the worker metadata (``vllm.wire.messages``).

The KV to inject and the captured KV are found on the engine's ``Channel`` under each
``StepRequest``'s handle. Hooks receive the step's bound ``KvcommMetadata`` from the connector.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcomm.core.copy import copy_tokens
from kvcomm.core.kv_target import KVTarget, Paged
from kvcomm.core.place import Piece, clip, place_all
from kvcomm.core.rope import RopeError
from kvcomm.integrations.vllm.wire.channel import Capture, Channel
from kvcomm.integrations.vllm.wire.config import ConnectorConfig
from kvcomm.integrations.vllm.connector.layout import KvIO, LayoutError
from kvcomm.integrations.vllm.wire.messages import FinalCapture, KvcommMetadata, KvcommWorkerMetadata, StepRequest
from kvcomm.integrations.vllm.connector.refusals import apply_refusal, device_memory_budget, layer_refusal, refusal_of_any_rank
from kvcomm.integrations.vllm.planning.worker_plans import WorkerPlans

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class _DeviceStep:
    """A step's work for one request: the fused writer's pieces for the loaded positions (re-
    indexed to the step's load slots)."""

    step: StepRequest
    pieces: list[Piece]


class DeviceClock:
    """When device work queued now ends, in ``time.perf_counter()`` seconds, without waiting for
    it: an event recorded on the current stream, read (waiting then) when the time is asked for.
    On a CPU the work has ended when it is queued."""

    def __init__(self, device: torch.device):
        self._origin: tuple[object, float] | None = None
        self._device = device

    def now(self):
        """A reading: a float on a CPU, else a callable that returns the time when called."""
        if self._device.type != "cuda":
            return time.perf_counter()
        if self._origin is None:  # one synchronization at the first reading, to tie events to the host clock
            torch.cuda.synchronize(self._device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            origin.synchronize()
            self._origin = (origin, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        origin, at = self._origin

        def read() -> float:
            event.synchronize()
            return at + origin.elapsed_time(event) / 1000

        return read


class KvcommConnectorWorker:
    """The worker-side hooks of ``KvcommConnector`` (see the module docstring).

    refused: why the connector is off (None: on); the engine configuration's refusal at first,
    then also any layer's, the layout self-check's or the rotary self-check's, on any rank.
    config: the connector's settings.
    """

    def __init__(self, vllm_config: "VllmConfig", channel: Channel, refused: str | None, config: ConnectorConfig):
        self._vllm_config = vllm_config
        self._config = config
        self.channel = channel
        self.refused = refused
        apply_refusal(channel, refused, config.strict)
        self._io: dict[str, KvIO] = {}
        self._layer_index: dict[str, int] = {}
        self._paged: Paged | None = None
        self._device_steps: list[_DeviceStep] = []
        self._work_meta: KvcommMetadata | None = None
        self._written = False
        self._finals_meta: KvcommMetadata | None = None
        self._device: torch.device | None = None
        self._clock: DeviceClock | None = None
        self._plans = WorkerPlans(vllm_config, channel, config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check every attention layer and learn its cache layout (start-up, once); on any
        refusal the connector goes inert (``refusals.apply_refusal``)."""
        self.channel.refusal = self.refused
        if self.refused is not None:
            return
        try:
            self._register(kv_caches)
            self.refused = self._memory_refusal()
            from kvcomm.integrations.vllm.connector.rotary import served_rotary

            self.channel.rotary, self.channel.rope_check = served_rotary(self._vllm_config)
        except (LayoutError, RopeError) as error:
            self.refused = self.refused or str(error)
        self.refused = refusal_of_any_rank(self.refused, self._vllm_config)
        if self.refused is None:  # every rank builds its planner (and restores its state) together
            self.refused = refusal_of_any_rank(self._plans.start(), self._vllm_config)
        apply_refusal(self.channel, self.refused, self._config.strict)

    def _memory_refusal(self) -> str | None:
        """``refusals.device_memory_budget`` for this rank's KV device, after vLLM allocated its
        cache; the cap it settles on is the planner's ``max_total_bytes``."""
        free = torch.cuda.mem_get_info(self._device)[0] if self._device.type == "cuda" else None
        cap, refused = device_memory_budget(
            self._device.type, free, self._config.max_total_bytes, self._config.max_capture_bytes,
            self._vllm_config.parallel_config.tensor_parallel_size)
        self._plans.max_total_bytes = cap
        return refused

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
        self._clock = DeviceClock(self._device)
        by_layer = sorted(self._io, key=self._layer_index.get)
        geometries = {self._io[name].geometry for name in by_layer}
        if len(geometries) != 1:
            raise LayoutError("attention layers' KV caches differ in layout; kvcomm writes every layer with one kernel")
        first = self._io[by_layer[0]]
        self._paged = Paged(tuple(self._io[name].kv_cache for name in by_layer), *first.offsets, first.kv_cache.stride(0))

    def _work(self, meta: "KVConnectorMetadata") -> list[_DeviceStep]:
        """This step's work, prepared once per bound metadata by whichever hook of the step runs
        first: per request, the pieces of the injection that fall in the step's load range
        (vLLM's own prefix hit is not written over). Empty when the connector is off."""
        if self._work_meta is meta:
            return self._device_steps
        assert isinstance(meta, KvcommMetadata)
        self._work_meta, self._device_steps, self._written = meta, [], False
        if self.refused is not None:
            return self._device_steps
        for step in meta.requests:
            loaded: list[Piece] = []
            if step.load_positions.numel():
                order = self.channel.order(step.handle)
                if order is None or order.inject is None:
                    raise RuntimeError(f"kvcomm: the order for {step.handle!r} vanished before its KV was loaded")
                start = int(step.load_positions[0])
                loaded = clip(list(order.inject.pieces), start, start + step.load_positions.numel())
            self._device_steps.append(_DeviceStep(step, loaded))
        return self._device_steps

    def wait_for_layer_load(self, layer_name: str, meta: "KVConnectorMetadata") -> None:
        """At the step's first layer, before it runs: write every layer's injected KV into the
        step's load slots (one fused write per piece, all layers at once)."""
        work = self._work(meta)
        if self._written or not work:
            return
        self._written = True
        for item in work:
            if item.pieces:
                place_all(item.pieces, KVTarget.at_slots(self._paged, item.step.load_slots), self.channel.rotary)

    def save_kv_layer(self, layer_name: str, meta: "KVConnectorMetadata") -> None:
        """Nothing per layer: a request's KV is copied once, in the step after it finished (``get_finished``)."""

    def get_finished(self, meta: "KVConnectorMetadata | None") -> set[str]:
        """vLLM's ``get_finished`` (after the step's forward, or alone on a step without one):
        copy the final captures of the requests that finished since the last step, and return
        their request ids, every one of them, copied or not, so that vLLM frees their blocks
        (its finished-sending set; the copies are queued on the device stream before any later
        write to those blocks, so nothing waits for the device)."""
        if not isinstance(meta, KvcommMetadata):
            return set()
        self._copy_finals(meta)
        return {final.req_id for final in meta.final}

    def _copy_finals(self, meta: KvcommMetadata) -> None:
        """Each final capture of the step, once (whichever of ``get_finished`` and
        ``build_connector_worker_meta`` runs first): one copy of every layer's keys and values
        into a capture of exactly its positions, put on the channel. Skipped when the connector
        is off or the order is gone (an in-process caller took it back)."""
        if self._finals_meta is meta:
            return
        self._finals_meta = meta
        for final in meta.final:
            capture = None
            if self.refused is None and self.channel.order(final.handle) is not None:
                capture = self._copy_final(final)
            self.channel.put_final(final.handle, capture)

    def _copy_final(self, final: FinalCapture) -> Capture:
        like = self._paged
        _, heads, dim = like.key_offsets.shape
        count = final.end - final.start
        capture = Capture.empty(len(like.caches), heads, count, dim, like.caches[0].dtype, self._device, start=final.start)
        copy_tokens(KVTarget.at_slots(like, final.slots()), KVTarget.contiguous(capture.kv, 0, count))
        capture.filled.fill_(True)
        return capture

    def build_connector_worker_meta(self, meta: "KVConnectorMetadata | None") -> KvcommWorkerMetadata | None:
        """End of every step (also steps with nothing scheduled): learn from the requests that
        finished (their final captures copied first; within the step's learning budget,
        ``WorkerPlans.learn``), then plan the new annotated ones; their answers and the released
        captures go to the scheduler."""
        if isinstance(meta, KvcommMetadata):
            self._copy_finals(meta)
        asks, finished = (meta.asks, meta.finished) if isinstance(meta, KvcommMetadata) else ([], [])
        for done in finished:
            self._plans.finish(done)
        released = self._plans.learn()
        gone = {done.req_id for done in finished}  # aborted before its plan was made: nothing to plan
        answers = {ask.req_id: self._plans.answer(ask, self.refused) for ask in asks if ask.req_id not in gone}
        return KvcommWorkerMetadata(answers, released) if answers or released else None

    def wait_for_save(self, meta: "KVConnectorMetadata | None") -> None:
        """End of the step's forward: note when the prompts whose last token was computed end on
        the device (the TTFT end point; no wait for the device here). Nothing is copied while a
        request runs: its KV is captured once it finished (``get_finished``)."""
        self._work_meta, self._device_steps = None, []
        if meta is None:
            return
        assert isinstance(meta, KvcommMetadata)
        if not any(step.prompt_done for step in meta.requests):
            return
        done = self._clock.now() if self._clock is not None else time.perf_counter()
        with self.channel.lock:
            for step in meta.requests:
                if step.prompt_done:
                    self.channel.prompt_done_at[step.handle] = done


