"""The vLLM plugin: the V1 KV connector (``connector``, loaded by module path,
``llm.CONNECTOR_MODULE``; its ``scheduler`` and ``worker`` sides and what they tell each other,
``messages``), its pieces (``layout``, ``channel``, ``params``, ``refusals``, ``rotary``,
``worker_plans``, ``request_plans``, ``detect``, ``metrics``, ``state``), an in-process ``vllm.LLM``
with it (``llm.make_llm``) and the executor on it."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.vllm.llm": ("make_llm", "shutdown_llm", "transfer_config", "CONNECTOR", "CONNECTOR_MODULE"),
    "kvcomm.integrations.vllm.executor": ("VllmExecutor",),
    "kvcomm.integrations.vllm.connector": ("KvcommConnector",),
    "kvcomm.integrations.vllm.params": ("KvcommParams", "KvcommParamsError", "parse_params"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
