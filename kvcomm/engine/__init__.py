"""The reuse engine: plans which prompt tokens are exact, estimated or computed (``engine``, set
up by ``config``; ``plan``, ``recompute``), builds their KV (``assemble``, ``workspace``,
``prefix_store``), and runs agent calls on an executor (``executor``, ``runner``, ``pipeline``,
``handles``). Start at ``runner.run_agent``."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.engine.engine": ("ReuseEngine",),
    "kvcomm.engine.config": ("ReuseConfig", "BASE_SOURCES", "MODES", "REUSE_SCOPES", "DEFAULT_REUSE_SCOPE", "scope_settings"),
    "kvcomm.engine.plan": ("ReusePlan", "Provenance", "EstimatedPiece", "BlendRequest"),
    "kvcomm.engine.executor": ("Executor", "Generation"),
    "kvcomm.engine.pipeline": (
        "PipelineSpec", "AgentSpec", "Slot", "PipelineError", "load_pipeline", "loads_pipeline", "parse_pipeline", "load_bundled_pipeline",
    ),
    "kvcomm.engine.runner": ("run_agent", "run_row", "build_prompt", "AgentCall"),
    "kvcomm.engine.workspace": ("KVWorkspace",),
    "kvcomm.engine.prefix_store": ("PrefixStore",),
    "kvcomm.engine.recompute": ("RECOMPUTE_SELECTIONS", "disagreement_positions"),
    "kvcomm.engine.handles": ("ContextHandle", "ContextRegistry"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
