"""An AutoGen team reading a long design note, with kvcomm reuse and dense, side by side.

What kvcomm is for: agents that read the same long text, each behind its own system message.
Three agents (summarizer, critic, editor) with system messages of their own take turns in a
``RoundRobinGroupChat`` on tasks that each carry ``design_note.md`` (766 words, about 1,000
tokens) as a message of its own, then a question. Every agent of a run shares one ``KvcommChatCompletionClient``: with reuse, each agent
from its first call on computes its own new system message (the *preamble*) and takes the
note, and the others' replies, from stored KV; dense prefills every prompt in full. The two
runs alternate task by task on one machine, so both see the same load.

Prints, per call, what it reused and why it computed the rest (``ChatCall.reason``), its TTFT
and wall time as kvcomm reports them next to the same two measured here from outside (the
agents stream, and a stopwatch around the client notes the first text chunk and the end), and
then ``client.summary(baseline=dense)``: summed TTFT and wall time per agent and in all, and
the ratios against dense.

    .venv/bin/python examples/autogen_team.py [--tasks 2] [--max-tokens 32]
    .venv/bin/python examples/autogen_team.py --remote http://localhost:8000 [--api-key K] [--stream]   # against `kvcomm serve`

A few minutes on a 2-core CPU (SmolLM2-135M, fp32). With ``--remote`` the same team runs
against a server (its engine, its ``--gamma``; the dense run sends plain requests), by default
without streaming: vLLM streams no ``kv_transfer_params``, so only a call answered whole says
what it reused; its TTFT is then the client's end-to-end figure, the call's wait less the
server's decode interval (docs/autogen.md, "Statistics"), and the stopwatch sees no first
token. ``--stream`` streams the remote calls too: TTFT is then the first token as it arrives,
measured by the client and by the stopwatch alike, and the reason column says the split is
unknown. Remotely the script also prints the server's own summed TTFT per mode
(``kvcomm_time_to_first_token_seconds`` on ``/metrics``: from each request's arrival at the
server to its first token, planning and preambles included; docs/serving.md).
Reuse pays on long shared text; on prompts of a few dozen tokens planning costs more than
it saves.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat

from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
from kvcomm.integrations.local.backend import ChatBackend
from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
from kvcomm.integrations.transformers.executor import TransformersExecutor
from kvcomm.reuse.engine import ReuseEngine

NOTE = (Path(__file__).resolve().parent / "design_note.md").read_text(encoding="utf-8")
AGENTS = {
    "summarizer": "You are a technical writer. Summarize design notes for busy engineers.",
    "critic": "You are a critical reviewer. Point out the weakest part of a design and why it matters.",
    "editor": "You are the editor. Decide whether the note is ready and say APPROVE when it is.",
}
TASKS = [
    "Review the design note above.",
    "What should the team decide first, according to the design note above?",
    "Is the design note above ready for the architecture review?",
    "List what the design note above leaves open.",
]


class Stopwatch(KvcommChatCompletionClient):
    """The client with a stopwatch around each call, outside kvcomm: ``measured`` holds
    (seconds to the first text chunk, None when not streamed; seconds to the end) per call."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.measured: list[tuple[float | None, float]] = []

    async def create(self, *args, **kwargs):
        started = time.perf_counter()
        result = await super().create(*args, **kwargs)
        self.measured.append((None, time.perf_counter() - started))
        return result

    async def create_stream(self, *args, **kwargs):
        started, first = time.perf_counter(), None
        async for chunk in super().create_stream(*args, **kwargs):
            if first is None and isinstance(chunk, str) and chunk:
                first = time.perf_counter() - started
            yield chunk
        self.measured.append((first, time.perf_counter() - started))


async def run_task(client: Stopwatch, task: str, stream: bool) -> list[str]:
    """One task through a fresh team (agents keep no memory across tasks): the note, then the
    question, as two messages (the note is the same message in every task, so later tasks find
    its KV stored); the replies."""
    agents = [AssistantAgent(name, client, system_message=system, model_client_stream=stream)
              for name, system in AGENTS.items()]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(len(agents) + 2))
    result = await team.run(task=[TextMessage(content=NOTE, source="user"), TextMessage(content=task, source="user")])
    return [m.content for m in result.messages[2:] if isinstance(m.content, str)]


def make_clients(args) -> dict[str, Stopwatch]:
    """The dense and the reuse client, in process or against ``--remote``."""
    if args.remote:
        from kvcomm.integrations.remote.backend import RemoteChatBackend

        return {mode: Stopwatch(RemoteChatBackend(args.remote, reuse=mode == "reuse", max_new_tokens=args.max_tokens,
                                                  api_key=args.api_key)) for mode in ("dense", "reuse")}
    model, tokenizer = load_model_and_tokenizer()
    reuse = TransformersExecutor(model, tokenizer)  # runs the RoPE self-check
    dense = TransformersExecutor(model, tokenizer, dense_only=True)
    return {"dense": Stopwatch(ChatBackend(dense, None, args.max_tokens)),
            "reuse": Stopwatch(ChatBackend(reuse, ReuseEngine(reuse.rotary), args.max_tokens))}


