"""Plans made ahead (``ServerPlanner.plan_ahead``: preambles in `kvcomm serve`), driven as
the middleware and the connector drive them (plan ahead, the preamble request, the request with its
ticket: each prefilled with the KV its order injects, captured, learned) on a tiny random Llama,
against the in-process runner on the same requests: the same decisions, the same replies."""

from __future__ import annotations

import pytest
import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.core.kv import KV
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.place import place_all
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.reuse.runner import run_agent
from kvcomm.integrations.vllm.wire.channel import Capture
from kvcomm.integrations.vllm.wire.params import SERVER_KEY, KvcommParamsError, parse_params
from kvcomm.integrations.vllm.planning.server_planner import ServerPlanner, annotated_prompt

CONFIG = ReuseConfig(pool=PoolConfig(gamma=1.0))
MAX_TOKENS = 3


def agent_request(agent: int, shared_seed: int = 0, lead: int = 12, length: int = 96) -> tuple[list[int], list[dict]]:
    """An agent's prompt: its own ``lead`` tokens (its system prompt), a shared span (the same
    content for every agent of one ``shared_seed``), 4 tokens of its own."""
    shared = torch.randint(100, 5000, (length,), generator=torch.Generator().manual_seed(shared_seed)).tolist()
    own = torch.randint(5000, 9000, (lead + 4,), generator=torch.Generator().manual_seed(1000 + agent)).tolist()
    return own[:lead] + shared + own[lead:], [{"start": lead, "end": lead + length, "slot": "task"}]


SERVER_KEYS = ("handle", "purpose", "ticket", "retain", "release")


def _params(ids: list[int], body: dict):
    """``parse_params`` of a flat body: ``kvcomm_server``'s keys (ticket, purpose) sent apart from the client's."""
    server = {key: value for key, value in body.items() if key in SERVER_KEYS}
    client = {key: value for key, value in body.items() if key not in SERVER_KEYS}
    return parse_params({"kvcomm": client, SERVER_KEY: server}, len(ids))


def _run(planner: ServerPlanner, executor, ids: list[int], body: dict, max_tokens: int) -> tuple[dict, list[int]]:
    """One request as the connector serves it: its order's injection written into a buffer (as the
    worker writes it into the cache slots), a prefill on it, the order's positions captured, learned."""
    planned = planner.prepare(ids, _params(ids, body), salted=True, max_tokens=max_tokens)
    order = planned.order
    prefix = None
    if order.inject is not None:
        like = executor.generate(ids[:2], None, 1).computed  # the model's KV layout and dtype
        layers, heads, _, dim = like.keys.shape
        prefix = KV(torch.empty(layers, heads, order.inject.length, dim), torch.empty(layers, heads, order.inject.length, dim))
        place_all(list(order.inject.pieces), KVTarget.contiguous(prefix, 0, order.inject.length), executor.rotary)
    generation = executor.generate(ids, prefix, max_tokens)
    n, reply = len(ids), list(generation.reply_ids)
    layers, heads, _, dim = generation.computed.keys.shape
    capture = Capture.empty(layers, heads, n + max_tokens, dim, generation.computed.keys.dtype)
    parts = [(order.capture_from, generation.computed)]
    if generation.reply_kv is not None:
        parts.append((n, generation.reply_kv))
    for start, kv in parts:
        capture.keys[:, :, start : start + kv.length] = kv.keys
        capture.values[:, :, start : start + kv.length] = kv.values
        capture.filled[start : start + kv.length] = True
    planner.finish(planned, capture, reply)
    return planned.summary(), reply


