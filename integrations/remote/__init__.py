"""The chat clients against ``kvcomm serve``: the backend (``backend``) and its request format (``wire``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.remote.backend": ("RemoteChatBackend", "RemoteError"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
