"""Two `kvcomm serve` replicas behind a real `vllm-router` (``consistent_hash``), one team
through the remote chat backend: affinity (every call of the team on one replica, reuse and
replies as against one server alone) and failover (its replica SIGKILLed: the team's next
calls are served by the other replica, a named context falls back to its text; restarted
from its ``--state-dir``, the replica holds the team's saved state again and serves the team)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from kvcomm.integrations.local.segments import ChatTurn

pytestmark = pytest.mark.slow

DOCUMENT = (
    "Incident report. On Tuesday the pump station at the river valley lost power for forty minutes after a "
    "breaker tripped during a storm. The backup generator started but its fuel filter was clogged, so it "
    "stopped after six minutes. Operators moved the load to the second station by hand. No water was lost, "
    "but the reservoir fell to sixty percent. The maintenance schedule had listed the filter as replaced in "
    "March; the technician's log shows it was not. The engineer on duty recommends monthly generator tests "
    "under load and a second filter kept on site."
)
AGENTS = (("summarizer", "You summarize reports in one sentence."), ("reviewer", "You name the biggest risk in a report."),
          ("checker", "You check a summary against its report."))
BUDGET = 8
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SERVE_ARGS = ["--gamma", "1", "--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "8", "--save-interval", "1"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from kvcomm.integrations.serve.replicas import DeploymentError, Replicas, router_binary

    try:
        router_binary()
    except DeploymentError as error:
        pytest.skip(str(error))
    folder = tmp_path_factory.mktemp("replicas")
    with Replicas(folder / "logs", 2, policy="consistent_hash", serve_args=SERVE_ARGS, state_dir=folder / "state", env=ENV) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer():
    from kvcomm.integrations.remote.backend import _load_tokenizer

    return _load_tokenizer(None)


def _completions(url: str) -> int:
    """Opted-in requests the replica at ``url`` planned (``kvcomm_requests_total``, every outcome)."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return int(sum(float(v) for v in re.findall(r"^kvcomm_requests_total\{[^}]*\} (\S+)$", text, re.M)))


def _tenant_bytes(url: str, tenant: str) -> float:
    """``kvcomm_tenant_bytes`` of ``tenant`` on the replica at ``url`` (0 when it holds nothing of it)."""
    from kvcomm.services.tenants import tenant_label

    text = httpx.get(url + "/metrics", timeout=60).text
    found = re.search(rf'^kvcomm_tenant_bytes\{{tenant="{tenant_label(tenant)}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _counts(deployment) -> list[int]:
    return [_completions(r.url) if r.alive() else -1 for r in deployment.replicas]


def _call(backend, agent: int, replies: dict[str, str], context_ids=()):
    name, system = AGENTS[agent]
    turns = [ChatTurn("system", system), ChatTurn("user", DOCUMENT, "user")]
    turns += [ChatTurn("user", text, author) for author, text in replies.items()]
    turns.append(ChatTurn("user", f"Answer as the {name}.", "user"))
    reply = backend.complete(turns, agent=name, context_ids=context_ids)
    replies[name] = reply.text
    return reply


def _team(url: str, tenant: str, tokenizer, session: str | None = "team-a"):
    from kvcomm.integrations.remote.backend import RemoteChatBackend

    return RemoteChatBackend(url, tokenizer=tokenizer, tenant=tenant, session=session, max_new_tokens=BUDGET)


def _split(reply) -> tuple[int, int, int]:
    p = reply.call.provenance
    return p.exact_tokens, p.estimated_tokens, p.computed_tokens


def test_a_team_stays_on_one_replica_and_reuses_as_on_one_server(deployment, tokenizer):
    before = _counts(deployment)
    routed = _team(deployment.url, "affinity-routed", tokenizer)
    replies: dict[str, str] = {}
    through_router = [_call(routed, agent, replies) for agent in range(len(AGENTS))]
    grew = [after - b for after, b in zip(_counts(deployment), before)]
    assert sorted(grew) == [0, len(AGENTS)], f"the team's calls were spread over the replicas: {grew}"
    home = grew.index(len(AGENTS))
    keys = re.findall(r"Consistent hash routing: key='([^']*)'", deployment.router_log.read_text(errors="replace"))
    assert keys.count("header:x-session-id:team-a") >= len(AGENTS) and set(keys) == {"header:x-session-id:team-a"}, set(keys)
    assert sum(_split(r)[0] + _split(r)[1] for r in through_router) > 0, "the team reused nothing through the router"

    # The same team, a fresh tenant, straight to the other replica: one server, no router.
    alone = _team(deployment.replicas[1 - home].url, "affinity-alone", tokenizer, session=None)
    replies_alone: dict[str, str] = {}
    direct = [_call(alone, agent, replies_alone) for agent in range(len(AGENTS))]
    assert [_split(r) for r in through_router] == [_split(r) for r in direct]
    assert replies == replies_alone
    assert routed.retries == 0


def test_failover_serves_the_team_on_the_other_replica_and_the_restart_serves_its_save(deployment, tokenizer):
    team = _team(deployment.url, "failover", tokenizer, session="team-failover")
    context = team.retain(DOCUMENT)
    before = _counts(deployment)
    replies: dict[str, str] = {}
    first = _call(team, 0, replies, context_ids=[context.context_id])
    home = [a - b for a, b in zip(_counts(deployment), before)].index(1)
    assert first.call.contexts[context.context_id] in ("hit", "unused")
    time.sleep(4)  # the replica saves every second once requests finished

    deployment.kill(home)
    other = deployment.replicas[1 - home]
    served_before = _completions(other.url)
    after = [_call(team, agent, replies, context_ids=[context.context_id]) for agent in (1, 2)]
    assert _completions(other.url) - served_before == 2, "the calls after the kill were not served by the live replica"
    assert all(r.text for r in after)
    # the context lives on the dead replica: the calls were served from its text, and say so
    assert [r.call.contexts[context.context_id] for r in after] == ["fallback", "fallback"]
    # reuse restarts cold there: the reviewer's document is new to the live replica, the checker reuses it
    assert _split(after[0])[0] + _split(after[0])[1] < sum(_split(after[1])[:2])

    deployment.restart(home)
    url = deployment.replicas[home].url
    restored = _completions(url)
    again = _call(team, 0, {})
    assert _completions(url) - restored == 1, "the team did not go back to its restarted replica"
    assert again.text and _tenant_bytes(url, "failover") > 0
    # A fresh process: no exact prefix store (never saved) and an empty vLLM prefix cache, so the
    # exact tokens of its first call come from the fixed-segment bases restored from the save
    # (the same call's first time, on a replica that had nothing of the tenant, had none).
    assert _split(first)[0] == 0 and _split(again)[0] > 0, (_split(first), _split(again), again.call.provenance.note)
