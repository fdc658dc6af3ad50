"""kvcomm's pipelines on a ``vllm.LLM`` in this process: ``llm.make_llm`` builds the engine with
the connector, ``executor.VllmExecutor`` is the ``Executor`` on it (orders and captures travel on
the in-process channel)."""
