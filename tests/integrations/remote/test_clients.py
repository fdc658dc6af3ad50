"""The remote flavour: the AutoGen and AG2 clients against a real `kvcomm serve` over HTTP
(real autogen-agentchat, ag2 and openai packages; nothing faked)."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from support.chat_streaming import collect_stream

pytestmark = pytest.mark.slow

WRITER, REVIEWER = "You answer briefly.", "You review the answer in one sentence."
# Greedy SmolLM2 ends the writer's reply to each of these with its stop token inside 12
# tokens (10, 10 and 8 reply tokens), so the server keeps the reply's decode KV as the base
# the reviewer reads. With gamma 1 the first two replies become anchors of the reviewer's
# slot "writer.0" and the third (not longer than them) is estimated from them.
TASKS = ["Name a fruit.", "Name a capital city in Europe.", "Name a color."]
BUDGET = 12


@pytest.fixture
def server(kvcomm_server, fresh_key) -> dict:
    """Connection options of the session's `kvcomm serve`, with an API key of this test alone
    (its own tenant: nothing an earlier test taught the server reaches it)."""
    return {"base_url": kvcomm_server.base_url, "api_key": fresh_key()}


REPLY_KEYS = ("kvcomm-test-replies-a", "kvcomm-test-replies-b", "kvcomm-test-replies-c", "kvcomm-test-replies-d")


@pytest.fixture(scope="module")
def replies_server(tmp_path_factory):
    """A `kvcomm serve` under scope `all`, where a reply's base is the KV its writer decoded it
    with, so the reviewer's first call reads it from stored KV (under the default
    `all-reader-replies` the reviewer, as its first reader, computes it). Keys ``REPLY_KEYS``."""
    from support.serve_client import start_server

    running = start_server(tmp_path_factory.mktemp("kvcomm-serve-replies") / "server.log", REPLY_KEYS,
                           "--reuse-scope", "all")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def reply_server(replies_server, request) -> dict:
    """Connection options of ``replies_server`` with a key (tenant) of this test alone."""
    names = ("test_autogen_reviewer_reuses_the_writers_reply_on_the_server",
             "test_cut_off_replies_become_bases_on_the_server_as_in_process",
             "test_ag2_pair_reuses_the_other_agents_reply_on_the_server",
             "test_a_cut_reply_is_registered_alike_in_process_and_on_the_server")
    return {"base_url": replies_server.base_url, "api_key": REPLY_KEYS[names.index(request.node.originalname)]}


def _team(client):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.teams import RoundRobinGroupChat

    writer = AssistantAgent("writer", client, system_message=WRITER)
    reviewer = AssistantAgent("reviewer", client, system_message=REVIEWER)
    return RoundRobinGroupChat([writer, reviewer], max_turns=2)


def _sums_add_up(calls) -> None:
    """Token counts add up; each call's TTFT is the client's, end to end: within the call's wall time."""
    for call in calls:
        p = call.provenance
        assert p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens and p.computed_tokens >= 1, p
        assert p.ttft_s is not None and 0 < p.ttft_s <= call.latency_s, (p.ttft_s, call.latency_s)


def test_autogen_reviewer_reuses_the_writers_reply_on_the_server(reply_server):
    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    client = KvcommChatCompletionClient.remote(**reply_server, max_tokens=BUDGET)
    for task in TASKS:
        result = asyncio.run(_team(client).run(task=task))
        assert [m.source for m in result.messages] == ["user", "writer", "reviewer"]
    calls = client.call_log
    assert len(calls) == 2 * len(TASKS)
    print("\n" + "\n".join(f"{c.template_id} {c.slots} exact {c.provenance.exact_tokens} estimated "
                           f"{c.provenance.estimated_tokens} computed {c.provenance.computed_tokens}: {c.provenance.note}" for c in calls))
    _sums_add_up(calls)
    estimated = [c for c in calls[1::2] if c.slots["writer#0"][0] > 0 and c.provenance.estimated_tokens > 0]
    assert estimated, "no reviewer call estimated the writer's reply"
    assert all(c.template_id == calls[1].template_id != calls[0].template_id for c in estimated)
    assert all(c.reply_registered for c in calls[0::2])
    summary = client.summary()
    assert summary["estimated_tokens"] > 0 and summary["exact_tokens"] > 0
    usage = client.total_usage()
    assert usage.prompt_tokens == sum(c.prompt_tokens for c in calls)
    assert usage.completion_tokens == sum(c.completion_tokens for c in calls)


