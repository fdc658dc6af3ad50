"""`kvcomm serve` under hostile input and under a long multi-tenant load (issue 39's must-shows
2 and 3, issue 48's cases and default-flags soak), against real servers started here.

    .venv/bin/python benchmarks/bench_serve_hostile.py [--fuzz 2000] [--soak 5000] [--clients 16]
        [--tenants 4] [--max-tenant-bytes B] [--max-total-bytes B] [--step-tokens 128]
        [--probe-rounds 5] [--depths 900,10000] [--no-baseline] [--no-cases] [--log-dir DIR] [--json]

The main server gets ``--tenants`` API keys after one ``--api-key`` flag, ``--state-dir`` (saved
at exit only) and no byte caps unless ``--max-tenant-bytes`` / ``--max-total-bytes`` are given:
its default caps are read from its start-up line. In order, on that server: issue 48's cases
``every_method``, ``huge_numbers``, ``batch_probe`` and each key on five routes
(``hostile_cases``), the fuzz, ``deep_bodies`` (restarting the server if a body stops it), the
soak; then ``corrupt_restart`` (its saved state damaged, the same server started again), the
``key_forms`` servers (``--max-model-len 512``, stopped at once), and the ``--no-plan`` baseline.

Fuzz: ``--fuzz`` malformed or oversized requests (``hostile_bodies``: wrong types, spans out of
range, segment ids sent again with other content, 10 MB strings, huge max_tokens, prompts built
to blow up detection, bodies that are not JSON, forged tenant and salt fields) from 4 client
threads over the tenants, while one streaming "canary" request after another runs beside them:
the longest gap between two of the canary's tokens bounds the longest engine step it saw, vLLM's
own work (at most ``--step-tokens`` tokens a step), kvcomm's and the machine's other jobs
together. kvcomm's own work per engine step is read from the server's ``/metrics``
(``kvcomm_step_seconds`` and ``kvcomm_step_max_seconds`` per side: worker hooks, scheduler
hooks, RPCs to the workers; ``kvcomm.integrations.vllm.connector.step_time``), scraped before and after: steps,
p99 (a histogram bucket's upper bound) and the longest step since the server started, wall and
thread CPU time. Then each tenant sends, as its first sighting, a prompt another tenant taught
the server: any exact or estimated kvcomm token, or vLLM prefix-cache hit, there is a
cross-tenant hit. Unless ``--no-baseline``, the same fuzz then runs against a second server
started with ``--no-plan`` (kvcomm's planning off; its middleware still checks keys and sets
each tenant's cache salt), for the canary's gaps without planning. Printed: "F
hostile requests: C engine crashes, longest kvcomm work in one engine step S ms (worker W ms,
scheduler X ms, RPCs P ms), longest canary gap G ms (G0 ms without planning), H
cross-tenant hits, L bytes of log per request". S is W + X + P, a bound: the three longest may
come from different steps, and several RPCs may run between two steps.

Soak: ``--soak`` annotated requests from ``--clients`` threads over ``--tenants`` API keys (each
tenant its own documents, 40 of them), every response checked, while one more thread creates and
releases retained contexts through ``/v1/kvcomm/contexts``; every 2 s the server's
``kvcomm_tenant_bytes`` (each tenant's bytes, as the engine process exports them), the RSS of
the server's process tree and the RSS of its worker process are sampled. The worker's bound: the
server's total cap (given, or its default) plus its capture budget (the KV of requests in
flight) plus the worker's RSS right after start-up, before any request (vLLM's own footprint,
which stays flat under this load with kvcomm's planning off: docs/measurements/2026-12-07-soak-memory.md).
Printed: "N requests, K clients, T tenants: E errors, tenant bytes over the tenant cap (if one),
RSS drift D% after warm-up, worker RSS at most W (bound)"
(drift: the median of the last tenth of samples against the median of the tenth after the
first fifth of requests). Also counted: planned requests whose note says they learned nothing
because vLLM's prefix cache served them blocks that may hold approximate KV (the
approximate-block rule, ``kvcomm.integrations.vllm.connector.scheduler``).

Headline (``headline``, last in the JSON): server exits (engine crashes in the fuzz, deep bodies
that stopped the server, a server not alive after a case or the soak), unauthenticated 2xx
other than health probes, cross-tenant hits (the fuzz's probe and the batch route's timing
probe), ``Traceback`` lines in every server's log (``serve_process.traceback_lines``).

Server flags as the tests use them (embedded SmolLM2, fp32, 32-token blocks, 8 sequences,
1024-token context, one OpenMP thread, vLLM's default process layout: ``serve_process``).
Figures and their conditions go in ``docs/measurements/``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from hostile_cases import (batch_probe, check_keys, corrupt_restart, deep_bodies, every_method,  # this folder is on sys.path
                           huge_numbers, key_forms)
from serve_process import Server, metric_samples, traceback_lines, tree_rss, worker_pid

BIG = "x" * 10_000_000
WORDS = ("pump station generator filter schedule bridge river valley report engineer budget invoice "
         "contract delay shipment warehouse audit sensor alarm backup").split()


HEAD = "You are a careful assistant. Read the document and answer briefly.\n"


def annotated(tokenizer, document: str, question: str, head: str = HEAD) -> tuple[list[int], dict]:
    """A prompt (instruction, the shared document, a question) and its kvcomm annotation."""
    head = tokenizer.encode(head)
    doc = tokenizer.encode(f"Document: {document}\n")
    ids = head + doc + tokenizer.encode(f"Question: {question}\nAnswer:")
    return ids, {"template": "qa", "segments": [{"start": len(head), "end": len(head) + len(doc), "slot": "doc"}]}


def documents(tenant: int, count: int) -> list[str]:
    rng = random.Random(1000 + tenant)
    return [f"Tenant {tenant} case {n}: " + " ".join(rng.choice(WORDS) for _ in range(40)) + "." for n in range(count)]


def hostile_bodies(tokenizer, model: str, count: int, seed: int = 0) -> list[object]:
    """``count`` malformed or oversized requests (dicts for JSON bodies, bytes for raw ones),
    cycling through the kinds in ``kinds`` with random variations."""
    rng = random.Random(seed)
    ids, good = annotated(tokenizer, documents(99, 1)[0], "what failed?")
    span = good["segments"][0]
    other = list(reversed(ids))

    def body(**over) -> dict:
        return {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, **over}

    def kv(**fields) -> dict:
        return {"kv_transfer_params": {"kvcomm": {**good, **fields}}}

    kinds = [
        lambda: body(**kv(template=BIG)),
        lambda: body(**kv(segments=[{**span, "slot": BIG[: rng.choice([300, 10_000, 10_000_000])]}])),
        lambda: body(**kv(segments=[{**span, "id": BIG[: rng.choice([300, 1_000_000])]}])),
        lambda: body(**kv(segments=[{**span, "start": rng.choice([BIG[:10], -5, 3.5, None, [1]])}])),
        lambda: body(**kv(segments=[span] * rng.choice([513, 100_000]))),
        lambda: body(**kv(segments=[{**span, "end": rng.choice([10**12, len(ids) + 1, 0])}])),
        lambda: body(**kv(segments={"start": 0})),
        lambda: body(kv_transfer_params={"kvcomm": rng.choice([[1, 2], "x", 7, None])}),
        lambda: body(kv_transfer_params=rng.choice(["kvcomm", [1], 3])),
        lambda: body(kv_transfer_params={"kvcomm": {}}, max_tokens=rng.choice([10**9, -1, 0, "many"])),
        lambda: body(prompt=other, **kv(segments=[{**span, "id": f"doc-{rng.randrange(4)}"}])),  # ids bound to other content
        lambda: body(prompt=[ids[0]] * rng.choice([500, 1000]), kv_transfer_params={"kvcomm": {}}),  # detection bomb
        lambda: body(prompt=[rng.randrange(100, 400) for _ in range(900)], kv_transfer_params={"kvcomm": {}}),
        lambda: body(kv_transfer_params={"kvcomm": {"tenant": BIG[: rng.choice([300, 50])]}}),  # forged tenant
        lambda: body(cache_salt=rng.choice([BIG, "victim-salt"]), kv_transfer_params={"kvcomm": {}}),  # forged salt
        lambda: body(prompt=BIG[: rng.choice([5_000, 100_000])]),
        lambda: b"not json",
        lambda: b"[1, 2, 3]",
        lambda: b"{" * rng.choice([1000, 100_000]),
        lambda: json.dumps(body()).encode()[:-1],
    ]
    bodies = [kinds[i % len(kinds)]() for i in range(count)]
    for i in range(10, count, 10):  # the id rebinding needs the id first bound to this content
        if i % len(kinds) == 10:
            bodies[i - 1] = body(**kv(segments=[{**span, "id": f"doc-{rng.randrange(4)}"}]))
    return bodies


def _post(client: httpx.Client, url: str, body: object, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(url + "/v1/completions", content=content, headers=headers, timeout=600).status_code


def canary(url: str, model: str, key: str, tokenizer, stop_event: threading.Event, gaps: list[float]) -> None:
    """Stream one short completion after another; record every gap between two tokens."""
    ids, _ = annotated(tokenizer, "the canary document.", "count to twenty")
    body = {"model": model, "prompt": ids, "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client() as client:
        while not stop_event.is_set():
            last = None
            with client.stream("POST", url + "/v1/completions", json=body, timeout=600,
                               headers={"Authorization": f"Bearer {key}"}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now


def fuzz(server: Server, keys: list[str], tokenizer, count: int) -> dict:
    url, model, log = server.url, server.model, server.log
    bodies = hostile_bodies(tokenizer, model, count)
    log_before = log.stat().st_size
    metrics_before = metric_samples(url, keys[0])
    stop_event, gaps = threading.Event(), []
    probe = threading.Thread(target=canary, args=(url, model, keys[0], tokenizer, stop_event, gaps))
    probe.start()
    started = time.perf_counter()
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda item: _post(client, url, item[1], keys[item[0] % len(keys)]), enumerate(bodies)))
    seconds = time.perf_counter() - started
    stop_event.set()
    probe.join()
    metrics_after = metric_samples(url, keys[0])
    steps, cpu = step_figures(metrics_before, metrics_after), step_figures(metrics_before, metrics_after, "cpu_")
    cross = cross_tenant_hits(url, model, keys, tokenizer)
    text = log.read_text(errors="replace")
    crashes = int(not server.alive()) + text.count("EngineDeadError") + text.count("encountered a fatal error")
    bad = [s for s in statuses if not (s == 200 or 400 <= s < 500)]
    return {"requests": count, "seconds": seconds, "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "non_4xx_failures": len(bad), "engine_crashes": crashes, "longest_gap_ms": 1000 * max(gaps, default=0.0),
            "median_gap_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
            "p99_gap_ms": 1000 * statistics.quantiles(gaps, n=100)[-1] if len(gaps) > 1 else 0.0,
            "canary_gaps": len(gaps), "kvcomm_step": steps, "kvcomm_step_cpu": cpu,
            "kvcomm_longest_step_ms": sum(steps[side]["longest_ms"] for side in steps),
            "cross_tenant_hits": cross, "tracebacks": traceback_lines(text),
            "log_bytes_per_request": (log.stat().st_size - log_before) / (count + 1)}


def cross_tenant_hits(url: str, model: str, keys: list[str], tokenizer) -> int:
    """Each tenant teaches a prompt of its own (twice, so it is stored), then the next tenant
    sends it as its first sighting: kvcomm's exact + estimated tokens and vLLM's cached tokens
    there, summed over tenants (0 when isolated). Every token of the prompt is new to the
    second tenant (its instruction too), so whatever it reuses there is the first tenant's."""
    hits = 0
    with httpx.Client() as client:
        for t, key in enumerate(keys):
            secret = f"{random.Random(t).random()}"
            ids, kvcomm = annotated(tokenizer, f"secret {secret} of tenant {t}.", "what is it?",
                                    head=f"Probe {secret}: keep this private.\n")
            body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                    "kv_transfer_params": {"kvcomm": kvcomm}}
            for _ in range(2):
                client.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
            other = keys[(t + 1) % len(keys)]
            reply = client.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {other}"},
                                timeout=600).json()
            summary = reply["kv_transfer_params"]["kvcomm"]
            hits += summary.get("exact_tokens", 0) + summary.get("estimated_tokens", 0)
            hits += (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return hits


def tenant_bytes(client: httpx.Client, url: str, key: str) -> list[float]:
    return [value for (name, labels), value in metric_samples(url, key, client).items()
            if name == "kvcomm_tenant_bytes" and labels]


def step_figures(before: dict, after: dict, clock: str = "") -> dict:
    """kvcomm's time per engine step and side (``kvcomm.integrations.vllm.connector.step_time``) between two
    scrapes: steps observed, their p99 (the upper bound of the histogram bucket that holds it, in
    ms) and the longest step since the server started (the max gauge, in ms); ``clock``: "" for
    wall time, "cpu_" for the thread's CPU time."""
    figures = {}
    for side in ("worker", "scheduler", "rpc"):
        buckets = sorted(((float(dict(labels)["le"]), value - before.get((name, labels), 0.0))
                          for (name, labels), value in after.items()
                          if name == f"kvcomm_step_{clock}seconds_bucket" and dict(labels).get("side") == side))
        total = buckets[-1][1] if buckets else 0.0
        p99 = next((le for le, count in buckets if count >= 0.99 * total), float("nan")) if total else 0.0
        longest = after.get((f"kvcomm_step_{clock}max_seconds", (("side", side),)))
        figures[side] = {"steps": int(total), "p99_ms_at_most": 1000 * p99,
                         "longest_ms": float("nan") if longest is None else 1000 * longest}
    return figures


def logged_caps(text: str) -> dict:
    """The byte caps the server says it uses (its printed command line's connector config):
    ``{"max_tenant_bytes": int | None, "max_total_bytes": int | None, "max_capture_bytes": int}``
    (the capture budget: the config's, else the connector's default)."""
    from kvcomm.integrations.vllm.wire.config import DEFAULT_MAX_CAPTURE_BYTES

    caps = {}
    for name in ("max_tenant_bytes", "max_total_bytes", "max_capture_bytes"):
        found = re.findall(rf'"{name}": (\d+|null)', text)
        caps[name] = int(found[-1]) if found and found[-1] != "null" else None
    caps["max_capture_bytes"] = caps["max_capture_bytes"] or DEFAULT_MAX_CAPTURE_BYTES
    return caps


def soak(server: Server, keys: list[str], tokenizer, count: int, clients: int, caps: dict) -> dict:
    """``count`` annotated requests from ``clients`` threads over ``keys``, while one more thread
    creates and releases retained contexts (``/v1/kvcomm/contexts``, one tenant after another,
    at most one retained per tenant, ``count // 25`` creates spread over the run); every 2 s the
    tenants' bytes, the RSS of the server's tree and of its worker process are sampled. The
    worker's bound: ``caps["max_total_bytes"]`` (the reuse state's cap the server uses) plus
    ``caps["max_capture_bytes"]`` (the captures in flight) plus its RSS right after start-up
    (``server.footprint``: vLLM's own); samples over the reuse cap plus the footprint alone are
    counted too (``worker_over_reuse_cap_samples``)."""
    url, model, pid = server.url, server.model, server.process.pid
    worker = worker_pid(pid)
    docs = {key: documents(t, 40) for t, key in enumerate(keys)}
    done, errors, samples, notes = [0], [], [], []
    contexts = {"created": 0, "refused": 0, "released": 0, "errors": []}
    lock, stop_event = threading.Lock(), threading.Event()

    def client_thread(index: int) -> None:
        rng = random.Random(index)
        key = keys[index % len(keys)]
        with httpx.Client() as client:
            while True:
                with lock:
                    if done[0] >= count:
                        return
                    done[0] += 1
                ids, kvcomm = annotated(tokenizer, rng.choice(docs[key]), f"question {rng.randrange(50)}?")
                body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0,
                        "kv_transfer_params": {"kvcomm": kvcomm}}
                try:
                    reply = client.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                        timeout=600)
                    summary = reply.json()["kv_transfer_params"]["kvcomm"] if reply.status_code == 200 else {}
                    if reply.status_code != 200 or "error" in summary:
                        errors.append(f"{reply.status_code}: {str(summary or reply.text)[:200]}")
                    else:
                        notes.append(summary.get("note") or "")
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                    errors.append(repr(error)[:200])

    def context_thread() -> None:
        creates = max(len(keys), count // 25)
        held: dict[str, str] = {}
        with httpx.Client() as client:
            def release(key: str) -> None:
                reply = client.post(f"{url}/v1/kvcomm/contexts/{held.pop(key)}/release", json={},
                                    headers={"Authorization": f"Bearer {key}"}, timeout=600)
                if reply.status_code == 200:
                    contexts["released"] += 1
                else:
                    contexts["errors"].append(f"release {reply.status_code}: {reply.text[:200]}")

            for n in range(creates):
                while done[0] < n * count // creates and not stop_event.wait(0.2):
                    pass
                key = keys[n % len(keys)]
                if key in held:
                    release(key)
                text = f"Context {n}. " + " ".join(docs[key][n % len(docs[key])] for _ in range(3))
                try:
                    reply = client.post(url + "/v1/kvcomm/contexts", json={"text": text},
                                        headers={"Authorization": f"Bearer {key}"}, timeout=600)
                    if reply.status_code == 200:
                        contexts["created"] += 1
                        held[key] = reply.json()["id"]
                    elif reply.status_code == 409:
                        contexts["refused"] += 1
                    else:
                        contexts["errors"].append(f"create {reply.status_code}: {reply.text[:200]}")
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    contexts["errors"].append(repr(error)[:200])
            for key in list(held):
                release(key)

    def rss(process_id: int | None) -> int:
        import psutil

        try:
            return psutil.Process(process_id).memory_info().rss if process_id else 0
        except psutil.NoSuchProcess:
            return 0

    def sampler() -> None:
        with httpx.Client() as client:
            while not stop_event.wait(2):
                samples.append((done[0], tenant_bytes(client, url, keys[0]), tree_rss(pid), rss(worker)))

    watcher = threading.Thread(target=sampler)
    watcher.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=context_thread))
    for thread in threads:
        thread.start()
    for thread in threads[:-1]:
        thread.join()
    seconds = time.perf_counter() - started
    stop_event.set()
    threads[-1].join()
    watcher.join()
    held = [b for _, sample, _, _ in samples for b in sample]
    warm = [tree for n, _, tree, _ in samples if n >= count // 5]
    tenth = max(1, len(warm) // 10)
    drift = (statistics.median(warm[-tenth:]) / statistics.median(warm[:tenth]) - 1) if warm else float("nan")
    workers = [w for _, _, _, w in samples]
    tenant_cap, total_cap = caps.get("max_tenant_bytes"), caps.get("max_total_bytes")
    bound = None if total_cap is None else total_cap + caps.get("max_capture_bytes", 0) + server.footprint
    tight = None if total_cap is None else total_cap + server.footprint
    return {"requests": count, "clients": clients, "tenants": len(keys), "seconds": seconds, "errors": len(errors),
            "first_errors": errors[:3], "planned": len(notes),
            "approximate_notes": sum("approximate" in note for note in notes), "samples": len(samples),
            "max_tenant_bytes_seen": max(held, default=0.0), "max_total_bytes_seen": max(
                (sum(sample) for _, sample, _, _ in samples), default=0.0),
            "cap": tenant_cap, "caps": caps, "over_cap_samples": sum(b > tenant_cap for b in held) if tenant_cap else 0,
            "rss_drift": drift, "rss_mib_after_warmup": statistics.median(warm[:tenth]) / 2**20 if warm else float("nan"),
            "tree_rss_max_mib": max((t for _, _, t, _ in samples), default=0) / 2**20,
            "worker_pid_found": worker is not None, "worker_footprint_mib": server.footprint / 2**20,
            "worker_rss_max_mib": max(workers, default=0) / 2**20,
            "worker_rss_bound_mib": None if bound is None else bound / 2**20,
            "worker_over_bound_samples": None if bound is None else sum(w > bound for w in workers),
            "worker_over_reuse_cap_samples": None if tight is None else sum(w > tight for w in workers),
            "contexts": {**contexts, "errors": len(contexts["errors"]), "first_errors": contexts["errors"][:3]}}


def headline(result: dict) -> dict:
    """The four counters issue 48 asks to be 0: server exits, unauthenticated 2xx other than
    health probes, cross-tenant hits, ``Traceback`` lines in the servers' logs."""
    runs = [result.get(name, {}) for name in ("fuzz", "fuzz_without_planning")]
    cases = result.get("cases", {})
    exits = sum(r.get("engine_crashes", 0) for r in runs) + cases.get("deep_bodies", {}).get("server_exits", 0)
    exits += sum(not c.get("server_alive_after", True) for c in cases.values() if isinstance(c, dict))
    exits += int(not result.get("alive_after_soak", True))
    return {"server_exits": exits,
            "unauthenticated_2xx": cases.get("every_method", {}).get("unauthenticated_2xx", 0),
            "cross_tenant_hits": sum(r.get("cross_tenant_hits", 0) for r in runs)
            + cases.get("batch_probe", {}).get("cross_tenant_hits", 0),
            "tracebacks": result.get("tracebacks", {}).get("total", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz", type=int, default=2000, help="hostile requests (default 2000)")
    parser.add_argument("--soak", type=int, default=5000, help="soak requests (default 5000)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--max-tenant-bytes", type=int, help="give the server this cap (default: none, its default)")
    parser.add_argument("--max-total-bytes", type=int, help="give the server this cap (default: none, its default)")
    parser.add_argument("--step-tokens", type=int, default=128, help="vLLM's --max-num-batched-tokens (default 128)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the fuzz phase against a second server started with --no-plan")
    parser.add_argument("--no-cases", action="store_true", help="skip issue 48's cases (hostile_cases)")
    parser.add_argument("--probe-rounds", type=int, default=5, help="rounds of the batch route's timing probe")
    parser.add_argument("--depths", default="900,10000", help="nesting depths of the deep bodies")
    parser.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary folder, removed)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    keys = [f"bench-hostile-tenant-{t}" for t in range(args.tenants)]
    result, cases, servers = {}, {}, []
    caps = [flag for name in ("max_tenant_bytes", "max_total_bytes") if getattr(args, name) is not None
            for flag in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.log_dir or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        state = Path(scratch) / "state"
        server = Server(folder, "main", keys, *caps, "--max-num-batched-tokens", str(args.step_tokens),
                        "--state-dir", str(state), "--save-interval", "86400")
        servers.append(server)
        server.start()
        used = logged_caps(server.log_text())
        result["server"] = {"flags": caps or "default", "caps": used, "worker_footprint_mib": server.footprint / 2**20,
                            "worker_found": worker_pid(server.process.pid) is not None}
        try:
            if not args.no_cases:
                cases["every_method"] = every_method(server, keys)
                cases["huge_numbers"] = huge_numbers(server, keys)
                cases["batch_probe"] = batch_probe(server, keys, args.probe_rounds)
                cases["keys_on_main"] = {"form": f"--api-key {' '.join(f'K{t}' for t in range(len(keys)))}",
                                         **check_keys(server, keys)}
            if args.fuzz:
                result["fuzz"] = fuzz(server, keys, tokenizer, args.fuzz)
            if not args.no_cases:
                depths = tuple(int(d) for d in args.depths.split(","))
                cases["deep_bodies"] = deep_bodies(server, keys, depths)
            if args.soak:
                result["soak"] = soak(server, keys, tokenizer, args.soak, args.clients, used)
                result["alive_after_soak"] = server.alive()
        finally:
            server.stop()
        if not args.no_cases:
            cases["corrupt_restart"] = corrupt_restart(server, state, keys)
            server.stop()
            cases["key_forms"] = key_forms(folder, [f for f in ("--api-key A --api-key B", "--api-key=A --api-key=B",
                                                                "VLLM_API_KEY=A --api-key B")])
        if args.fuzz and not args.no_baseline:  # the same load without kvcomm's planning
            baseline = Server(folder, "no-plan", keys, *caps, "--max-num-batched-tokens", str(args.step_tokens),
                              "--no-plan")
            servers.append(baseline)
            baseline.start()
            try:
                result["fuzz_without_planning"] = fuzz(baseline, keys, tokenizer, args.fuzz)
            finally:
                baseline.stop()
        if cases:
            result["cases"] = cases
        counted = {s.name: s.tracebacks() for s in servers}
        counted["key_forms"] = cases.get("key_forms", {}).get("tracebacks", 0)
        result["tracebacks"] = {**counted, "total": sum(counted.values())}
    result["headline"] = headline(result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "fuzz" in result:
        f, steps = result["fuzz"], result["fuzz"]["kvcomm_step"]
        g0 = result.get("fuzz_without_planning", {}).get("longest_gap_ms", float("nan"))
        print(f"{f['requests']} hostile requests in {f['seconds']:.0f} s: {f['engine_crashes']} engine crashes, "
              f"{f['non_4xx_failures']} answers neither 200 nor 4xx, longest kvcomm work in one engine step "
              f"{f['kvcomm_longest_step_ms']:.0f} ms (worker {steps['worker']['longest_ms']:.0f} ms, scheduler "
              f"{steps['scheduler']['longest_ms']:.0f} ms, RPCs {steps['rpc']['longest_ms']:.0f} ms), "
              f"longest canary gap {f['longest_gap_ms']:.0f} ms ({g0:.0f} ms without planning), "
              f"{f['cross_tenant_hits']} cross-tenant hits, {f['log_bytes_per_request']:.0f} bytes of log per request; "
              f"statuses {f['statuses']}")
        print("kvcomm per engine step: " + "; ".join(
            f"{side} {v['steps']} steps, p99 <= {v['p99_ms_at_most']:g} ms, longest {v['longest_ms']:.1f} ms "
            f"(CPU {f['kvcomm_step_cpu'][side]['longest_ms']:.1f} ms)" for side, v in steps.items()))
    if "fuzz_without_planning" in result:
        b = result["fuzz_without_planning"]
        print(f"without planning: longest canary gap {b['longest_gap_ms']:.0f} ms (median {b['median_gap_ms']:.0f}, "
              f"p99 {b['p99_gap_ms']:.0f}, {b['canary_gaps']} gaps); with: median {f['median_gap_ms']:.0f}, "
              f"p99 {f['p99_gap_ms']:.0f}, {f['canary_gaps']} gaps")
    if "soak" in result:
        s = result["soak"]
        print(f"{s['requests']} requests, {s['clients']} clients, {s['tenants']} tenants in {s['seconds']:.0f} s: "
              f"{s['errors']} errors, {s['approximate_notes']} of {s['planned']} planned requests learned nothing "
              f"(approximate blocks), {s['over_cap_samples']} tenant samples over the cap {s['cap']} "
              f"(max {s['max_tenant_bytes_seen']:.0f}, {s['samples']} samples), RSS drift {100 * s['rss_drift']:+.1f}% "
              f"after warm-up ({s['rss_mib_after_warmup']:.0f} MiB); worker RSS at most {s['worker_rss_max_mib']:.0f} "
              f"MiB (footprint {s['worker_footprint_mib']:.0f} MiB, bound {s['worker_rss_bound_mib']} MiB at caps "
              f"{s['caps']}); contexts {s['contexts']['created']} created, {s['contexts']['released']} released, "
              f"{s['contexts']['refused']} refused, {s['contexts']['errors']} errors")
    if cases:
        for name, case in cases.items():
            shown = {k: v for k, v in case.items() if not isinstance(v, (list, dict)) or k in ("statuses", "median_s")}
            print(f"{name}: {json.dumps(shown)}")
    print(f"headline: {json.dumps(result['headline'])}")


if __name__ == "__main__":
    main()
