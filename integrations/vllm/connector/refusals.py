"""What the connector refuses to run on, decided at start-up and never inside a forward: engine
configurations (``config_refusal``, ``engine_refusal``), attention layers (``layer_refusal``), the
device memory the reuse state needs (``device_memory_budget``), and,
under tensor parallelism, any rank's refusal for all of them (``refusal_of_any_rank``). Each reason
says what to change. What a refusal does (``apply_refusal``): the connector stays loaded but inert,
or with ``strict`` the engine fails to start."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcomm.integrations.vllm.wire.channel import Channel

log = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
"""Attention backends whose KV the connector reads and writes (by ``get_name()``)."""
SUPPORTED_EXECUTORS = (None, "uni", "mp")
"""vLLM executor backends the connector runs under (None: not decided yet, vLLM's default)."""


def config_refusal(tensor_parallel_size: int, pipeline_parallel_size: int, executor_backend: Any,
                   cache_dtype: str, kv_cache_groups: list | None, total_kv_heads: int | None = None) -> str | None:
    """Why the connector cannot run on this engine configuration, or None if it can.

    kv_cache_groups: ``KVCacheConfig.kv_cache_groups`` (None when not known yet, as in the
    scheduler-less worker roles). total_kv_heads: the model's KV heads before tensor
    parallelism splits them (None: not known). Each reason says what to change.
    """
    if pipeline_parallel_size != 1:
        return (f"kvcomm supports pipeline_parallel_size 1 only (this engine has {pipeline_parallel_size}); "
                "start vLLM with pipeline_parallel_size 1 (tensor parallelism is supported)")
    if tensor_parallel_size != 1 and total_kv_heads is not None and total_kv_heads % tensor_parallel_size:
        return (f"kvcomm needs the model's {total_kv_heads} KV heads split evenly over tensor_parallel_size "
                f"{tensor_parallel_size} (vLLM replicates heads otherwise); pick a tensor_parallel_size that divides "
                f"{total_kv_heads}")
    if executor_backend not in SUPPORTED_EXECUTORS:
        return (f"kvcomm supports vLLM's executor backends {', '.join(map(repr, SUPPORTED_EXECUTORS[1:]))} only, this "
                f"engine's is {executor_backend!r}; pass distributed_executor_backend='mp' (vLLM's default) or 'uni'")
    if str(cache_dtype) != "auto":
        return (f"kvcomm reads and writes unquantized KV caches only, this engine has kv_cache_dtype={cache_dtype!r} "
                "(captured fp8 KV would need its scales); start vLLM with kv_cache_dtype='auto'")
    if kv_cache_groups is None:
        return None
    if len(kv_cache_groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in kv_cache_groups})
        return (f"kvcomm supports models with one KV cache group, this one has {len(kv_cache_groups)} ({', '.join(kinds)}: "
                "hybrid, sliding-window or mixed layers); serve a model whose layers all use full attention")
    return _spec_refusal(kv_cache_groups[0].kv_cache_spec)