def serve_ahead(planner: ServerPlanner, executor, ids: list[int], spans: list[dict], template: str,
                ticket: str, preamble_request: bool = True) -> tuple[dict, list[int], tuple[int, int] | None]:
    """What `kvcomm serve` does with one opted-in request: plan ahead, the preamble request (unless
    ``preamble_request`` is False: it failed), the request with its ticket."""
    body = {"template": template, "tenant": "t", "segments": spans}
    preamble, _ = planner.plan_ahead(ticket, ids, _params(ids, body))
    if preamble is not None and preamble_request:
        start, end = preamble
        summary, _ = _run(planner, executor, ids[:end], {"template": template, "tenant": "t", "ticket": ticket,
                                                          "purpose": "preamble"}, 1)
        assert summary["purpose"] == "preamble" and (summary["exact_tokens"], summary["computed_tokens"]) == (start, end - start)
    summary, reply = _run(planner, executor, ids, {**body, "ticket": ticket}, MAX_TOKENS)
    return summary, reply, preamble


def test_requests_planned_ahead_make_the_in_process_decisions(tiny_executor):
    planner, engine = ServerPlanner(tiny_executor.rotary, CONFIG), ReuseEngine(tiny_executor.rotary, CONFIG)
    rows = []
    for agent in range(3):
        ids, spans = agent_request(agent)
        summary, reply, preamble = serve_ahead(planner, tiny_executor, ids, spans, f"agent{agent}", f"ticket-{agent}")
        generation, p = run_agent(tiny_executor, engine, annotated_prompt(ids, _params(ids, {"template": f"agent{agent}",
                                                                                           "segments": spans})), MAX_TOKENS)
        rows.append(((summary["exact_tokens"], summary["preamble_tokens"], summary["estimated_tokens"], summary["computed_tokens"]),
                     (p.exact_tokens, p.preamble_tokens, p.estimated_tokens, p.computed_tokens), reply, list(generation.reply_ids)))
        print(f"agent {agent}: preamble {preamble}, served ahead (exact, preamble, estimated, computed) {rows[-1][0]}, in process {rows[-1][1]}")
    for served, local, reply, local_reply in rows:
        assert served == local and reply == local_reply
    assert rows[0][0][1] == 0 and all(row[0][1] == 12 and row[0][2] > 0 for row in rows[1:])  # later agents: a preamble, then the note
    # the preamble was learned: an agent's next call finds its system prompt and the note as exact prefix
    ids, spans = agent_request(1)
    summary, _, preamble = serve_ahead(planner, tiny_executor, ids, spans, "agent1", "again")
    assert preamble is None and summary["preamble_tokens"] == 0 and summary["exact_tokens"] >= 12


def test_a_failed_preamble_request_leaves_the_exact_prefix_and_tickets_are_used_once(tiny_executor):
    planner = ServerPlanner(tiny_executor.rotary, CONFIG)
    serve_ahead(planner, tiny_executor, *agent_request(0), "agent0", "first")
    ids, spans = agent_request(1)
    summary, _, preamble = serve_ahead(planner, tiny_executor, ids, spans, "agent1", "no-preamble", preamble_request=False)
    assert preamble is not None and summary["preamble_tokens"] == summary["estimated_tokens"] == 0
    assert "preamble request did not complete" in summary["note"]
    body = {"template": "agent1", "tenant": "t", "segments": spans, "ticket": "no-preamble"}
    with pytest.raises(KvcommParamsError, match="expired or used"):  # the ticket was used
        planner.prepare(ids, _params(ids, body), salted=True, max_tokens=1)
    planner.plan_ahead("other", ids, _params(ids, {"template": "agent1", "tenant": "t", "segments": spans}))
    with pytest.raises(KvcommParamsError, match="another prompt"):
        planner.prepare(ids[:-1], _params(ids[:-1], {**body, "ticket": "other"}), salted=True, max_tokens=1)
    with pytest.raises(KvcommParamsError, match="salted"):  # an unsalted request never gets a plan made ahead
        planner.prepare(ids, _params(ids, {**body, "ticket": "other"}), salted=False, max_tokens=1)


