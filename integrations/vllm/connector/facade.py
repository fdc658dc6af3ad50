"""kvcomm's vLLM V1 KV connector: injects reused KV and captures real KV on any supported
attention backend, without patching vLLM.

Load it with ``KVTransferConfig(kv_connector="KvcommConnector", kv_role="kv_both",
kv_connector_module_path="kvcomm.integrations.vllm.connector")`` (``vllm.inprocess.llm.make_llm`` and
``kvcomm serve`` do). vLLM builds one ``KvcommConnector`` per role; it hands its hooks to the
object of its side:

    Scheduler side (``scheduler.KvcommConnectorScheduler``): tracks opted-in requests and sends
    the worker metadata only (``messages``).
        get_num_new_matched_tokens() - prompt tokens the connector supplies beyond vLLM's own
            prefix hit; None ("ask again") while an annotated request's plan is pending.
        update_state_after_alloc() - the claimed positions to load once blocks are allocated.
        build_connector_meta() - the step's ``KvcommMetadata``: per scheduled request the
            slots to load; the blocks of requests that finished, to capture; plan asks and
            finished requests for the worker.
        update_connector_output() - takes the worker's plan answers.
        request_finished() / request_finished_all_groups() - the request's summary (or error)
            for its kv_transfer_params; its reply goes down for the worker to learn from. A
            request whose KV is captured (an annotated request's, an in-process order's) keeps
            its blocks (delay-free True) until the worker copied them.

    Worker side (``worker.KvcommConnectorWorker``): holds every tensor.
        register_kv_caches() - checks every attention layer, learns its cache layout, reads
            and self-checks the served model's rotary embedding (start-up, once).
        start_load_kv() - nothing.
        wait_for_layer_load() - at the step's first layer: the fused writer writes every
            layer's injected KV (realigned bases plus the anchors' weighted deviations) into
            the requests' load slots, one kernel per piece.
        save_kv_layer() - nothing.
        wait_for_save() - stamps prompts whose last token was computed (the TTFT end point)
            without waiting for the device.
        get_finished() - copies the KV of the requests that finished since the last step out
            of their held blocks into their captures (every layer, one kernel per request, on
            the cache's device, once per request) and returns them as finished-sending: vLLM
            frees their blocks.
        build_connector_worker_meta() - end of every step: learns from finished annotated
            requests, plans new ones (``worker_plans``), answers the scheduler.

Every hook of both sides is timed per engine step (``step_time``).

Both of vLLM's model runners drive these hooks: V1 and Model Runner V2 (``vllm/v1/worker/gpu``,
vLLM's default wherever Triton runs), which calls ``start_load_kv`` after the forward on steps
without synchronous loads, ``handle_preemptions`` and ``finish_forward`` around it, and the
worker-side hooks alone on steps with nothing scheduled (``no_forward``). The injected KV is
written at the first layer's ``wait_for_layer_load``, inside the forward, in every order.
``SupportsHMA`` is declared (vLLM keeps its hybrid KV cache manager; a running connector has
one KV cache group), and no KV cache layout is required (any is learned). docs/vllm-plugin.md,
"Model Runner V2" and "Hybrid KV cache manager and KV cache layouts".

A vLLM release outside ``versions.TESTED_VLLM`` fails the engine's start-up (unless
``KVCOMM_ALLOW_UNTESTED_VLLM=1``). Refused at start-up, never inside a forward (``refusals``): rotary embeddings kvcomm cannot
realign exactly, attention backends other than CPU_ATTN, FLASH_ATTN, TRITON_ATTN and FLASHINFER
(MLA included), sliding-window, chunked-local or hybrid layers, KV sharing between layers, fp8 KV
caches, pipeline parallelism, tensor parallelism that would replicate KV heads, executors other
than ``uni`` and ``mp``, and on an accelerator a ``max_total_bytes`` that does not fit in the
memory vLLM leaves free (without one the cap is set from that memory). A refused connector stays loaded but inert (requests that opt in get the
reason as their error); with ``kv_connector_extra_config={"strict": true}`` the engine fails to
start instead. Requests without ``kv_transfer_params["kvcomm"]`` are not touched.

The settings (``kv_connector_extra_config``) are read once, when each side's connector is built,
into a ``connector_config.ConnectorConfig``: an unknown key or a bad value fails the start.

How it works (annotated requests and in-process orders, the data path, tensor parallelism, CUDA
graphs) and what is supported: docs/vllm-plugin.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcomm.integrations.vllm.wire.channel import Channel, channel
from kvcomm.integrations.vllm.wire.config import ConnectorConfig
from kvcomm.integrations.vllm.wire.messages import KvcommWorkerMetadata
from kvcomm.integrations.vllm.connector.refusals import engine_refusal
from kvcomm.integrations.vllm.connector.scheduler import KvcommConnectorScheduler
from kvcomm.integrations.vllm.connector.step_time import CLOCKS
from kvcomm.integrations.vllm.connector.versions import check_vllm_version
from kvcomm.integrations.vllm.connector.worker import KvcommConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


_SCHEDULER, _WORKER = CLOCKS["scheduler"], CLOCKS["worker"]


class KvcommConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcomm's connector for one role; see the module docstring.

    Declares ``SupportsHMA`` so that vLLM keeps its hybrid KV cache manager on: on a model whose
    layers all use full attention that manager builds the one KV cache group it would build
    without it, and an engine with more than one group is refused at start-up (``refusals``),
    so the connector only ever runs with one group. Requires no KV cache layout
    (``get_required_kvcache_layout`` stays vLLM's None): the worker learns whichever layout
    vLLM picks at ``register_kv_caches`` (``layout``). Why: docs/decisions.md, 2026-12-07.
    """

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always True: the connector writes and reads KV in per-layer hooks, which full CUDA
        graph replay would skip (the injected KV would never be written)."""
        return True

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        check_vllm_version()  # an untested vLLM fails the start-up (versions.py), before anything reads its API
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_transfer(self._kv_transfer_config)  # a bad setting fails the start here
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.channel: Channel = channel(self.engine_id)
        refused = engine_refusal(vllm_config, kv_cache_config)
        self.connector_scheduler: KvcommConnectorScheduler | None = None
        self.connector_worker: KvcommConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvcommConnectorScheduler(kv_cache_config, self.channel, refused, self.config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KvcommConnectorWorker(vllm_config, self.channel, refused, self.config)

    @property
    def refused(self) -> str | None:
        """Why this connector is off (None: it is on)."""
        side = self.connector_scheduler or self.connector_worker
        return side.refused

    @property
    def scheduler(self) -> KvcommConnectorScheduler:
        assert self.connector_scheduler is not None
        return self.connector_scheduler

    @property
    def worker(self) -> KvcommConnectorWorker:
        assert self.connector_worker is not None
        return self.connector_worker

    # -- scheduler side ----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    @_SCHEDULER.timed()
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_SCHEDULER.timed()
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @_SCHEDULER.timed(ends_step=True)
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    @_SCHEDULER.timed()
    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.update_connector_output(connector_output)

    @_SCHEDULER.timed()
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (keep the blocks until ``get_finished`` reports the request) when its KV is
        captured; see ``KvcommConnectorScheduler.request_finished``."""
        return self.scheduler.request_finished(request, block_ids)

    @_SCHEDULER.timed()
    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` when the connector declares ``SupportsHMA`` (one block list
        per KV cache group; a running connector has exactly one group, ``refusals``)."""
        if len(block_ids) != 1 and self.refused is None:
            raise RuntimeError(f"kvcomm: a request finished with {len(block_ids)} KV cache groups; the connector runs "
                               "with one (engines with more are refused at start-up)")
        return self.scheduler.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    @_WORKER.timed()
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Nothing to start: vLLM calls this after the forward on steps without synchronous
        loads, so the worker prepares the step's work at whichever hook runs first."""
        return

    @_WORKER.timed()
    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name, self._get_connector_metadata())

    @_WORKER.timed()
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._get_connector_metadata())

    @_WORKER.timed()
    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    @_WORKER.timed()
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks the worker copied this step and vLLM may free, None):
        kvcomm sends nothing elsewhere and receives nothing asynchronously. Each request id is in
        this step's ``finished_req_ids``: it finished in the step before."""
        if self.connector_worker is None:
            return None, None
        return self.worker.get_finished(self._connector_metadata) or None, None

    @_WORKER.timed(ends_step=True)
    def build_connector_worker_meta(self) -> KvcommWorkerMetadata | None:
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta(self._connector_metadata)
