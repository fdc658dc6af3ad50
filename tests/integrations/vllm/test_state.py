"""`kvcomm serve --state-dir`: the planner's tenants are saved and restored, so a restarted
server does not start cold; a save for another model is refused and that tenant starts cold.
Driven like the connector drives the planner (tiny random Llama, real forwards)."""

from __future__ import annotations

import dataclasses
import json
import logging

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.core.fingerprint import model_fingerprint
from kvcomm.integrations.vllm.state import TENANT_FILE, PlannerState
from kvcomm.integrations.vllm.request_plans import ServerPlanner
from kvcomm.services.tenants import tenant_label
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from ..vllm.test_request_plans import request, serve


def _planner(executor) -> ServerPlanner:
    return ServerPlanner(executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))


def test_a_restarted_planner_restores_every_tenant_and_plans_the_same(tiny_executor, tmp_path, caplog):
    fingerprint = model_fingerprint(tiny_executor.model, tiny_executor.tokenizer, tiny_executor.rotary)
    first = _planner(tiny_executor)
    state = PlannerState(first, tmp_path, fingerprint, interval_s=3600)
    assert state.save_if_changed() is False  # nothing served yet
    for seed in range(3):  # each content twice, at two offsets: the second sighting makes anchors
        serve(first, tiny_executor, *request(seed), "team-a")
        serve(first, tiny_executor, *request(seed, lead=9), "team-a")
    serve(first, tiny_executor, *request(5), "team-a")
    serve(first, tiny_executor, *request(9), "team-b")
    assert state.save_if_changed() is True and state.save_if_changed() is False
    probe = request(5, lead=9)  # content seen before (its base is known), at another offset
    warm = serve(first, tiny_executor, *probe, "team-a")
    assert warm["estimated_tokens"] > 0  # team-a's anchors estimate it
    assert json.loads((tmp_path / tenant_label("team-a") / TENANT_FILE).read_text())["tenant"] == "team-a"

    restarted = _planner(tiny_executor)
    outcome = PlannerState(restarted, tmp_path, fingerprint).restore()
    assert set(outcome) == {tenant_label("team-a"), tenant_label("team-b")}
    assert all(text.startswith("restored") for text in outcome.values())
    # the same anchors as when saved (before the probe), so the probe is planned the same way
    again = serve(restarted, tiny_executor, *probe, "team-a")
    assert again == warm
    cold = serve(_planner(tiny_executor), tiny_executor, *probe, "team-a")
    assert cold["estimated_tokens"] == 0 < warm["estimated_tokens"]  # a restart without the state

    other_model = dataclasses.replace(fingerprint, checkpoint="another checkpoint")
    elsewhere = _planner(tiny_executor)
    with caplog.at_level(logging.ERROR, logger="kvcomm.integrations.vllm.state"):
        refused = PlannerState(elsewhere, tmp_path, other_model).restore()
    assert all(text.startswith("not restored") for text in refused.values()) and "starts cold" in caplog.text
    assert elsewhere.registry.tenants == () or all(not e.pools for e in elsewhere.engines.values())