def test_server_directives_come_from_the_server_only():
    """``kvcomm_server`` (handle, purpose, ticket, retain, release) is dropped whole from a client's
    body on every kind of route; the same keys inside ``kvcomm`` are refused, named as kvcomm's own."""
    from kvcomm.integrations.serve.middleware import rewrite

    forged = {"handle": "h", "ticket": "t", "purpose": "preamble", "retain": ["x"], "release": ["y"]}
    for kind, key in (("generation", None), ("generation", "key-a"), ("salted", None), ("read", None)):
        body = rewrite({"prompt": [1, 2], "kv_transfer_params": {"kvcomm": {}, SERVER_KEY: dict(forged)}}, key,
                       frozenset(), kind)
        assert SERVER_KEY not in body["kv_transfer_params"], kind
    for options in ({"ticket": "t"}, {"computes_head": True}, {"shadow": True}, {"handle": "h"},
                    {"contexts": {"retain": ["x"]}}, {"purpose": "preamble"}):
        with pytest.raises(KvcommParamsError, match="kvcomm's own"):
            parse_params({"kvcomm": options}, 4)


@pytest.mark.parametrize("client, server, error", [
    ({}, {"purpose": "preamble"}, "'preamble' needs a ticket"),
    ({}, {"purpose": "reuse_twin"}, "'reuse_twin' needs a ticket"),
    ({}, {"purpose": "dense_twin"}, "needs calibrate and no ticket"),
    ({"calibrate": True}, {"purpose": "dense_twin", "ticket": "t"}, "a calibrating request has none"),
    ({"calibrate": True}, {"ticket": "t"}, "a calibrating request has none"),
    ({}, {"purpose": "spy"}, "must be one of"),
    ({}, {"handle": "h", "ticket": "t"}, "the caller plans"),
    ({"calibrate": True}, {"handle": "h"}, "the caller plans"),
    ({}, {"ticket": ""}, "non-empty string"),
    ({}, {"ticket": "t" * 300}, "at most 256 characters"),
    ({}, {"retain": "x"}, "list of at most"),
    ({}, {"who": 1}, "unknown keys"),
    ({}, [], "must be a JSON object"),
])
def test_server_directives_are_checked(client, server, error):
    with pytest.raises(KvcommParamsError, match=error):
        parse_params({"kvcomm": client, SERVER_KEY: server}, 4)


def test_server_directives_parse_into_the_params():
    params = parse_params({"kvcomm": {"tenant": "a"}, SERVER_KEY: {"ticket": "t", "purpose": "reuse_twin"}}, 4)
    assert (params.tenant, params.ticket, params.purpose, params.computes_preamble) == ("a", "t", "reuse_twin", False)
    params = parse_params({"kvcomm": {"calibrate": True}, SERVER_KEY: {"purpose": "dense_twin", "retain": ["c"]}}, 4)
    assert (params.calibrate, params.purpose, params.retain, params.release) == (True, "dense_twin", ("c",), ())
    assert parse_params({"kvcomm": {}}, 4).purpose == "client"
    assert parse_params({SERVER_KEY: {"ticket": "t"}}, 4) is None  # no "kvcomm": not opted in


def test_bodies_that_cannot_be_planned_ahead_pass_untouched():
    """Planning ahead on hostile or unplannable bodies: nothing raised (a 500 to the client),
    nothing added; such requests are planned, or refused, in the engine step."""
    import asyncio
    import copy

    from kvcomm.integrations.serve.preambles import PreambleRequests

    ok = {"prompt": [1, 2, 3], "cache_salt": "s", "kv_transfer_params": {"kvcomm": {"segments": []}}}
    for body in ({**ok, "kv_transfer_params": "kvcomm"}, {**ok, "kv_transfer_params": None},
                 {**ok, "kv_transfer_params": {"kvcomm": [1, 2]}}, {**ok, "prompt": "text"}, {**ok, "prompt": [[1, 2]]},
                 {**ok, "prompt": [1, "2"]}, {**ok, "cache_salt": None},
                 {**ok, "kv_transfer_params": {"kvcomm": {"calibrate": True}}}, ok):  # ok: no served app in the scope
        before = copy.deepcopy(body)
        assert asyncio.run(PreambleRequests(None).plan_ahead({}, body)) is None
        assert body == before

