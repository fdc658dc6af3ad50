"""The kvcomm methods vLLM's workers gain through vLLM's ``--worker-extension-cls`` (set by
`kvcomm serve`), called from the API server with ``engine_client.collective_rpc``: work on the
worker's planner outside the engine step.

- ``kvcomm_plan_ahead(ticket, token_ids, kvcomm)``: plan a request before it is submitted and
  park the plan under ``ticket`` (``vllm.planning.server_planner``, preambles); returns this rank's
  ``{"preamble": [start, end] | None, "twin": ...}`` or ``{"error": why}``.
- ``kvcomm_guard_record(twin, kl, seconds)``: record the KL the middleware measured for a
  plan the quality guard sampled (``vllm.planning.guard``); returns ``{"recorded": bool}`` or ``{"error": why}``.
"""

from __future__ import annotations

from kvcomm.integrations.vllm.connector.step_time import CLOCKS


class KvcommWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``parallel_config.worker_extension_cls``)."""

    @CLOCKS["rpc"].timed(ends_step=True)
    def kvcomm_plan_ahead(self, ticket: str, token_ids: list[int], kvcomm: dict) -> dict:
        worker = _connector_worker()
        if worker is None:
            return {"error": "this engine's workers run no kvcomm connector"}
        return worker._plans.plan_ahead(ticket, token_ids, kvcomm, worker.refused)

    @CLOCKS["rpc"].timed(ends_step=True)
    def kvcomm_guard_record(self, twin: str, kl: float, seconds: float) -> dict:
        worker = _connector_worker()
        if worker is None:
            return {"error": "this engine's workers run no kvcomm connector"}
        return worker._plans.guard_record(twin, kl, seconds)


def _connector_worker():
    """This worker's kvcomm connector worker side, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    return getattr(connector, "connector_worker", None)
