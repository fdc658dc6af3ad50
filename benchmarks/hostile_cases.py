"""The attack classes of issue 48 against a running `kvcomm serve` (``serve_process.Server``),
each a bounded loop that returns counts for the hostile benchmark's ``--json`` result:

- ``deep_bodies``: JSON nested 900 and 10,000 deep (inside ``kv_transfer_params``, arrays,
  ``messages``, ``tools``, ``response_format``) on every POST route, each followed by
  ``/health`` and a normal completion; server exits (restarted, up to a bound) and non-4xx answers.
- ``every_method``: every method (and a CORS preflight) on every route of the served app (its
  OpenAPI document, the route table kvcomm logs, the context API, variants of ``/metrics``) with
  no key, a wrong key and each key; unauthenticated 2xx other than the health probes, listed.
- ``batch_probe``: the cross-tenant timing probe on ``/v1/chat/completions/batch``.
- ``key_forms``: the forms the API key flags take, each key on five routes.
- ``corrupt_restart``: truncated and corrupt state files and a stray temp file at a restart.
- ``huge_numbers``: out-of-range numbers, NaN/Infinity and 5,000-digit integers in bodies.

Every request goes to 127.0.0.1; every loop has a fixed count and each request a timeout."""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import httpx

from serve_process import HEALTH_PROBES, Server, StartFailed, traceback_lines  # this folder is on sys.path

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
CONTEXT_ROUTES = {"/v1/kvcomm/contexts": {"GET", "POST"}, "/v1/kvcomm/contexts/{id}": {"GET"},
                  "/v1/kvcomm/contexts/{id}/retain": {"POST"}, "/v1/kvcomm/contexts/{id}/release": {"POST"}}
"""The context API's routes (answered by kvcomm's middleware, not in the app's route table)."""
VARIANTS = ("/metrics/", "/metrics/x", "/metrics?x=1", "//metrics", "/metrics;x", "/metrics#x", "/v1/models/",
            "/v1/kvcomm/contexts/", "/v1/kvcomm/contexts?tenant=default", "/health/", "/healthz", "/ping/x")
FASTAPI_ROUTES = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
WRONG_KEY = "bench-hostile-wrong-key"
WORDS = ("pump station generator filter schedule bridge river valley report engineer budget invoice contract delay "
         "shipment warehouse audit sensor alarm backup harbour crane ledger permit").split()


