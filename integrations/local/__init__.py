"""The in-process backend the AutoGen and AG2 clients share: conversations as segments
(``segments``), the backend itself (``backend``), Prometheus export of quality guards (``guard_metrics``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.local.backend": ("ChatBackend", "ChatCall", "ChatReply", "Cancelled"),
    "kvcomm.integrations.local.segments": ("ChatTurn", "ChatPrompt", "render_chat"),
    "kvcomm.integrations.local.guard_metrics": ("export",),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
