"""A remote team: agents in two processes against one `kvcomm serve`, passing context handles.

What kvcomm is for: agents that read the same long text. Process 1 (this one) runs the
writer: it has the server keep ``design_note.md`` (766 words, about 1,000 tokens) as a context
(``retain_context``), answers three questions about it, retains each reply as a context too,
and hands the context ids and texts to process 2. Process 2 runs two readers (reviewer,
editor), each a separate AutoGen client with a system message of its own, that read the note
and a reply naming both contexts (``extra_create_args={"context_ids": [...]}``): the server
serves their tokens from the KV it keeps, by the rules any shared content is reused by. From
each reader's first call on, the server computes the reader's new system message (a computed
preamble) and serves the note after it; a reply's slot is served cold in the first round, then
computed and learned from until it holds two anchors, and estimated after that. Then process 1
releases the contexts and process 2 asks the last round's questions again: the requests fall
back to the text, succeed, and say so. Process 2 prints, per round and agent, each context's
outcome, the call's reason in words and its end-to-end TTFT.

    .venv/bin/python examples/remote_team.py                     # starts its own `kvcomm serve` (a minute or two on a CPU)
    .venv/bin/python examples/remote_team.py --url http://localhost:8000 [--api-key K] [--session TEAM]

Behind a router in front of several replicas (``python -m kvcomm.integrations.serve.replicas``),
both processes send one session key (``--session``; default one per tenant), so the contexts
the writer retains and the readers' calls land on the same replica.
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
from pathlib import Path

from autogen_core.models import SystemMessage, UserMessage

from kvcomm.integrations.autogen.client import KvcommChatCompletionClient

NOTE = (Path(__file__).resolve().parent / "design_note.md").read_text(encoding="utf-8")
WRITER = "You answer questions about design notes briefly."
READERS = {
    "reviewer": "You review the answer in one sentence.",
    "editor": "You shorten the answer to five words.",
}
TASKS = ["What is the main risk?", "What does the proposal change?", "Which alternative was rejected?"]
MAX_TOKENS = 16


def client(url: str, api_key: str | None, name: str) -> KvcommChatCompletionClient:
    session = os.environ.get("KVCOMM_EXAMPLE_SESSION")  # --session, passed on to the readers' process
    return KvcommChatCompletionClient.remote(url, api_key=api_key, agent_name=name, max_tokens=MAX_TOKENS, session=session)


async def write(url: str, api_key: str | None) -> tuple[dict, list[dict], KvcommChatCompletionClient]:
    """Process 1: the note retained as a context, then the writer's replies, each retained:
    ({"id"}, [{"id", "text", "task"}], client)."""
    writer = client(url, api_key, "writer")
    note = {"id": writer.retain_context(NOTE).context_id}
    rounds = []
    for task in TASKS:
        messages = [SystemMessage(content=WRITER), UserMessage(content=NOTE, source="user"),
                    UserMessage(content=task, source="user")]
        result = await writer.create(messages, extra_create_args={"context_ids": [note["id"]]})
        handle = writer.retain_context(result.content)
        rounds.append({"id": handle.context_id, "text": result.content, "task": task})
    return note, rounds, writer


async def read(url: str, api_key: str | None, note: dict, rounds: list[dict], phase: str) -> None:
    """Process 2: in each round each reader reads the note and the writer's reply, naming both contexts."""
    readers = {name: client(url, api_key, name) for name in READERS}
    for number, entry in enumerate(rounds, 1):
        for name, reader in readers.items():
            messages = [SystemMessage(content=READERS[name]), UserMessage(content=NOTE, source="user"),
                        UserMessage(content=entry["text"], source="writer"),
                        UserMessage(content=f"Question: {entry['task']} Is that answer right?", source="user")]
            await reader.create(messages, extra_create_args={"context_ids": [note["id"], entry["id"]]})
            call = reader.last_call
            ttft = f"{call.provenance.ttft_s * 1e3:.0f} ms" if call.provenance.ttft_s is not None else "n/a"
            print(f"  [{phase}, round {number}] {name:<8} note {call.contexts[note['id']]:<8} reply "
                  f"{call.contexts[entry['id']]:<8} TTFT {ttft}, wall {call.latency_s * 1e3:.0f} ms: {call.reason}",
                  flush=True)
    for reader in readers.values():
        reader.backend.close()


def reader_process(url: str, api_key: str | None, note: dict, rounds: list[dict], phase: str) -> None:
    """Run ``read`` in a process of its own (the second agent process)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"note": note, "rounds": rounds}, handle)
    try:
        command = [sys.executable, __file__, "--role", "readers", "--url", url, "--rounds-file", handle.name,
                   "--phase", phase]
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
                               "--max-model-len", "2048", "--block-size", "32"], stdout=log, stderr=subprocess.STDOUT,
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
    parser.add_argument("--session", help="the team's session key for a router (both processes send it; default: one per tenant)")
    parser.add_argument("--role", choices=("writer", "readers"), default="writer", help=argparse.SUPPRESS)
    parser.add_argument("--rounds-file", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="retained", help=argparse.SUPPRESS)
    args = parser.parse_args()
    api_key = args.api_key or os.environ.get("KVCOMM_EXAMPLE_API_KEY")
    if args.session:
        os.environ["KVCOMM_EXAMPLE_SESSION"] = args.session
    if args.role == "readers":
        with open(args.rounds_file) as handle:
            shared = json.load(handle)
        asyncio.run(read(args.url, api_key, shared["note"], shared["rounds"], args.phase))
        return
    server, url = (None, args.url) if args.url else start_server()
    try:
        note, rounds, writer = asyncio.run(write(url, api_key))
        record = writer.backend.context(note["id"])
        print(f"writer (pid {os.getpid()}): the design note, {record['tokens']} tokens, retained as {note['id']}", flush=True)
        for entry in rounds:
            record = writer.backend.context(entry["id"])
            print(f"writer (pid {os.getpid()}): {entry['task']!r} -> {entry['text']!r}: {record['tokens']} tokens retained "
                  f"as {entry['id']} ({record['bytes']} bytes of KV, {record['state']})", flush=True)
        print("readers (another process), the contexts retained:", flush=True)
        reader_process(url, api_key, note, rounds, "retained")
        released = [writer.release_context(entry["id"]) for entry in [note, *rounds]]
        print(f"writer: released {sum(released)} contexts; states "
              f"{sorted({writer.backend.context(e['id'])['state'] for e in [note, *rounds]})}", flush=True)
        print("readers (another process), the last round again after the release:", flush=True)
        reader_process(url, api_key, note, rounds[-1:], "released")
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