def test_cut_off_replies_become_bases_on_the_server_as_in_process(reply_server):
    """The writer's replies (8-10 tokens) cut at 4 by max_tokens are what the reviewer reads.
    In process their KV becomes their base (the executor feeds the last token back); the
    server computes the KV of every token it feeds back, all but the last it samples, so the
    client asks for one token more and keeps max_tokens of them: the server keeps their KV as
    the base and the reviewer's third call estimates the writer's cut reply, as in process.
    The log also names each call's agent, and has the server's TTFT without a server flag."""
    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    client = KvcommChatCompletionClient.remote(**reply_server, max_tokens=4)
    for task in TASKS:
        result = asyncio.run(_team(client).run(task=task))
        assert [m.source for m in result.messages] == ["user", "writer", "reviewer"]
    calls = client.call_log
    print("\n" + "\n".join(f"{c.agent} {c.finish_reason} {c.completion_tokens} {c.slots} {c.provenance}" for c in calls))
    _sums_add_up(calls)
    assert [c.agent for c in calls] == ["writer", "reviewer"] * len(TASKS)
    assert all(c.finish_reason == "length" and c.completion_tokens == 4 and c.reply_registered for c in calls[0::2])
    assert all(c.slots["writer#0"][1] == 4 for c in calls[1::2])
    assert all(c.provenance.ttft_s is not None and 0 < c.provenance.ttft_s <= c.latency_s for c in calls)
    assert calls[-1].slots["writer#0"][0] > 0 and calls[-1].provenance.estimated_tokens > 0, calls[-1]
    with pytest.warns(DeprecationWarning, match="deprecated alias"):
        KvcommChatCompletionClient.remote(**reply_server, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_tokens=4 and max_new_tokens=5"):
        KvcommChatCompletionClient.remote(**reply_server, max_tokens=4, max_new_tokens=5)


@pytest.mark.parametrize("scope, expected", [("all-reader-replies", False), ("all", True)])
def test_a_cut_reply_is_registered_alike_in_process_and_on_the_server(scope, expected, request, smol):
    """The same call (the writer, its reply cut by max_tokens) in process on the embedded model and
    against `kvcomm serve` (the default scope: ``server``; ``all``: ``reply_server``). Only a scope
    that takes replies' bases from their decode keeps the cut reply's KV as its base
    (``learns_reply_from``, in process and in the server alike; in process the executor feeds the
    last token back, remotely the client asks for one token more), and ``reply_registered`` says
    so in both paths. In process the engine's bases are checked directly; the server's reviewer
    reading a cut reply it registered is ``test_cut_off_replies_become_bases_on_the_server_as_in_process``."""
    from kvcomm.core.segments import content_id
    from kvcomm.integrations.local.backend import ChatBackend
    from kvcomm.integrations.local.segments import ChatTurn
    from kvcomm.integrations.remote.backend import RemoteChatBackend
    from kvcomm.integrations.transformers.executor import TransformersExecutor
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.engine import ReuseEngine

    options = request.getfixturevalue("reply_server" if scope == "all" else "server")
    executor = TransformersExecutor(*smol)
    engine = ReuseEngine(executor.rotary, ReuseConfig(scope=scope))
    turns = [ChatTurn("system", WRITER), ChatTurn("user", "Name a capital city in Europe and say why it is famous.", "user")]
    seen = {}
    for path, backend in (("in process", ChatBackend(executor, engine, max_new_tokens=4)),
                          ("remote", RemoteChatBackend(**options, max_new_tokens=4))):
        reply = backend.complete(turns, agent="writer")
        call = reply.call
        seen[path] = (call.finish_reason, call.completion_tokens, call.reply_registered)
        print(f"{scope} {path}: {reply.text!r} {seen[path]}: {call.reason}")
        if path == "in process":
            assert engine.has_base(content_id(reply.reply_ids)) is call.reply_registered
    assert seen["in process"] == seen["remote"] == ("length", 4, expected)


def test_ag2_pair_reuses_the_other_agents_reply_on_the_server(reply_server):
    """The reviewer opens with the task; the writer answers (call 1); the reviewer answers
    that (call 2), reading the writer's reply, whose decode KV the server kept."""
    from autogen import ConversableAgent

    from kvcomm.integrations.ag2.client import KvcommAG2Client
    from kvcomm.integrations.remote.backend import RemoteChatBackend

    config = {"config_list": [{"model": "kvcomm", "model_client_cls": "KvcommAG2Client"}], "cache_seed": None}
    backend = RemoteChatBackend(**reply_server, max_new_tokens=BUDGET)
    for task in TASKS:
        writer = ConversableAgent("writer", system_message=WRITER, llm_config=config, human_input_mode="NEVER")
        reviewer = ConversableAgent("reviewer", system_message=REVIEWER, llm_config=config, human_input_mode="NEVER")
        for agent in (writer, reviewer):
            agent.register_model_client(KvcommAG2Client, backend=backend)
        reviewer.initiate_chat(writer, message=task, max_turns=1, silent=True)
        assert reviewer.generate_reply(sender=writer)
    calls = list(backend.calls)
    assert len(calls) == 2 * len(TASKS)
    print("\n" + "\n".join(f"{c.slots} {c.provenance}" for c in calls))
    _sums_add_up(calls)
    assert any(c.slots["writer#0"][0] > 0 and c.provenance.estimated_tokens > 0 for c in calls[1::2])


def test_ag2_config_entry_with_base_url_selects_the_remote_backend(server):
    from kvcomm.integrations.ag2.client import KvcommAG2Client
    from kvcomm.integrations.remote.backend import RemoteChatBackend

    client = KvcommAG2Client({"model": "kvcomm", "base_url": server["base_url"] + "/v1", "api_key": server["api_key"],
                              "kvcomm_reuse": False, "max_tokens": 3})
    assert isinstance(client.backend, RemoteChatBackend) and not client.backend.reuse
    response = client.create({"messages": [{"role": "user", "content": "Hi"}]})
    assert response.usage.completion_tokens <= 3 and response.kvcomm is client.backend.last
    assert response.kvcomm.provenance.note.startswith("dense")
    with pytest.raises(ValueError, match="streaming"):
        client.create({"messages": [{"role": "user", "content": "Hi"}], "stream": True})


def test_autogen_and_ag2_clients_retain_name_and_release_contexts_on_the_server(server):
    """The clients' context handles against `kvcomm serve` (its context API): one client retains,
    the other names the id; released, the same call falls back to the text."""
    from autogen_core.models import SystemMessage, UserMessage

    from kvcomm.integrations.ag2.client import KvcommAG2Client
    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    note = "The library opens at nine and closes at five on weekdays."
    autogen = KvcommChatCompletionClient.remote(server["base_url"], api_key=server["api_key"], max_tokens=4)
    ag2 = KvcommAG2Client({"model": "kvcomm", "base_url": server["base_url"], "api_key": server["api_key"], "max_tokens": 4})
    handle = autogen.retain_context(note, ttl_s=600)
    record = autogen.backend.context(handle)
    assert handle.context_id.startswith("ctx-") and record["state"] == "retained" and record["expires_at"] is not None
    messages = [{"role": "system", "content": WRITER}, {"role": "user", "content": note},
                {"role": "user", "content": "When does it open?"}]
    response = ag2.create({"messages": messages, "context_ids": [handle.context_id]})
    assert response.kvcomm.contexts[handle.context_id] in ("hit", "unused")  # retained: planned by content
    asyncio.run(autogen.create([SystemMessage(content=WRITER), UserMessage(content="Hi", source="user")],
                               extra_create_args={"context_ids": [handle.context_id]}))
    assert autogen.last_call.contexts == {handle.context_id: "absent"}  # no message carries it
    assert ag2.release_context(handle) is True and ag2.release_context(handle) is False
    assert ag2.create({"messages": messages, "context_ids": [handle.context_id]}).kvcomm.contexts == {
        handle.context_id: "fallback"}


def test_dense_remote_client_equals_the_servers_own_chat_completions(server):
    """Without the kvcomm opt-in the client's requests are plain vLLM requests: each reply and
    prompt length equal the server's /v1/chat/completions (its chat template, its tokenizer)
    called with the openai package on the same messages."""
    import openai

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    client = KvcommChatCompletionClient.remote(**server, reuse=False, max_tokens=12)
    result = asyncio.run(_team(client).run(task=TASKS[1]))
    task, written, reviewed = (m.content for m in result.messages)
    seen = [(written, [("system", WRITER), ("user", task)]), (reviewed, [("system", REVIEWER), ("user", task), ("user", written)])]
    direct = openai.OpenAI(base_url=server["base_url"] + "/v1", api_key=server["api_key"])
    for (reply, messages), call in zip(seen, client.call_log):
        answer = direct.chat.completions.create(
            model=client.backend.model_name, messages=[{"role": r, "content": c} for r, c in messages], max_tokens=12, temperature=0,
        )
        assert answer.choices[0].message.content == reply
        assert answer.usage.prompt_tokens == call.prompt_tokens
        assert call.provenance.computed_tokens == call.prompt_tokens and call.provenance.note.startswith("dense")


def test_stream_and_cancellation_close_the_server_request(server):
    from autogen_core import CancellationToken
    from autogen_core.models import SystemMessage, UserMessage

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    client = KvcommChatCompletionClient.remote(**server, max_tokens=8)
    messages = [SystemMessage(content=REVIEWER), UserMessage(content="Which planet is the largest one?", source="user")]

    def stream(token=None, cancel_after=None):
        return collect_stream(client, messages, token, cancel_after)

    chunks, result = asyncio.run(stream())
    assert "".join(chunks) == result.content and len(chunks) > 1
    assert result.usage.completion_tokens == 8 and result.finish_reason == "length"
    assert client.last_call.provenance.note.startswith("streamed")
    created = asyncio.run(client.create(messages))
    assert created.content == result.content and "streamed" not in client.last_call.provenance.note
    before = len(client.call_log)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stream(CancellationToken(), cancel_after=1))
    stopped = client.call_log[before]
    assert stopped.finish_reason == "cancelled" and stopped.completion_tokens < 8
    assert asyncio.run(client.create(messages)).content == result.content  # the server serves on
    token = CancellationToken()
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(client.create(messages, cancellation_token=token))
    assert len(client.call_log) == before + 2


