"""kvcomm's vLLM V1 KV connector: inject reused KV, capture real KV.

Load it with ``KVTransferConfig(kv_connector="KvcommConnector", kv_role="kv_both",
kv_connector_module_path="kvcomm.integrations.vllm_connector")`` (``vllm_engine.make_llm``
does). No patching of vLLM.

Per request, the caller's ``Order`` (found through ``kv_transfer_params["kvcomm"]``, see
``vllm_params``) says which KV to inject for prompt positions ``[0, P)`` and which
positions' real KV to capture.

- Scheduler side: ``get_num_new_matched_tokens`` claims ``P - h`` tokens beyond vLLM's own
  prefix hit ``h`` (0 when ``h >= P``); ``build_connector_meta`` turns each scheduled
  request's loads and captures into slot lists from its current block table.
- Worker side: ``wait_for_layer_load`` writes a layer's injected KV with the attention
  backend's own op before the layer runs; ``save_kv_layer`` reads back the layer's KV at the
  capture slots after it ran (the tokens computed this step, or read from vLLM's prefix cache
  on the request's first step); ``wait_for_save`` stamps when a prompt's last token was
  computed (the first token's logits follow; the TTFT end point).

Requests without ``kv_transfer_params["kvcomm"]`` are not touched: nothing claimed, nothing
loaded, nothing captured. Only tensor parallelism 1 is supported (scheduler and worker share
one process); only vLLM's CPU attention backend is supported and tested (GPU is untested).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from kvcomm.integrations.vllm_channel import Capture, Channel, channel
from kvcomm.integrations.vllm_layout import read_slots, write_slots
from kvcomm.integrations.vllm_metrics import record_rejected
from kvcomm.integrations.vllm_params import KvcommParamsError, parse_params
from kvcomm.integrations.vllm_planner import PlannedRequest, ServerPlanner

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
class StepRequest:
    """One request's connector work in one engine step.

    load_positions/load_slots: prompt positions to inject (``[N]`` int64) and their cache
    slots. capture_positions/capture_slots: positions whose KV to read after each layer.
    prompt_done: this step computes the request's last prompt token.
    """

    handle: str
    load_positions: torch.Tensor
    load_slots: torch.Tensor
    capture_positions: torch.Tensor
    capture_slots: torch.Tensor
    capture_capacity: int
    prompt_done: bool


@dataclass
class KvcommMetadata(KVConnectorMetadata):
    requests: list[StepRequest] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one opted-in request (until it finishes); ``planned`` is set
    for requests planned here from annotations (server side), None for in-process orders."""

    handle: str
    prompt_len: int
    planned: "PlannedRequest | None" = None
    hit: int = 0  # vLLM's own (block-aligned) prefix hit, as last offered to us
    load_start: int = 0
    load_count: int = 0
    first_step: bool = True


_EMPTY = torch.zeros(0, dtype=torch.int64)