def engine_refusal(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> str | None:
    """``config_refusal`` of this engine's configuration, as the connector reads it when built."""
    parallel = vllm_config.parallel_config
    groups = None if kv_cache_config is None else kv_cache_config.kv_cache_groups
    model = vllm_config.model_config
    return config_refusal(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                          parallel.distributed_executor_backend, vllm_config.cache_config.cache_dtype, groups,
                          None if model is None else model.get_total_num_kv_heads())


DEVICE_MEMORY_SHARE = 0.9
"""Of the accelerator memory vLLM leaves free (less the capture budget), the share the reuse
state may use when no ``max_total_bytes`` is given; the rest is headroom for the plans' and
kernels' temporaries."""
HOST_MEMORY_SHARE = 0.25
"""On a CPU, the share of the host's physical memory that the reuse state and the captures
together may use when no ``max_total_bytes`` is given: the rest is for the model's weights,
vLLM's KV cache space (``VLLM_CPU_KVCACHE_SPACE``), the processes and everything else the host runs."""


def host_memory_budget(capture_bytes: int, total_bytes: int | None = None) -> int:
    """The default ``max_total_bytes`` on a CPU: ``HOST_MEMORY_SHARE`` of the host's physical
    memory (``total_bytes``, read with psutil when None) less the capture budget
    (``capture_bytes``); at least 1 (then nothing is kept, rather than unbounded)."""
    if total_bytes is None:
        import psutil

        total_bytes = psutil.virtual_memory().total
    return max(1, int(HOST_MEMORY_SHARE * total_bytes) - capture_bytes)


def device_memory_budget(device_type: str, free_bytes: int | None, max_total_bytes: int | None, capture_bytes: int,
                         ranks: int = 1) -> tuple[int | None, str | None]:
    """(the ``max_total_bytes`` to use, the refusal or None) for the reuse state beside vLLM's KV cache.

    On an accelerator, bases, anchors, exact prefixes and captures live in the device memory
    vLLM leaves free after allocating its KV cache (``free_bytes``, this rank's, read at
    start-up). They are capped by ``max_total_bytes`` (all ranks together, so each rank holds
    ``1/ranks`` of it; a positive integer, ``ConnectorConfig`` checked it); without one the cap is ``DEVICE_MEMORY_SHARE`` of what is free less the
    capture budget (``capture_bytes``: ``max_capture_bytes``, which bounds the captures of all
    requests in flight together, ``vllm.connector.scheduler``). A given cap whose share plus the capture
    budget does not fit
    is refused, or the first large plan would fail inside a forward. On a CPU (host memory) the
    cap is the operator's, or ``host_memory_budget`` without one."""
    if device_type == "cpu" or free_bytes is None:
        return (host_memory_budget(capture_bytes) if max_total_bytes is None else max_total_bytes), None
    gib = 1 << 30
    if max_total_bytes is None:
        room = int(DEVICE_MEMORY_SHARE * (free_bytes - capture_bytes)) * ranks
        if room <= 0:
            return None, (f"vLLM leaves {free_bytes / gib:.1f} GiB free beside its KV cache on this {device_type} rank, "
                          f"less than the capture budget ({capture_bytes / gib:.1f} GiB, max_capture_bytes): "
                          "lower --gpu-memory-utilization or max_capture_bytes")
        return room, None
    need = max_total_bytes // ranks + capture_bytes
    if need > free_bytes:
        return max_total_bytes, (
            f"max_total_bytes {max_total_bytes} ({max_total_bytes / gib:.1f} GiB over {ranks} rank(s)) plus one request's "
            f"capture budget ({capture_bytes / gib:.1f} GiB, max_capture_bytes) needs {need / gib:.1f} GiB per rank, but "
            f"vLLM leaves {free_bytes / gib:.1f} GiB free beside its KV cache: lower max_total_bytes or max_capture_bytes, "
            "or --gpu-memory-utilization")
    return max_total_bytes, None


def apply_refusal(channel: "Channel", refused: str | None, strict: bool) -> None:
    """Turn the engine's connector off if ``refused`` says why (None: nothing to do): the reason
    goes on the engine's channel, then with ``strict`` the engine fails to start (ValueError),
    else a warning says that the connector is off and requests are served without reuse."""
    if refused is None:
        return
    channel.refusal = refused
    if strict:
        raise ValueError(f"kvcomm connector: {refused}")
    log.warning("kvcomm connector is off for this engine: %s. Requests without kvcomm options are served as "
                "usual; requests with them are served without reuse and get this message as their error.", refused)


def _spec_refusal(spec: Any) -> str | None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    name = type(spec).__name__
    if type(spec) is not FullAttentionSpec:
        hint = "MLA attention" if "MLA" in name else "this kind of attention"
        return (f"kvcomm supports full (causal, unwindowed) attention KV caches only, this model's cache is {name} "
                f"({hint} is not supported); serve a model with standard multi-head or grouped-query attention")
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        return ("kvcomm does not support sliding-window or chunked-local attention layers; serve a model whose "
                "layers all use full attention")
    if getattr(spec, "non_causal", False):
        return "kvcomm supports causal attention only; this model's attention is non-causal"
    if int(getattr(spec, "kv_quant_mode", 0)) != 0:
        return "kvcomm reads and writes unquantized KV caches only; start vLLM with kv_cache_dtype='auto'"
    if spec.head_size_v != spec.head_size:
        return (f"kvcomm needs equal key and value head sizes, this model has {spec.head_size} and "
                f"{spec.head_size_v}")
    return None


def layer_refusal(name: str, layer: Any) -> str | None:
    """Why the connector cannot read and write attention layer ``name`` (a vLLM attention
    module), or None if it can."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    if isinstance(layer, MLAAttention):
        return f"attention layer {name} is MLA, which kvcomm does not support; serve a model without MLA"
    backend = layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else None
    backend_name = backend.get_name() if backend is not None else type(layer).__name__
    if backend_name not in SUPPORTED_BACKENDS:
        return (f"attention layer {name} runs on backend {backend_name}, which kvcomm does not support; start vLLM with "
                f"attention_backend set to one of {', '.join(SUPPORTED_BACKENDS)}")
    if getattr(backend, "forward_includes_kv_cache_update", False):
        return f"attention backend {backend_name} writes its KV cache inside its forward; kvcomm needs do_kv_cache_update"
    if getattr(layer, "sliding_window", None) is not None:
        return f"attention layer {name} uses a sliding window, which kvcomm does not support"
    if getattr(layer, "kv_sharing_target_layer_name", None) is not None:
        return f"attention layer {name} shares another layer's KV cache, which kvcomm does not support"
    return None


def refusal_of_any_rank(refused: str | None, vllm_config: "VllmConfig") -> str | None:
    """Under tensor parallelism every rank must be on or off together (each holds only its
    heads of every request): the first rank's refusal, else None. Called by all ranks at once."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return refused
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    reasons: list[str | None] = [None] * group.world_size
    dist.all_gather_object(reasons, refused, group=group.cpu_group)
    return next((f"tensor-parallel rank {rank}: {reason}" if rank != group.rank_in_group else reason
                 for rank, reason in enumerate(reasons) if reason is not None), None)