def test_server_model_checks_and_refusals(server):
    from autogen_core.models import UserMessage

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
    from kvcomm.integrations.local.segments import ChatTurn
    from kvcomm.integrations.remote.backend import RemoteChatBackend, RemoteError

    backend = RemoteChatBackend(**server)
    other = copy.deepcopy(backend.tokenizer)
    other.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(RemoteError, match="does not match the server's model"):
        RemoteChatBackend(**server, tokenizer=other)
    with pytest.raises(RemoteError, match="does not serve 'gpt-4'"):
        RemoteChatBackend(**server, model="gpt-4")
    with pytest.raises(RemoteError, match="api_key"):
        RemoteChatBackend(server["base_url"], api_key="not-a-key")
    with pytest.raises(RemoteError, match="cannot reach"):
        RemoteChatBackend("http://127.0.0.1:9", timeout=5)
    with pytest.raises(ValueError, match="http://"):
        RemoteChatBackend("localhost:8000")
    client = KvcommChatCompletionClient(backend)
    messages = [UserMessage(content="Hi", source="user")]
    # an id the server does not know for this tenant (another tenant's, or lost in a restart without
    # --state-dir): served from the text, reported as a fallback
    asyncio.run(client.create(messages, extra_create_args={"context_ids": ["ctx-0"]}))
    assert client.last_call.contexts == {"ctx-0": "fallback"}
    backend.calls.clear()
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(client.create(messages, extra_create_args={"max_tokens": backend.max_context}))
    assert client.count_tokens(messages) == len(backend.render([ChatTurn("user", "Hi", "user")]).prompt)
    assert client.remaining_tokens(messages) == backend.max_context - client.count_tokens(messages)
    assert len(backend.calls) == 0


