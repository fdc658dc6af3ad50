"""An AutoGen team on the embedded model, run with kvcomm reuse and dense, side by side.

Three agents (planner, solver, checker) take turns in a ``RoundRobinGroupChat`` on a few
tasks. Every agent uses one ``KvcommChatCompletionClient``; the reuse run shares one reuse
engine across tasks (the first tasks fill the anchor pools), the dense run prefills every
prompt in full. Prints, per agent: calls, prompt tokens by source, token- and agent-level
reuse, median TTFT in both modes, and how often the greedy reply matched the dense one.

    .venv/bin/python examples/autogen_team.py [--tasks 4] [--max-tokens 32] [--gamma 0.3]
    .venv/bin/python examples/autogen_team.py --remote http://localhost:8000   # against `kvcomm serve`

A few minutes on a laptop CPU (SmolLM2-135M, fp32). With ``--remote`` the same team runs
against a server (its anchor pools, its ``--gamma``); the dense run sends plain requests
without the kvcomm opt-in. TTFT there is the server's own measure (`kvcomm serve` reports
it unless started with ``--disable-log-stats``), else the call's wall time (marked "wall").
In process, reuse starts in the first task (each agent's first call computes its new system
prompt and serves the task after it); against a server, from each agent's second call
(docs/autogen.md, warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.integrations.autogen.client import KvcommChatCompletionClient
from kvcomm.integrations.local.backend import ChatBackend, ChatCall
from kvcomm.integrations.local.segments import ChatTurn, template_id
from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
from kvcomm.integrations.transformers.executor import TransformersExecutor

AGENTS = {
    "planner": "You are a planner. Say in one or two sentences how to solve the task.",
    "solver": "You are a solver. Follow the plan and give the answer briefly.",
    "checker": "You are a checker. Say whether the answer is right, in one sentence.",
}
TASKS = [
    "What is 12 plus 30?",
    "Name the capital of France.",
    "How many legs does a spider have?",
    "What color do you get by mixing blue and yellow?",
    "What is 7 times 6?",
    "Which is heavier, a kilogram of iron or a kilogram of feathers?",
]


async def run_team(client: KvcommChatCompletionClient, tasks: list[str]) -> list[list[str]]:
    """Each task through a fresh team (agents keep no memory across tasks); the replies."""
    replies = []
    for task in tasks:
        agents = [AssistantAgent(name, client, system_message=system) for name, system in AGENTS.items()]
        result = await RoundRobinGroupChat(agents, max_turns=len(agents)).run(task=task)
        replies.append([m.content for m in result.messages[1:]])
    return replies


def per_agent(calls: list[ChatCall], names: dict[str, str]) -> dict[str, list[ChatCall]]:
    out: dict[str, list[ChatCall]] = {name: [] for name in AGENTS}
    for call in calls:
        out[names[call.template_id]].append(call)
    return out


def make_clients(args) -> tuple[dict[str, KvcommChatCompletionClient], dict[str, str]]:
    """The dense and the reuse client (in process, or against ``--remote``), and the agent
    name of each template id."""
    if args.remote:
        clients = {mode: KvcommChatCompletionClient.remote(
            args.remote, reuse=mode == "reuse", max_tokens=args.max_tokens, api_key=args.api_key)
                   for mode in ("dense", "reuse")}
        tokenizer, encode = clients["reuse"].backend.tokenizer, clients["reuse"].backend.encode
    else:
        model, tokenizer = load_model_and_tokenizer()
        reuse_executor = TransformersExecutor(model, tokenizer)  # runs the RoPE self-check
        dense_executor = TransformersExecutor(model, tokenizer, dense_only=True)
        engine = ReuseEngine(reuse_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=args.gamma)))
        clients = {
            "dense": KvcommChatCompletionClient(ChatBackend(dense_executor, None, args.max_tokens)),
            "reuse": KvcommChatCompletionClient(ChatBackend(reuse_executor, engine, args.max_tokens)),
        }
        encode = reuse_executor.encode
    return clients, {template_id(tokenizer, encode, [ChatTurn("system", s)]): n for n, s in AGENTS.items()}


def ttft_ms(calls: list[ChatCall]) -> str:
    """Median TTFT; the median wall time of the calls where no TTFT was measured."""
    ttfts = [c.provenance.ttft_s for c in calls]
    if all(t is not None for t in ttfts):
        return f"{statistics.median(ttfts) * 1e3:8.0f}ms"
    return f"{statistics.median(c.latency_s for c in calls) * 1e3:6.0f}wall"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4, help=f"tasks to run, 1..{len(TASKS)}")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply budget per agent call")
    parser.add_argument("--gamma", type=float, default=PoolConfig().gamma, help="anchor admission threshold (in process)")
    parser.add_argument("--remote", metavar="URL", help="run against `kvcomm serve` at URL instead of in process")
    parser.add_argument("--api-key", help="with --remote: one of the server's --api-key keys")
    args = parser.parse_args()
    if not 1 <= args.tasks <= len(TASKS):
        parser.error(f"--tasks must be in 1..{len(TASKS)}")
    clients, names = make_clients(args)
    tasks = TASKS[: args.tasks]
    replies = {}
    for mode, client in clients.items():
        started = time.perf_counter()
        replies[mode] = asyncio.run(run_team(client, tasks))
        print(f"{mode}: {len(client.call_log)} agent calls in {time.perf_counter() - started:.1f} s")
    for i, task in enumerate(tasks):
        print(f"\nTask: {task}")
        for name, dense, reuse in zip(AGENTS, replies["dense"][i], replies["reuse"][i]):
            same = "same" if dense == reuse else "differs"
            print(f"  {name:8s} dense: {dense[:70]!r}\n  {'':8s} reuse: {reuse[:70]!r} ({same})")
    dense_calls = per_agent(clients["dense"].call_log, names)
    reuse_calls = per_agent(clients["reuse"].call_log, names)
    header = (f"{'agent':8s} {'calls':>5s} {'prompt':>6s} {'exact':>6s} {'estim':>6s} {'comp':>6s} {'tok-reuse':>9s} "
              f"{'agent-reuse':>11s} {'ttft dense':>10s} {'ttft reuse':>10s} {'same reply':>10s}")
    print("\n" + header + "\n" + "-" * len(header))
    for name in AGENTS:
        dense, reuse = dense_calls[name], reuse_calls[name]
        p = [c.provenance for c in reuse]
        prompt = sum(x.prompt_tokens for x in p)
        exact, estimated = sum(x.exact_tokens for x in p), sum(x.estimated_tokens for x in p)
        same = sum(a == b for a, b in zip((r[list(AGENTS).index(name)] for r in replies["dense"]), (r[list(AGENTS).index(name)] for r in replies["reuse"])))
        print(
            f"{name:8s} {len(reuse):5d} {prompt:6d} {exact:6d} {estimated:6d} {prompt - exact - estimated:6d} "
            f"{(exact + estimated) / prompt:9.0%} {sum(x.reused for x in p) / len(p):11.0%} "
            f"{ttft_ms(dense):>10s} {ttft_ms(reuse):>10s} "
            f"{same:>6d}/{len(reuse)}"
        )
    total = clients["reuse"].summary()
    print(
        f"\nall agents: token reuse {total['token_reuse_rate']:.0%} (estimated {total['estimated_tokens']} of "
        f"{total['prompt_tokens']} prompt tokens), agent-level reuse {total['agent_reuse_rate']:.0%}, "
        f"fallbacks {total['fallbacks']}/{total['calls']}"
    )


if __name__ == "__main__":
    main()
