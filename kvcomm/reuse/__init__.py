"""The reuse engine: plans which prompt tokens are exact, estimated or computed (``engine``, set
up by ``config``; ``plan``, ``strategies`` per mode, ``scopes``), builds their KV (``assemble``, ``workspace``,
``prefix_store``), and runs agent calls on an executor (``executor``, ``runner``, ``pipeline``,
``handles``). Start at ``runner.run_agent``."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.reuse.engine": ("ReuseEngine",),
    "kvcomm.reuse.config": ("ReuseConfig", "BASE_SOURCES"),
    "kvcomm.reuse.strategies": ("MODES", "Mode", "PlanContext"),
    "kvcomm.reuse.scopes": ("SCOPES", "DEFAULT_SCOPE", "Scope"),
    "kvcomm.reuse.plan": ("ReusePlan", "Provenance", "Piece", "Serving", "BlendRequest"),
    "kvcomm.reuse.executor": ("Executor", "Generation"),
    "kvcomm.reuse.pipeline": (
        "PipelineSpec", "AgentSpec", "Slot", "PipelineError", "load_pipeline", "loads_pipeline", "parse_pipeline", "load_bundled_pipeline",
    ),
    "kvcomm.reuse.runner": ("run_agent", "run_row", "build_prompt", "AgentCall"),
    "kvcomm.reuse.workspace": ("KVWorkspace",),
    "kvcomm.reuse.prefix_store": ("PrefixStore",),
    "kvcomm.reuse.handles": ("ContextHandle", "ContextRegistry"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
