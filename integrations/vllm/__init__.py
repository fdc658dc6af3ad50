"""The vLLM plugin, in four folders by role. Layers import only downward (``tests/test_layers.py``):

- ``wire/``: what kvcomm's parts inside vLLM tell each other, and nothing that acts on it: a
  request's options (``params``, client to server), the connector's settings (``config``, vLLM's
  config to every side), the step's messages (``messages``, scheduler side to worker side) and
  the in-process channel (``channel``, callers in the worker's process to the connector).
- ``planning/``: server-side planning in the worker process: ``ServerPlanner`` (tenants, pools,
  plans, learning; ``server_planner``), ``WorkerPlans`` (answers the scheduler side's asks;
  ``worker_plans``), the quality guard, segment ids and detection, saved state and metrics.
- ``connector/``: what vLLM loads by name: the V1 KV connector ``KvcommConnector`` (a facade over
  its ``scheduler`` and ``worker`` sides; module path ``kvcomm.integrations.vllm.connector``),
  the paged-cache ``layout``, the served model's ``rotary``, start-up ``refusals``, and the
  workers' RPC methods (``worker_extension``).
- ``inprocess/``: a ``vllm.LLM`` with the connector (``llm.make_llm``) and kvcomm's ``Executor``
  on it (``executor.VllmExecutor``), for pipelines run in one process.
"""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.integrations.vllm.inprocess.llm": ("make_llm", "shutdown_llm"),
    "kvcomm.integrations.vllm.wire.config": ("transfer_config", "CONNECTOR", "CONNECTOR_MODULE"),
    "kvcomm.integrations.vllm.inprocess.executor": ("VllmExecutor",),
    "kvcomm.integrations.vllm.connector": ("KvcommConnector",),
    "kvcomm.integrations.vllm.wire.params": ("KvcommParams", "KvcommParamsError", "parse_params"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
