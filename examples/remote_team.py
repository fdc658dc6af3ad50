"""A remote team: agents in two processes against one `kvcomm serve`, passing context handles.

Process 1 (this one) runs the writer: it answers three tasks and retains each reply on the
server as a context (``retain_context``), then hands the context ids and texts to process 2.
Process 2 runs two readers (reviewer, editor), each a separate AutoGen client, that read each
reply naming its context (``extra_create_args={"context_ids": [id]}``): the server serves the
reply's tokens from the KV it keeps, by the rules any shared content is reused by. The first
rounds fill the readers' anchor pools (outcome "unused": the reply is computed and becomes an
anchor); from the third on the replies are read from stored KV ("hit"). Then process 1
releases the contexts and process 2 asks the last round's questions again: the requests fall
back to the text, succeed, and say so. Process 2 prints, per round and agent, the context
tokens it read and how many came from stored KV, the prompt's split and the server's TTFT.

    .venv/bin/python examples/remote_team.py                     # starts its own `kvcomm serve` (a minute or two on a CPU)
    .venv/bin/python examples/remote_team.py --url http://localhost:8000 [--api-key K]

Each reader calls once before the rounds (its warm-up: a new agent's first call computes its
whole prompt, docs/autogen.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from autogen_core.models import SystemMessage, UserMessage

from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

WRITER = "You answer briefly."
READERS = {
    "reviewer": "You review the answer in one sentence.",
    "editor": "You shorten the answer to five words.",
}
TASKS = ["Name a fruit.", "Name a capital city in Europe.", "Name a color."]


def client(url: str, api_key: str | None, name: str, max_tokens: int) -> KvcommChatCompletionClient:
    return KvcommChatCompletionClient.remote(url, api_key=api_key, agent_name=name, max_tokens=max_tokens)


async def write(url: str, api_key: str | None) -> tuple[list[dict], KvcommChatCompletionClient]:
    """Process 1: the writer's replies, each retained as a context: ([{"id", "text", "task"}], client)."""
    writer = client(url, api_key, "writer", 12)
    rounds = []
    for task in TASKS:
        result = await writer.create([SystemMessage(content=WRITER), UserMessage(content=task, source="user")])
        handle = writer.retain_context(result.content)
        rounds.append({"id": handle.context_id, "text": result.content, "task": task})
    return rounds, writer


async def read(url: str, api_key: str | None, rounds: list[dict], phase: str, warm: bool) -> None:
    """Process 2: in each round each reader reads the writer's reply naming its context."""
    readers = {name: client(url, api_key, name, 12) for name in READERS}
    if warm:
        for name, reader in readers.items():
            await reader.create([SystemMessage(content=READERS[name]), UserMessage(content="Say hello.", source="user")])
    for number, entry in enumerate(rounds, 1):
        for name, reader in readers.items():
            messages = [SystemMessage(content=READERS[name]), UserMessage(content=entry["text"], source="writer"),
                        UserMessage(content="Is that right?", source="user")]
            await reader.create(messages, extra_create_args={"context_ids": [entry["id"]]})
            call = reader.last_call
            reused, tokens = call.slots.get("writer#0", (0, 0))
            ttft = f"{call.provenance.ttft_s * 1e3:.0f} ms" if call.provenance.ttft_s is not None else "n/a"
            print(f"  [{phase}, round {number}] {name:<8} context {call.contexts[entry['id']]:<8} reused {reused:>2} of "
                  f"{tokens} context tokens; prompt {call.provenance.prompt_tokens}: {call.provenance.exact_tokens} exact, "
                  f"{call.provenance.estimated_tokens} estimated, {call.provenance.computed_tokens} computed; TTFT {ttft}",
                  flush=True)
    for reader in readers.values():
        reader.backend.close()


def reader_process(url: str, api_key: str | None, rounds: list[dict], phase: str, warm: bool) -> None:
    """Run ``read`` in a process of its own (the second agent process)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(rounds, handle)
    try:
        command = [sys.executable, __file__, "--role", "readers", "--url", url, "--rounds-file", handle.name,
                   "--phase", phase] + (["--warm"] if warm else [])
        env = {**os.environ, **({"KVCOMM_EXAMPLE_API_KEY": api_key} if api_key else {})}
        subprocess.run(command, check=True, env=env)
    finally:
        os.unlink(handle.name)


def start_server() -> tuple[subprocess.Popen, str]:
    """`kvcomm serve` on a free local port, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = open(os.path.join(tempfile.gettempdir(), "kvcomm-remote-team-server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "kvcomm.cli", "serve", "--port", str(port), "--gamma", "1",
                               "--max-model-len", "1024", "--block-size", "32"], stdout=log, stderr=subprocess.STDOUT,
                              env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"kvcomm serve exited with {server.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            time.sleep(2)
    server.terminate()
    raise SystemExit(f"kvcomm serve did not start within 600 s; see {log.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `kvcomm serve` (default: start one)")
    parser.add_argument("--api-key", help="one of the server's --api-key keys (both processes use it: one tenant)")
    parser.add_argument("--role", choices=("writer", "readers"), default="writer", help=argparse.SUPPRESS)
    parser.add_argument("--rounds-file", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="retained", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    api_key = args.api_key or os.environ.get("KVCOMM_EXAMPLE_API_KEY")
    if args.role == "readers":
        with open(args.rounds_file) as handle:
            asyncio.run(read(args.url, api_key, json.load(handle), args.phase, args.warm))
        return
    server, url = (None, args.url) if args.url else start_server()
    try:
        rounds, writer = asyncio.run(write(url, api_key))
        for entry in rounds:
            record = writer.backend.context(entry["id"])
            print(f"writer (pid {os.getpid()}): {entry['task']!r} -> {entry['text']!r}: {record['tokens']} tokens retained "
                  f"as {entry['id']} ({record['bytes']} bytes of KV, {record['state']})", flush=True)
        print("readers (another process), the contexts retained:", flush=True)
        reader_process(url, api_key, rounds, "retained", warm=True)
        released = [writer.release_context(entry["id"]) for entry in rounds]
        print(f"writer: released {sum(released)} contexts; states "
              f"{sorted({writer.backend.context(e['id'])['state'] for e in rounds})}", flush=True)
        print("readers (another process), the last round again after the release:", flush=True)
        reader_process(url, api_key, rounds[-1:], "released", warm=False)
        request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(request, timeout=30) as response:
            lines = [line for line in response.read().decode().splitlines() if line.startswith("kvcomm_context_")]
        print("server metrics:\n  " + "\n  ".join(line for line in lines if not line.endswith(" 0.0")))
    finally:
        if server is not None:
            server.terminate()
            server.wait(120)


if __name__ == "__main__":
    main()
