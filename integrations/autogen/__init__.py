"""AutoGen (autogen-core 0.7) client: ``KvcommChatCompletionClient``."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.autogen.client": ("KvcommChatCompletionClient",),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
