"""``kvcomm serve``: vLLM's OpenAI server with the plugin, the tenant middleware (``middleware``)
and per-tenant planner state persisted across restarts (``state``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.serve.middleware": ("KvcommTenantMiddleware",),
    "kvcomm.integrations.vllm.planning.planner_state": ("PlannerState",),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