class KvcommConnector(KVConnectorBase_V1):
    """Both roles of kvcomm's connector; see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("the kvcomm connector supports tensor and pipeline parallel size 1 only")
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend not in (None, "uni"):
            # Scheduler and worker sides exchange orders and captured KV in memory (vllm_channel).
            raise ValueError(
                f"the kvcomm connector needs vLLM's worker in the engine-core process, but the executor backend is "
                f"{backend!r}; on CPU set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM builds its config "
                "(`kvcomm serve` and make_llm do), elsewhere pass distributed_executor_backend='uni'"
            )
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.channel: Channel = channel(self.engine_id)
        self._tracked: dict[str, _Tracked] = {}
        self._rejected: dict[str, str] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._isa: dict[str, str] = {}
        self._plan = bool(self._kv_transfer_config.get_from_extra_config("plan", False))
        self._planner: ServerPlanner | None = None
        slots = self._kv_transfer_config.get_from_extra_config("slots", None)
        self._known_slots = None if slots is None else frozenset(slots)

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        order = self.channel.order(tracked.handle)
        tracked.hit = num_computed_tokens
        inject = 0 if order is None or order.inject is None else order.inject.length
        return max(0, inject - num_computed_tokens), False

    def _track(self, request: "Request") -> _Tracked | None:
        if request.request_id in self._tracked:
            return self._tracked[request.request_id]
        if request.request_id in self._rejected:
            return None
        try:
            params = parse_params(request.kv_transfer_params, request.num_prompt_tokens, self._known_slots)
            if params is None:
                return None
            if params.handle is not None:
                if self.channel.order(params.handle) is None:
                    raise KvcommParamsError(
                        f"kv_transfer_params.kvcomm.handle {params.handle!r} names no pending order of this "
                        "engine (handles come from in-process callers such as VllmExecutor)"
                    )
                tracked = _Tracked(params.handle, request.num_prompt_tokens)
            else:
                tracked = self._plan_request(request, params)
        except KvcommParamsError as error:
            # This request only: no reuse, the error travels back in its kv_transfer_params.
            self._rejected[request.request_id] = str(error)
            record_rejected()
            logger.warning("kvcomm: request %s gets no reuse: %s", request.request_id, error)
            return None
        except Exception as error:  # a planning failure must not take the engine down
            logger.exception("kvcomm: planning request %s failed; serving it without reuse", request.request_id)
            self._rejected[request.request_id] = f"kvcomm planning failed ({type(error).__name__}: {error}); served without reuse"
            record_rejected()
            return None
        self._tracked[request.request_id] = tracked
        return tracked

    def _plan_request(self, request: "Request", params) -> _Tracked:
        if not self._plan:
            raise KvcommParamsError(
                "server-side planning is off in this engine; start it with `kvcomm serve` or set "
                'kv_connector_extra_config={"plan": true}'
            )
        if self._planner is None:
            self._planner = _make_planner(self._vllm_config)
        planned = self._planner.prepare(
            list(request.prompt_token_ids), params, salted=request.cache_salt is not None, max_tokens=request.max_tokens,
        )
        handle = f"request-{request.request_id}"
        self.channel.place(handle, planned.order)
        return _Tracked(handle, request.num_prompt_tokens, planned)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.load_start, tracked.load_count = tracked.hit, num_external_tokens
        tracked.first_step = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcommMetadata()
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        block_size = self._block_size()
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            order = self.channel.order(tracked.handle)
            if order is None:
                continue
            blocks = torch.tensor(self._kv_cache_manager.get_block_ids(req_id)[0], dtype=torch.int64)
            start = computed[req_id]
            load = _EMPTY
            if tracked.load_count:
                load = torch.arange(tracked.load_start, tracked.load_start + tracked.load_count)
                tracked.load_count = 0
            end = min(start + count, order.capture_to)
            low = order.capture_from if tracked.first_step else max(order.capture_from, start)
            capture = torch.arange(low, end) if end > low else _EMPTY
            tracked.first_step = False
            meta.requests.append(StepRequest(
                tracked.handle, load, _slots(blocks, load, block_size), capture, _slots(blocks, capture, block_size),
                order.capture_to, start < tracked.prompt_len <= start + count,
            ))
        return meta

    def _block_size(self) -> int:
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"the kvcomm connector supports one KV cache group, this model has {len(groups)}")
        return groups[0].kv_cache_spec.block_size

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        error = self._rejected.pop(request.request_id, None)
        if error:
            return False, {"kvcomm": {"error": error}}
        if tracked is None or tracked.planned is None:
            return False, None
        capture, _ = self.channel.take(tracked.handle)
        reply = list(request.output_token_ids)
        stops = set(request.sampling_params.all_stop_token_ids) if request.sampling_params else set()
        if reply and reply[-1] in stops:
            reply.pop()
        self._planner.finish(tracked.planned, capture, reply)
        return False, {"kvcomm": tracked.planned.summary()}

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            found = _LAYER_INDEX.search(name)
            if found is None:
                raise ValueError(f"cannot tell the decoder layer index of attention layer {name!r}")
            self._layer_index[name] = int(found.group(1))
            self._caches[name] = cache
        if sorted(self._layer_index.values()) != list(range(len(kv_caches))):
            raise ValueError(f"attention layers are not numbered 0..{len(kv_caches) - 1}: {sorted(self._layer_index)}")

    def _layer_isa(self, layer_name: str, forward_context: "ForwardContext | None" = None) -> str:
        if layer_name not in self._isa:
            from vllm.forward_context import get_forward_context

            context = forward_context or get_forward_context()
            isa = getattr(context.no_compile_layers[layer_name], "isa", None)
            if isa is None:
                raise RuntimeError(f"attention layer {layer_name} has no CPU attention ISA; the kvcomm connector supports vLLM's CPU backend only")
            self._isa[layer_name] = isa
        return self._isa[layer_name]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # loads are written layer by layer in wait_for_layer_load, before each layer runs

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcommMetadata)
        for step in meta.requests:
            if step.load_positions.numel() == 0:
                continue
            order = self.channel.order(step.handle)
            if order is None or order.inject is None:
                raise RuntimeError(f"kvcomm: the order for {step.handle!r} vanished before its KV was loaded")
            layer = self._layer_index[layer_name]
            keys = order.inject.keys[layer][:, step.load_positions].transpose(0, 1)
            values = order.inject.values[layer][:, step.load_positions].transpose(0, 1)
            write_slots(self._caches[layer_name], keys, values, step.load_slots, self._layer_isa(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcommMetadata)
        for step in meta.requests:
            if step.capture_positions.numel() == 0:
                continue
            keys, values = read_slots(kv_layer, step.capture_slots, self._layer_isa(layer_name))
            capture = self._capture(step, keys)
            layer = self._layer_index[layer_name]
            capture.keys[layer][:, step.capture_positions] = keys.transpose(0, 1).to(capture.keys.dtype)
            capture.values[layer][:, step.capture_positions] = values.transpose(0, 1).to(capture.values.dtype)

    def _capture(self, step: StepRequest, like: torch.Tensor) -> Capture:
        with self.channel.lock:
            capture = self.channel.captures.get(step.handle)
            if capture is None:
                _, heads, dim = like.shape
                capture = Capture.empty(len(self._caches), heads, step.capture_capacity, dim, like.dtype)
                self.channel.captures[step.handle] = capture
            return capture

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcommMetadata)
        now = time.perf_counter()
        with self.channel.lock:
            for step in meta.requests:
                capture = self.channel.captures.get(step.handle)
                if capture is not None and step.capture_positions.numel():
                    capture.filled[step.capture_positions] = True
                if step.prompt_done:
                    self.channel.prompt_done_at[step.handle] = now


def _make_planner(vllm_config: "VllmConfig") -> ServerPlanner:
    """A planner on the served model's own rotary embedding (self-checked on the checkpoint,
    loaded once with transformers, fp32)."""
    from kvcomm.integrations.embedded import load_model_and_tokenizer
    from kvcomm.integrations.hf_rotary import rotary_from_model

    from kvcomm.anchors.pool import PoolConfig
    from kvcomm.engine import ReuseConfig

    model, tokenizer = load_model_and_tokenizer(str(vllm_config.model_config.model))
    rotary, _ = rotary_from_model(model)
    extra = vllm_config.kv_transfer_config
    pool = PoolConfig(gamma=float(extra.get_from_extra_config("gamma", PoolConfig.gamma)),
                      max_anchors=int(extra.get_from_extra_config("max_anchors", PoolConfig.max_anchors)))
    caps = {name: extra.get_from_extra_config(name, None) for name in ("max_total_bytes", "max_tenant_bytes")}
    planner = ServerPlanner(rotary, ReuseConfig(pool=pool), **caps)
    state_dir = extra.get_from_extra_config("state_dir", None)
    if state_dir:
        from kvcomm.fingerprint import model_fingerprint
        from kvcomm.integrations.serve_state import PlannerState

        fingerprint = model_fingerprint(model, tokenizer, rotary, kv_dtype=vllm_config.model_config.dtype)
        state = PlannerState(planner, state_dir, fingerprint, float(extra.get_from_extra_config("save_interval_s", 60.0)))
        state.restore()
        state.start()
    del model
    return planner


def _slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token ``positions`` given the request's block ids."""
    if positions.numel() == 0:
        return _EMPTY
    return blocks[positions // block_size] * block_size + positions % block_size
