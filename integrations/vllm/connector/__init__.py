"""What vLLM loads by name. ``KvcommConnector`` (``facade``; vLLM's module path
``kvcomm.integrations.vllm.connector``) is a facade over its scheduler side (``scheduler``: which
tokens it claims, each step's messages) and its worker side (``worker``: the device work of each
step); ``layout`` reads and writes paged KV on every backend, ``rotary`` reads the served model's
RoPE, ``refusals`` decides at start-up what it cannot serve, ``versions`` names the vLLM releases
it runs on, ``step_time`` times its hooks; ``worker_extension`` holds the workers' RPC methods
`kvcomm serve` calls (``--worker-extension-cls``)."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {"kvcomm.integrations.vllm.connector.facade": ("KvcommConnector",)}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)  # vLLM's loader reads the class by name; nothing heavy before