def _request(client: httpx.Client, method: str, url: str, key: str | None, content: bytes | None = None,
             headers: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    """(status, body); status 0 when no answer came (connection dropped, timeout)."""
    sent = {"Content-Type": "application/json"} if content is not None else {}
    if key:
        sent["Authorization"] = f"Bearer {key}"
    try:
        reply = client.request(method, url, content=content, headers={**sent, **(headers or {})}, timeout=timeout)
        return reply.status_code, reply.content
    except httpx.HTTPError:
        return 0, b""


def normal_completion(client: httpx.Client, server: Server, key: str) -> int:
    body = {"model": server.model, "prompt": "The river", "max_tokens": 1, "temperature": 0}
    return _request(client, "POST", server.url + "/v1/completions", key, json.dumps(body).encode(), timeout=300)[0]


# -- routes ------------------------------------------------------------------------------------

def served_routes(server: Server, key: str) -> dict[str, set[str]]:
    """Path -> methods of every route the served app has: its OpenAPI document (read with a key)
    and the route table kvcomm logs at its first request (``kvcomm: N routes; ...``: entries
    ``METHOD /path``, ``* /path`` for a mounted app), plus the context API and FastAPI's pages.
    Path parameters stay as ``{name}``; ``concrete`` fills them."""
    routes: dict[str, set[str]] = {}
    reply = httpx.get(server.url + "/openapi.json", headers=server.headers(key), timeout=60)
    if reply.status_code == 200:
        for path, entry in reply.json().get("paths", {}).items():
            routes.setdefault(path, set()).update(m.upper() for m in entry)
    httpx.get(server.url + "/v1/models", headers=server.headers(key), timeout=60)  # the table is logged at the first request
    line = next((ln for ln in server.log_text().splitlines() if re.match(r"kvcomm: \d+ routes", ln)), "")
    for method, path in re.findall(r"(?:^|[;:,] )([A-Z]+|\*) (/[^\s,;]*)", line):
        routes.setdefault(path, set()).update(METHODS if method == "*" else {method})
    for path, methods in CONTEXT_ROUTES.items():
        routes.setdefault(path, set()).update(methods)
    for path in FASTAPI_ROUTES:
        routes.setdefault(path, set())
    return routes


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def _probe_body(path: str, model: str | None) -> bytes:
    """A body that the route would serve if it were let through (so a leak shows as a 2xx)."""
    if path.startswith("/v1/kvcomm/contexts"):
        return json.dumps({"text": "a probe"}).encode()
    return json.dumps({"model": model, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1, "temperature": 0, "input": "hi"}).encode()


def every_method(server: Server, keys: list[str]) -> dict:
    """Every method and a CORS preflight on every route and variant, with no key, a wrong key
    and each key. Unauthenticated (no key or the wrong one) 2xx answers other than the health
    probes are listed; a CORS preflight answered by the CORS layer alone (no body beyond "OK",
    ``access-control-allow-methods`` set) is counted apart: it carries no data."""
    routes = served_routes(server, keys[0])
    paths = sorted({concrete(p) for p in routes} | set(VARIANTS))
    leaks, preflight_ok, statuses, keyed_2xx, sent = [], 0, {}, {}, 0
    started = time.perf_counter()
    with httpx.Client() as client:
        for path in paths:
            url = server.url + path
            for who, key in [("none", None), ("wrong", WRONG_KEY), *((f"key{i}", k) for i, k in enumerate(keys))]:
                tries = [(m, None) for m in METHODS] + [("OPTIONS", {"Origin": "http://attacker.example",
                                                                    "Access-Control-Request-Method": "POST",
                                                                    "Access-Control-Request-Headers": "authorization"})]
                for method, extra in tries:
                    content = _probe_body(path, server.model) if method in ("POST", "PUT", "PATCH") else None
                    status, body = _request(client, method, url, key, content, extra, timeout=120)
                    sent += 1
                    label = f"{method}{' preflight' if extra else ''}"
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                    if who.startswith("key"):
                        if 200 <= status < 300:
                            keyed_2xx[f"{label} {path}"] = keyed_2xx.get(f"{label} {path}", 0) + 1
                        continue
                    if not 200 <= status < 300 or path.split("?")[0] in HEALTH_PROBES:
                        continue
                    if extra and body.strip() in (b"", b"OK"):
                        preflight_ok += 1
                        continue
                    leaks.append(f"{label} {path} ({who} key): {status}, {len(body)} bytes")
    return {"routes": len(routes), "paths_tried": len(paths), "requests": sent, "seconds": time.perf_counter() - started,
            "statuses": dict(sorted(statuses.items())), "unauthenticated_2xx": len(leaks),
            "unauthenticated_2xx_list": leaks[:60], "preflights_answered_without_data": preflight_ok,
            "keyed_2xx_routes": len(keyed_2xx), "server_alive_after": server.alive()}


# -- deep bodies -------------------------------------------------------------------------------

def _deep_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _deep_array(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _deep_mixed(depth: int) -> str:
    return '{"a": [' * (depth // 2) + "1" + "]}" * (depth // 2)


def deep_kinds(model: str | None) -> dict[str, Callable[[int], str]]:
    """Name -> depth -> raw JSON body (bytes): a normal request with one field nested ``depth`` deep."""
    m = json.dumps(model)

    def body(fields: str) -> str:
        return '{"model": ' + m + ', "max_tokens": 1, "temperature": 0, ' + fields + "}"

    chat = '"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"'
    return {
        "kv_transfer_params": lambda d: body(chat + ', "kv_transfer_params": ' + _deep_object(d)),
        "kv_transfer_params.kvcomm": lambda d: body(chat + ', "kv_transfer_params": {"kvcomm": ' + _deep_object(d) + "}"),
        "kv_transfer_params array": lambda d: body(chat + ', "kv_transfer_params": {"x": ' + _deep_array(d) + "}"),
        "kv_transfer_params mixed": lambda d: body(chat + ', "kv_transfer_params": ' + _deep_mixed(d)),
        "prompt array": lambda d: body('"messages": [{"role": "user", "content": "hi"}], "prompt": ' + _deep_array(d)),
        "messages": lambda d: body('"prompt": "hi", "messages": [{"role": "user", "content": ' + _deep_array(d) + "}]"),
        "messages list": lambda d: body('"prompt": "hi", "messages": ' + _deep_array(d)),
        "tools": lambda d: body(chat + ', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
                                + _deep_object(d) + "}}]"),
        "response_format": lambda d: body(chat + ', "response_format": {"type": "json_schema", "json_schema": '
                                          '{"name": "x", "schema": ' + _deep_object(d) + "}}"),
        "context text": lambda d: '{"text": ' + _deep_array(d) + "}",
    }


def deep_bodies(server: Server, keys: list[str], depths: tuple[int, ...] = (900, 10_000), max_restarts: int = 3,
                routes: list[str] | None = None) -> dict:
    """Every deep body kind at every depth on every POST route (with a tenant's key), each
    followed by ``/health`` (vLLM answers 503 once its engine core died); a normal completion
    that must be served follows the last body of each route and every body answered 5xx or not
    at all (``next_request_failed`` counts those not served). ``failures``: answers 5xx or none;
    ``routes_answering_2xx``: routes that served a deep body (the metrics mount and ``POST
    /ping`` answer without reading a body). A server that exited
    or whose ``/health`` fails counts as an exit and is restarted; after ``max_restarts + 1``
    exits the case stops and says how many bodies it did not send."""
    if routes is None:
        routes = sorted(concrete(p) for p, methods in served_routes(server, keys[0]).items() if "POST" in methods)
    kinds = deep_kinds(server.model)
    plan = [(route, kind, depth) for route in routes for kind in kinds for depth in depths
            if (kind == "context text") == route.startswith("/v1/kvcomm/contexts")]
    exits, non_4xx, next_failed, statuses, per_route, sent, restarts = [], [], [], {}, {}, 0, 0
    answered_2xx: set[str] = set()
    started = time.perf_counter()
    with httpx.Client() as client:
        for n, (route, kind, depth) in enumerate(plan):
            key = keys[n % len(keys)]
            status, _ = _request(client, "POST", server.url + route, key, kinds[kind](depth).encode(), timeout=300)
            sent += 1
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            per_route.setdefault(route, {}).setdefault(str(status), 0)
            per_route[route][str(status)] += 1
            what = f"POST {route} {kind} x{depth}"
            if not 400 <= status < 500:
                non_4xx.append(f"{what}: {status}")
            if 200 <= status < 300:
                answered_2xx.add(route)
            last_of_route = n + 1 == len(plan) or plan[n + 1][0] != route
            alive = server.alive()
            if alive and not (last_of_route or not 200 <= status < 500):
                continue
            if alive and normal_completion(client, server, key) == 200:
                continue
            next_failed.append(what)
            if not server.alive():
                exits.append(what)
                restarts += 1
                try:
                    server.restart()  # also after the last exit: later cases need a server
                except StartFailed as error:
                    exits.append(f"restart failed: {error}")
                    break
                if restarts > max_restarts:
                    break
    return {"bodies": len(plan), "sent": sent, "not_sent": len(plan) - sent, "routes": len(routes),
            "seconds": time.perf_counter() - started, "statuses": dict(sorted(statuses.items())),
            "statuses_per_route": per_route, "routes_answering_2xx": sorted(answered_2xx),
            "failures": sum(statuses.get(s, 0) for s in statuses if not 200 <= int(s) < 500),
            "server_exits": len(exits), "exits_after": exits[:20], "non_4xx": len(non_4xx), "non_4xx_list": non_4xx[:40],
            "next_request_failed": len(next_failed), "restarts": restarts}


# -- huge numbers ------------------------------------------------------------------------------

NUMBERS = {"2**70": str(2**70), "1e308": "1e308", "-2**63-1": str(-2**63 - 1), "NaN": "NaN", "Infinity": "Infinity",
           "-Infinity": "-Infinity", "5000 digits": "9" * 5000}
NOT_FINITE = ("NaN", "Infinity", "-Infinity", "5000 digits")
"""The literals that are bad in a float field too (the others are finite floats)."""


def number_templates(model: str | None) -> list[tuple[str, str, str, bool]]:
    """(route, field, raw JSON body with ``@N@`` for the number, whether every literal of
    ``NUMBERS`` is out of the field's range: integer fields and bounded ones; float fields take
    only ``NOT_FINITE``) on the generation routes and the context API."""
    m = json.dumps(model)
    chat = '{"model": ' + m + ', "messages": [{"role": "user", "content": "hi"}], '
    done = '"max_tokens": 1, "temperature": 0'
    return [
        ("/v1/completions", "prompt token", '{"model": ' + m + ', "prompt": [@N@], ' + done + "}", True),
        ("/v1/completions", "max_tokens", '{"model": ' + m + ', "prompt": "hi", "max_tokens": @N@}', True),
        ("/v1/completions", "seed", '{"model": ' + m + ', "prompt": "hi", "seed": @N@, ' + done + "}", True),
        ("/v1/completions", "n", '{"model": ' + m + ', "prompt": "hi", "n": @N@, ' + done + "}", True),
        ("/v1/completions", "temperature", '{"model": ' + m + ', "prompt": "hi", "max_tokens": 1, "temperature": @N@}', False),
        ("/v1/completions", "kvcomm segment end", '{"model": ' + m + ', "prompt": [1, 2, 3], ' + done
         + ', "kv_transfer_params": {"kvcomm": {"segments": [{"start": 0, "end": @N@, "slot": "doc"}]}}}', True),
        ("/v1/chat/completions", "max_tokens", chat + '"max_tokens": @N@}', True),
        ("/v1/chat/completions", "logit_bias", chat + '"logit_bias": {"1": @N@}, ' + done + "}", False),
        ("/v1/chat/completions", "top_logprobs", chat + '"logprobs": true, "top_logprobs": @N@, ' + done + "}", True),
        ("/v1/chat/completions/batch", "max_tokens", '{"model": ' + m + ', "messages": [[{"role": "user", '
         '"content": "hi"}]], "max_tokens": @N@}', True),
        ("/invocations", "max_tokens", '{"model": ' + m + ', "prompt": "hi", "max_tokens": @N@}', True),
        ("/v1/responses", "max_output_tokens", '{"model": ' + m + ', "input": "hi", "max_output_tokens": @N@}', True),
        ("/v1/messages", "max_tokens", '{"model": ' + m + ', "messages": [{"role": "user", "content": "hi"}], '
         '"max_tokens": @N@}', True),
        ("/inference/v1/generate", "token_ids", '{"model": ' + m + ', "token_ids": [@N@], "sampling_params": '
         '{"max_tokens": 1}}', True),
        ("/v1/kvcomm/contexts", "token_ids", '{"token_ids": [@N@]}', True),
        ("/v1/kvcomm/contexts", "ttl_s", '{"text": "a number probe", "ttl_s": @N@}', True),
        ("/v1/kvcomm/contexts/{id}/retain", "ttl_s", '{"ttl_s": @N@}', True),
    ]


def huge_numbers(server: Server, keys: list[str]) -> dict:
    """Every literal of ``NUMBERS`` in every field of ``number_templates`` (with a tenant's
    key): answers other than 4xx (listed with the start of their body), ``failures`` (5xx or
    no answer: a dropped connection), and the ``Traceback`` lines the server logged meanwhile."""
    text_before = server.log_text()
    non_4xx, statuses, sent = [], {}, 0
    started = time.perf_counter()
    with httpx.Client() as client:
        created = _request(client, "POST", server.url + "/v1/kvcomm/contexts", keys[0],
                           json.dumps({"text": "a context for the number probe"}).encode(), timeout=300)
        context = json.loads(created[1]).get("id", "x") if created[0] == 200 else "x"
        for route, field, template, integer in number_templates(server.model):
            for name, literal in NUMBERS.items():
                if name not in NOT_FINITE and not integer:
                    continue
                status, body = _request(client, "POST", server.url + route.replace("{id}", context), keys[0],
                                        template.replace("@N@", literal).encode(), timeout=300)
                sent += 1
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                if not 400 <= status < 500:
                    non_4xx.append(f"{route} {field}={name}: {status} {body[-300:]!r}")
    alive = server.alive()
    return {"requests": sent, "seconds": time.perf_counter() - started, "statuses": dict(sorted(statuses.items())),
            "non_4xx": len(non_4xx), "non_4xx_list": non_4xx[:40],
            "failures": sum(statuses.get(s, 0) for s in statuses if not 200 <= int(s) < 500),
            "tracebacks": traceback_lines(server.log_text()) - traceback_lines(text_before), "server_alive_after": alive}


# -- the batch route's cross-tenant timing probe -----------------------------------------------

def batch_probe(server: Server, keys: list[str], rounds: int = 5, words: int = 600) -> dict:
    """On ``/v1/chat/completions/batch``, per round a new document of ``words`` words: tenant A
    sends it (cold), A again (its own repeat: what a cache hit looks like), tenant B sends it
    (the probe), B sends another new document (a cold reference). A cross-tenant hit: B's
    cached tokens > 0, or ``probe_verdict``'s timing hit."""
    a, b = keys[0], keys[1 % len(keys)]
    times = {"a_first": [], "a_repeat": [], "b_same": [], "b_fresh": []}
    cached = {name: [] for name in times}
    statuses = []
    rng = random.Random(48)
    with httpx.Client() as client:
        def ask(key: str, document: str, name: str) -> None:
            body = {"model": server.model, "max_tokens": 1, "temperature": 0,
                    "messages": [[{"role": "user", "content": f"Document:\n{document}\nSummarise it in one word."}]]}
            started = time.perf_counter()
            status, raw = _request(client, "POST", server.url + "/v1/chat/completions/batch", key,
                                   json.dumps(body).encode(), timeout=600)
            times[name].append(time.perf_counter() - started)
            statuses.append(status)
            usage = (json.loads(raw).get("usage") or {}) if status == 200 else {}
            cached[name].append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

        def document() -> str:
            return f"Case {rng.random():.12f}: " + " ".join(rng.choice(WORDS) for _ in range(words))

        for _ in range(rounds):
            shared = document()
            ask(a, shared, "a_first")
            ask(a, shared, "a_repeat")
            ask(b, shared, "b_same")
            ask(b, document(), "b_fresh")
    verdict = probe_verdict(times)
    hits = sum(cached["b_same"]) + int(verdict["timing_hit"])
    return {"rounds": rounds, "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "median_s": {name: statistics.median(values) for name, values in times.items()},
            "times_s": times, "cached_tokens": {name: sum(values) for name, values in cached.items()},
            **verdict, "cross_tenant_hits": hits}


def probe_verdict(times: dict[str, list[float]]) -> dict:
    """The timing verdict of ``batch_probe`` from its times (seconds per request and kind). A
    timing hit: B's median on A's document below the cold reference's median by more than the
    cold times' spread (max - min), or below the midpoint between the cold median and the median
    of A's own repeat (closer to a cache hit than to a cold request; the spread alone is
    inflated by a single slow cold request on a loaded machine). ``probe_sees_own_cache``: A's
    repeats are all faster than every cold request, so a hit of that size would show."""
    cold = times["a_first"] + times["b_fresh"]
    spread = max(cold) - min(cold)
    gap = statistics.median(times["b_fresh"]) - statistics.median(times["b_same"])
    midpoint = (statistics.median(cold) + statistics.median(times["a_repeat"])) / 2
    return {"cold_spread_s": spread, "cross_gap_s": gap, "hit_midpoint_s": midpoint,
            "own_repeat_gap_s": statistics.median(cold) - statistics.median(times["a_repeat"]),
            "probe_sees_own_cache": max(times["a_repeat"]) < min(cold),
            "timing_hit": gap > spread or statistics.median(times["b_same"]) < midpoint}


# -- API key flag forms ------------------------------------------------------------------------

KEY_FORMS = {
    "--api-key A --api-key B": lambda a, b: ({}, ["--api-key", a, "--api-key", b]),
    "--api-key=A --api-key=B": lambda a, b: ({}, [f"--api-key={a}", f"--api-key={b}"]),
    "--api-key A B": lambda a, b: ({}, ["--api-key", a, b]),
    "VLLM_API_KEY=A --api-key B": lambda a, b: ({"VLLM_API_KEY": a}, ["--api-key", b]),
}


def key_routes(client: httpx.Client, server: Server, key: str) -> dict[str, int]:
    """The status each of five routes answers ``key`` with."""
    completion = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
    return {"GET /v1/models": _request(client, "GET", server.url + "/v1/models", key)[0],
            "POST /v1/completions": _request(client, "POST", server.url + "/v1/completions", key, completion, timeout=300)[0],
            "POST /invocations": _request(client, "POST", server.url + "/invocations", key, completion, timeout=300)[0],
            "GET /metrics": _request(client, "GET", server.url + "/metrics", key)[0],
            "GET /v1/kvcomm/contexts": _request(client, "GET", server.url + "/v1/kvcomm/contexts", key)[0]}


def check_keys(server: Server, keys: list[str]) -> dict:
    """Per key: accepted (no 401/403) on all five routes, on none, or a mismatch; and a wrong key."""
    out, mismatches = {}, []
    with httpx.Client() as client:
        for name, key in [*((f"key{i}", k) for i, k in enumerate(keys)), ("wrong", WRONG_KEY)]:
            statuses = key_routes(client, server, key)
            accepted = {route: status not in (401, 403) for route, status in statuses.items()}
            verdict = "all" if all(accepted.values()) else "none" if not any(accepted.values()) else "mismatch"
            if verdict == "mismatch" or (name == "wrong" and verdict != "none"):
                mismatches.append(f"{name}: {statuses}")
            out[name] = {"accepted_on": verdict, "statuses": statuses}
    return {"keys": out, "mismatches": mismatches}


def key_forms(folder: Path, forms: list[str] | None = None, max_model_len: int = 512) -> dict:
    """Start a server with each form of ``KEY_FORMS`` (keys A and B), check every key on the
    five routes of ``key_routes``, stop it at once. A server that does not start is reported
    with its last log lines (a refusal with a message is an accepted outcome)."""
    a, b = "bench-hostile-key-a", "bench-hostile-key-b"
    results, mismatches, tracebacks = {}, 0, 0
    for n, form in enumerate(forms or list(KEY_FORMS)):
        env, argv = KEY_FORMS[form](a, b)
        server = Server(folder, f"keys-{n}-" + re.sub(r"\W+", "_", form).strip("_"), [a, b], "--no-plan",
                        max_model_len=max_model_len, key_argv=argv, env=env)
        started = time.perf_counter()
        try:
            server.start()
            checked = check_keys(server, [a, b])
            results[form] = {"started": True, **checked}
            mismatches += len(checked["mismatches"])
        except StartFailed as error:
            lines = [ln for ln in error.log_tail.splitlines() if "api" in ln.lower() or "key" in ln.lower()]
            results[form] = {"started": False, "refusal": (lines[-1] if lines else error.log_tail[-300:])[:300]}
        finally:
            server.stop()
        results[form]["seconds"] = time.perf_counter() - started
        tracebacks += server.tracebacks()
    return {"forms": results, "mismatches": mismatches, "tracebacks": tracebacks}


# -- corrupt and truncated state at a restart --------------------------------------------------

def corrupt_state(state: Path) -> dict[str, str]:
    """Damage a saved state folder the way a crash or a bad disk would: a truncated
    ``contexts.json`` (or, where the records are one file each, a truncated record under
    ``contexts/``), one tenant's truncated ``manifest.json``, garbage in another tenant's
    tensor file, a stray temp file of a killed save. Returns what -> path (only what existed)."""
    damaged = {}
    records = sorted((state / "contexts").glob("ctx-*.json"))  # one file per context (earlier: contexts.json)
    for what, contexts in (("truncated contexts.json", state / "contexts.json"),
                           ("truncated context record", records[0] if records else None)):
        if contexts is not None and contexts.is_file():
            raw = contexts.read_bytes()
            contexts.write_bytes(raw[: max(1, len(raw) // 2)])
            damaged[what] = str(contexts)
    tenants = sorted(p for p in state.iterdir() if p.is_dir() and (p / "manifest.json").is_file())
    if tenants:
        manifest = tenants[0] / "manifest.json"
        raw = manifest.read_bytes()
        manifest.write_bytes(raw[: max(1, len(raw) // 2)])
        damaged["truncated manifest.json"] = str(manifest)
    tensors = [t for p in tenants[1:] for t in sorted(p.rglob("*.safetensors")) if not t.name.startswith(".")]
    if tensors:
        size = tensors[0].stat().st_size
        with tensors[0].open("r+b") as f:
            f.seek(min(8, size // 2))
            f.write(random.Random(7).randbytes(min(4096, max(1, size - 8))))
        damaged["garbage in a tensor file"] = str(tensors[0])
    stray = (tenants[-1] if tenants else state) / ".kvcomm-xyz.safetensors"
    stray.write_bytes(b"\0" * 4096)
    damaged["stray temp file"] = str(stray)
    return damaged


def corrupt_restart(server: Server, state: Path, keys: list[str]) -> dict:
    """``server`` (stopped, its state saved under ``state``) restarted after ``corrupt_state``:
    does it start, serve every tenant, and log a line naming each damaged file? A start that
    fails counts; then the damaged ``contexts.json`` is moved aside here and it starts once more
    (so the other files are still checked)."""
    damaged = corrupt_state(state)
    failed, refusal, first = 0, None, len(server.logs)
    try:
        server.restart()
    except StartFailed as error:
        failed += 1
        lines = [ln for ln in error.log_tail.splitlines() if "error" in ln.lower() and "metrics cleanup" not in ln]
        refusal = (lines or error.log_tail.splitlines() or [""])[-1:]
        contexts = state / "contexts.json"
        if contexts.exists():
            contexts.rename(state / "contexts.json.moved-by-benchmark")
        try:
            server.restart()
        except StartFailed:
            failed += 1
    text = "".join(log.read_text(errors="replace") for log in server.logs[first:] if log.exists())
    named = {what: (Path(path).name in text and (Path(path).parent.name in text or what.endswith("contexts.json")))
             for what, path in damaged.items()}
    gone = {what: not Path(path).exists() for what, path in damaged.items()}
    served = {}
    if server.alive():
        with httpx.Client() as client:
            for i, key in enumerate(keys):
                served[f"key{i}"] = normal_completion(client, server, key)
            served["contexts list"] = _request(client, "GET", server.url + "/v1/kvcomm/contexts", keys[0])[0]
    return {"damaged": damaged, "starts_failed": failed, "refusal": refusal[0][:300] if refusal else None,
            "named_in_log": named, "not_in_place_after": gone,
            "served": served, "serves": bool(served) and all(s == 200 for s in served.values()),
            "tracebacks": traceback_lines(text)}
