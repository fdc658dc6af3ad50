"""`kvcomm serve --state-dir` restarted with gigabytes of saved state: how long the start takes,
and what the first opted-in request after it costs (issue 48: with 6.3 GB saved, the planner was
built and every tenant restored inside the first request's engine step: 14.0 s, and the step with it).

    .venv/bin/python benchmarks/bench_serve_restart.py [--gigabytes 2] [--json]

Phase 1: a server (default flags, vLLM's multiprocess engine, ``--state-dir`` in a temporary
folder, a save every 10 s) is taught two agents reading one distinct ~1,400-token document each,
from 4 client threads, until its saves on disk hold ``--gigabytes`` (exact prefixes are held but
not saved); then it stops, saving at exit. Phase 2: a second server starts on that folder. Printed: the
saved bytes, the time from the command to the first answer of ``/v1/models`` (start-up, restore
included), then the first opted-in request's wall time, its kvcomm tokens (exact / estimated /
computed: reuse from the restored state) and note, and kvcomm's longest step in the worker and
the longest RPC to the workers since the start (``kvcomm_step_max_seconds``, wall and thread
CPU time), and the same figures for a second request (which includes learning from the first).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import metric_samples  # noqa: E402

KEY = "bench-restart-key"
WORDS = ("pump station generator filter schedule bridge river valley report engineer budget invoice contract delay "
         "shipment warehouse audit sensor alarm backup turbine permit crane harbour ledger survey").split()
READERS = ("You summarize documents for the board in two sentences.\n", "You list the risks a document raises.\n")
STARTUP_TIMEOUT_S = 600


def start(log: Path, state: Path, save_interval_s: float) -> tuple[subprocess.Popen, str, str, float]:
    """`kvcomm serve --state-dir state` with default flags; (process, URL, model, seconds to answer)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "kvcomm.cli", "serve", "--port", str(port), "--api-key", KEY,
                                "--state-dir", str(state), "--save-interval", str(save_interval_s)],
                               stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - began < STARTUP_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"kvcomm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            reply = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            if reply.status_code == 200:
                return process, url, reply.json()["data"][0]["id"], time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"kvcomm serve did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def document(n: int, tokens: int, tokenizer) -> list[int]:
    rng = random.Random(n)
    ids = tokenizer.encode(f"Document {n}: ")
    while len(ids) < tokens:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(50)) + ".")
    return ids[:tokens]


def ask(client: httpx.Client, url: str, model: str, tokenizer, reader: int, doc: list[int]) -> tuple[float, dict]:
    """One annotated request (a reader's instruction, then the shared document); (seconds, kvcomm summary)."""
    head = tokenizer.encode(READERS[reader])
    ids = head + doc + tokenizer.encode("\nAnswer:")
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
            "kv_transfer_params": {"kvcomm": {"template": f"reader{reader}",
                                              "segments": [{"start": len(head), "end": len(head) + len(doc), "slot": "doc"}]}}}
    began = time.monotonic()
    reply = client.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    seconds = time.monotonic() - began
    reply.raise_for_status()
    return seconds, reply.json()["kv_transfer_params"]["kvcomm"]


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tenant_bytes(url: str) -> float:
    return sum(v for (name, labels), v in metric_samples(url, KEY).items() if name == "kvcomm_tenant_bytes" and labels)


def longest(url: str) -> dict:
    """kvcomm's longest step since the start per side, wall and thread CPU time, in ms."""
    samples = metric_samples(url, KEY)
    return {f"{side}{clock}": 1000 * samples.get((f"kvcomm_step_{'cpu_' if clock else ''}max_seconds", (("side", side),)),
                                                 float("nan"))
            for side in ("worker", "scheduler", "rpc") for clock in ("", "_cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=2.0, help="reuse state to save before the restart (default 2)")
    parser.add_argument("--doc-tokens", type=int, default=1400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    result: dict = {"target_bytes": int(args.gigabytes * 1e9)}
    with tempfile.TemporaryDirectory() as folder:
        state, log = Path(folder) / "state", Path(folder) / "server.log"
        process, url, model, result["first_start_s"] = start(log, state, 10)
        docs, saved = [], 0
        try:
            with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
                while saved < result["target_bytes"]:
                    batch = [document(len(docs) + i, args.doc_tokens, tokenizer) for i in range(8)]
                    docs += batch
                    list(pool.map(lambda pair: ask(client, url, model, tokenizer, *pair),
                                  [(r, d) for d in batch for r in (0, 1)]))
                    time.sleep(12)  # one save interval
                    saved = on_disk(state)
                    print(f"{len(docs)} documents, {tenant_bytes(url) / 1e9:.2f} GB held, {saved / 1e9:.2f} GB saved",
                          file=sys.stderr, flush=True)
                held = tenant_bytes(url)
        finally:
            process.terminate()
            process.wait(300)
        result |= {"documents": len(docs), "held_bytes": held,
                   "saved_bytes": on_disk(state)}
        process, url, model, result["restart_s"] = start(log, state, 86400)
        try:
            with httpx.Client() as client:
                result["steps_before_first_request_ms"] = longest(url)
                # the last documents: still in the pools (each slot keeps --max-anchors, 20 by default)
                for name, doc in (("first_request", docs[-1]), ("second_request", docs[-2])):
                    seconds, summary = ask(client, url, model, tokenizer, 0, doc)
                    result[name] = {"seconds": seconds, "longest_ms": longest(url),
                                    **{k: summary.get(k) for k in ("exact_tokens", "estimated_tokens", "computed_tokens",
                                                                   "fallback", "note")}}
                result["restored_bytes"] = tenant_bytes(url)
        finally:
            process.terminate()
            process.wait(300)
        result["log_lines_restored"] = [line for line in log.read_text().splitlines() if "restored" in line][-3:]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    first = result["first_request"]
    print(f"{result['saved_bytes'] / 1e9:.2f} GB saved ({result['documents']} documents, {result['held_bytes'] / 1e9:.2f} GB "
          f"held); restart to first answer {result['restart_s']:.1f} s (first start {result['first_start_s']:.1f} s); "
          f"first opted-in request {first['seconds']:.2f} s, exact/estimated/computed {first['exact_tokens']}/"
          f"{first['estimated_tokens']}/{first['computed_tokens']}, kvcomm's longest worker step since start "
          f"{first['longest_ms']['worker']:.0f} ms, longest RPC {first['longest_ms']['rpc']:.0f} ms; second request "
          f"{result['second_request']['seconds']:.2f} s")


if __name__ == "__main__":
    main()