def server_ttft(args) -> dict[str, tuple[float, float]]:
    """The server's ``kvcomm_time_to_first_token_seconds`` on ``/v1/completions`` as (sum, count)
    per mode ("reuse": requests that opted into kvcomm, "dense": plain ones); {} when unread."""
    import re
    import urllib.request

    request = urllib.request.Request(args.remote.rstrip("/").removesuffix("/v1") + "/metrics",
                                     headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    found: dict[str, list[float]] = {"reuse": [0.0, 0.0], "dense": [0.0, 0.0]}
    for line in text.splitlines():
        match = re.match(r'^kvcomm_time_to_first_token_seconds_(sum|count)\{([^}]*)\} (\S+)$', line)
        if match and 'route="/v1/completions"' in match.group(2):
            mode = "reuse" if 'kvcomm="yes"' in match.group(2) else "dense"
            found[mode][0 if match.group(1) == "sum" else 1] += float(match.group(3))
    return {mode: (total, count) for mode, (total, count) in found.items()}


def seconds(x: float | None) -> str:
    return "  n/a " if x is None else f"{x:6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2, help=f"tasks to run, 1..{len(TASKS)}")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply budget per agent call")
    parser.add_argument("--remote", metavar="URL", help="run against `kvcomm serve` at URL instead of in process")
    parser.add_argument("--api-key", help="with --remote: one of the server's --api-key keys")
    parser.add_argument("--stream", action="store_true",
                        help="with --remote: stream the calls (TTFT measured at the first token; no reuse split)")
    args = parser.parse_args()
    if not 1 <= args.tasks <= len(TASKS):
        parser.error(f"--tasks must be in 1..{len(TASKS)}")
    if args.stream and not args.remote:
        parser.error("--stream is for --remote (in process the calls always stream)")
    clients = make_clients(args)
    stream = not args.remote or args.stream
    before = server_ttft(args) if args.remote else {}
    replies: dict[str, list[str]] = {"dense": [], "reuse": []}
    for number, task in enumerate(TASKS[: args.tasks]):
        order = ("dense", "reuse") if number % 2 == 0 else ("reuse", "dense")  # alternate who goes first
        for mode in order:
            replies[mode] += asyncio.run(run_task(clients[mode], task, stream))

    reuse, dense = clients["reuse"], clients["dense"]
    print(f"{'call':>4} {'agent':10} {'same':4} {'TTFT kvcomm':>11} {'measured':>8} {'wall kvcomm':>11} {'measured':>8}  "
          "what it reused, and why it computed the rest")
    for i, (call, (first, wall)) in enumerate(zip(reuse.call_log, reuse.measured)):
        same = "yes" if i < len(replies["dense"]) and replies["dense"][i] == replies["reuse"][i] else "no"
        print(f"{i:>4} {call.agent or '?':10} {same:4} {seconds(call.provenance.ttft_s):>11} {seconds(first):>8} "
              f"{seconds(call.latency_s):>11} {seconds(wall):>8}  {call.reason}")

    summary = reuse.summary(baseline=dense)
    print(f"\n{'agent':10} {'calls':>5} {'reused':>7} {'TTFT dense':>10} {'TTFT kvcomm':>11} {'ratio':>6} "
          f"{'wall dense':>10} {'wall kvcomm':>11} {'ratio':>6}")
    rows = [*summary["agents"].items(), ("all", summary)]
    for name, row in rows:
        base = row.get("baseline") or {}
        print(f"{name or '?':10} {row['calls']:>5} {row['token_reuse_rate']:>7.0%} {seconds(base.get('ttft_s')):>10} "
              f"{seconds(row['ttft_s']):>11} {ratio(base.get('ttft_speedup')):>6} {seconds(base.get('wall_s')):>10} "
              f"{seconds(row['wall_s']):>11} {ratio(base.get('wall_speedup')):>6}")
    equal = sum(a == b for a, b in zip(replies["dense"], replies["reuse"]))
    print(f"\nreplies equal to dense: {equal}/{min(len(replies['dense']), len(replies['reuse']))}; prompt tokens reused: "
          f"{summary['exact_tokens'] + summary['estimated_tokens']:,} of {summary['prompt_tokens']:,}")
    after = server_ttft(args) if args.remote else {}
    for mode, client in clients.items():
        reported = client.summary()
        measured = [m[0] for m in client.measured if m[0] is not None]
        line = (f"{mode}: summed TTFT reported {seconds(reported['ttft_s']).strip()} s, measured "
                f"{f'{sum(measured):.2f}' if len(measured) == len(client.measured) else 'n/a'} s")
        if after:
            total, count = (after[mode][i] - before[mode][i] for i in (0, 1))
            line += f", server {total:.2f} s ({count:.0f} requests)"
        print(line + f"; summed wall time reported {reported['wall_s']:.2f} s, measured "
                     f"{sum(m[1] for m in client.measured):.2f} s")


def ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


if __name__ == "__main__":
    main()