def test_concurrent_remote_calls_run_together_and_equal_sequential_ones(server, monkeypatch):
    """Remote calls are not serialized by the client: the server batches them. Measured on
    the wire: the real HTTP exchanges (``httpx.AsyncClient.send``, timed, passed through) of
    calls made at once overlap pairwise in time, so the client sent each before the others
    were answered; and all of them together take far less than the same calls one after
    another, which a server working on one request at a time could not do. The replies equal
    the sequential ones."""
    import httpx
    from autogen_core.models import SystemMessage, UserMessage

    from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

    exchanges: list[tuple[float, float]] = []
    send = httpx.AsyncClient.send

    async def timed_send(self, request, **kwargs):
        started = time.perf_counter()
        try:
            return await send(self, request, **kwargs)
        finally:
            if request.url.path.endswith("/v1/completions"):
                exchanges.append((started, time.perf_counter()))

    monkeypatch.setattr(httpx.AsyncClient, "send", timed_send)
    client = KvcommChatCompletionClient.remote(**server, reuse=False, max_tokens=24)
    conversations = [[SystemMessage(content=s), UserMessage(content=t, source="user")] for s, t in zip((WRITER, REVIEWER, WRITER), TASKS)]
    asyncio.run(client.create(conversations[0]))  # first-call costs (connection, caches) out of the timings
    exchanges.clear()
    started = time.perf_counter()
    sequential = [asyncio.run(client.create(c)).content for c in conversations]
    one_by_one = time.perf_counter() - started
    assert len(exchanges) == len(conversations) and all(a[1] <= b[0] for a, b in zip(exchanges, exchanges[1:]))
    exchanges.clear()

    async def together():
        return await asyncio.gather(*(client.create(c) for c in conversations))

    started = time.perf_counter()
    results = asyncio.run(together())
    at_once = time.perf_counter() - started
    first = min(a for a, _ in exchanges)
    print(f"\nconcurrent remote calls: {at_once:.2f} s at once vs {one_by_one:.2f} s one by one; exchanges "
          f"{[(round(a - first, 2), round(b - first, 2)) for a, b in exchanges]}")
    assert [r.content for r in results] == sequential
    assert len(client.call_log) == 2 * len(conversations) + 1
    assert len(exchanges) == len(conversations)
    assert all(a[0] < b[1] and b[0] < a[1] for a in exchanges for b in exchanges), exchanges
    assert at_once < 0.85 * one_by_one, f"{at_once:.2f} s at once vs {one_by_one:.2f} s one by one: not batched"
