"""Chat front ends' common part: conversations as segments (``segments``), the in-process backend
the AutoGen and AG2 clients share (``backend``), Prometheus export of quality guards (``guard_metrics``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.chat.backend": ("ChatBackend", "ChatCall", "ChatReply", "Cancelled"),
    "kvcomm.integrations.chat.segments": ("ChatTurn", "ChatPrompt", "render_chat"),
    "kvcomm.integrations.chat.guard_metrics": ("export",),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
