"""kvcomm: KV-cache reuse across agents that share a base model (KVCOMM).

Layers, each importing only those below it: ``kvcomm.core`` (primitives), ``kvcomm.anchors``
(the anchor pool), ``kvcomm.reuse`` (the reuse engine and agent runner), ``kvcomm.services``
(tenants, persistence, quality guard); ``kvcomm.integrations`` (transformers, vLLM, serving,
AutoGen/AG2, the CLI) and ``kvcomm.eval`` sit on top. The names below are the Python API; they
import on first use, so ``import kvcomm`` is cheap."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.core.rope": ("Rotary", "RopeError"),
    "kvcomm.core.kv": ("KV",),
    "kvcomm.core.segments": ("Segment", "Prompt", "content_id"),
    "kvcomm.core.fingerprint": ("ModelFingerprint", "model_fingerprint"),
    "kvcomm.reuse.engine": ("ReuseEngine",),
    "kvcomm.reuse.config": ("ReuseConfig",),
    "kvcomm.reuse.plan": ("ReusePlan", "Provenance"),
    "kvcomm.reuse.executor": ("Executor", "Generation"),
    "kvcomm.reuse.pipeline": ("PipelineSpec", "AgentSpec", "PipelineError", "load_pipeline", "parse_pipeline", "load_bundled_pipeline"),
    "kvcomm.reuse.runner": ("run_agent", "run_row", "AgentCall"),
    "kvcomm.reuse.handles": ("ContextHandle", "ContextRegistry"),
    "kvcomm.anchors.pool": ("AnchorPool",),
    "kvcomm.anchors.config": ("PoolConfig",),
    "kvcomm.services.tenants": ("TenantRegistry",),
    "kvcomm.services.persist": ("save_engine", "load_engine", "PersistError"),
    "kvcomm.services.quality_guard": ("QualityGuard", "GuardConfig"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
