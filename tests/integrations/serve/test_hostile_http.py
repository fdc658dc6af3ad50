"""`kvcomm serve` under malformed and oversized requests (the session server of ``test_http``):
wrong types, spans out of range, 10 MB strings, huge max_tokens, segment ids sent again with
other content, prompts built to blow up detection, bodies that are not JSON objects. Each gets
a clear answer (a 4xx, or served without reuse with the reason), the server keeps serving,
nobody else's request is affected, and the log grows by little per request."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcomm.reuse.pipeline import load_demo_pipeline
from kvcomm.reuse.runner import _content, build_prompt
from .test_http import annotations, executor, provenance  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

BIG = "x" * 10_000_000
MAX_LOG_BYTES_PER_REQUEST = 4096


def _raw(server, body: bytes, key: str) -> int:
    request = urllib.request.Request(server.base_url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_hostile_requests_get_clear_answers_and_the_server_keeps_serving(kvcomm_server, executor, fresh_key):  # noqa: F811
    key = fresh_key()
    spec = load_demo_pipeline()
    prompt = build_prompt(executor, spec.agents[0], {"task": _content(executor, spec.inputs[0]["task"])})
    ids, good = list(prompt.token_ids), annotations(prompt)
    span = good["segments"][0]
    base = {"model": kvcomm_server.model, "prompt": ids, "max_tokens": 2, "temperature": 0}
    kvcomm_server.complete(ids, key, 2, {**good, "segments": [{**span, "id": "doc"}]})  # "doc" names this content
    other = list(reversed(ids))
    hostile = [
        {**base, "kv_transfer_params": {"kvcomm": {"template": BIG}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": [{**span, "slot": BIG}]}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": [{**span, "id": BIG}]}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": [{**span, "start": BIG}]}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": [span] * 100_000}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, BIG[:1000]: 1}}},
        {**base, "kv_transfer_params": {"kvcomm": [1, 2]}},
        {**base, "kv_transfer_params": "kvcomm"},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": [{**span, "end": 10**12}]}}},
        {**base, "kv_transfer_params": {"kvcomm": {**good, "segments": {"start": 0}}}},
        {**base, "kv_transfer_params": {"kvcomm": {}}, "max_tokens": 10**9},
        {**base, "kv_transfer_params": {"kvcomm": {}}, "max_tokens": -1},
        {**base, "prompt": other, "kv_transfer_params": {"kvcomm": {**good, "segments": [{**span, "id": "doc"}]}}},
        {**base, "prompt": [ids[0]] * 1000, "kv_transfer_params": {"kvcomm": {}}},  # one token repeated: detection bomb
        {**base, "prompt": BIG[:2000], "kv_transfer_params": {"kvcomm": {"tenant": BIG[:300]}}},
        {**base, "cache_salt": BIG, "kv_transfer_params": {"kvcomm": {}}},
    ]
    raw = [b"not json", b"[1, 2, 3]", b"{" * 100_000, json.dumps({"prompt": ids, "model": kvcomm_server.model}).encode()[:-1]]
    log_before = kvcomm_server.log.stat().st_size
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: kvcomm_server.request("POST", "/v1/completions", body, key), hostile))
        raw_answers = list(pool.map(lambda body: _raw(kvcomm_server, body, key), raw))
    seconds = time.monotonic() - started
    served = sum(status == 200 for status, _ in answers)
    for body, (status, reply) in zip(hostile, answers):
        assert status == 200 or 400 <= status < 500, (status, str(reply)[:300])
        text = json.dumps(reply)
        assert len(text) < 20_000, text[:300]  # no 10 MB value echoed back
        if status == 200:
            assert reply["choices"][0]["finish_reason"] in ("length", "stop"), text[:300]
    assert all(400 <= status < 500 or status == 200 for status in raw_answers), raw_answers
    mismatch = answers[12][1]["kv_transfer_params"]["kvcomm"]["error"]
    assert "'doc' was sent before with other tokens" in mismatch
    assert answers[0][0] == 400 and "at most 256 characters" in json.dumps(answers[0][1])
    # still serving, with reuse, for this tenant and a new one
    assert provenance(kvcomm_server.complete(ids, key, 2, good))["exact_tokens"] > 0
    assert kvcomm_server.request("GET", "/health")[0] == 200
    grown = kvcomm_server.log.stat().st_size - log_before
    count = len(hostile) + len(raw) + 1
    log = kvcomm_server.log.read_text()
    print(f"\nhostile: {count} requests in {seconds:.1f} s, {served} served, server up, log +{grown} bytes "
          f"({grown / count:.0f} per request)")
    assert grown <= MAX_LOG_BYTES_PER_REQUEST * count
    assert "EngineCore encountered a fatal error" not in log and "EngineDeadError" not in log


def test_deep_and_huge_bodies_on_every_kind_of_route_never_stop_the_server(kvcomm_server, executor, fresh_key):  # noqa: F811
    """Issue 48: a body nested ~900 deep inside kv_transfer_params got a 500, then vLLM's engine
    core died with RecursionError while pickling and the whole server exited (with or without
    the kvcomm key). Deep bodies on generation, salted, plain and unknown routes, and numbers
    out of range, now get a 400 (413 for size) before vLLM sees them; the server keeps serving."""
    key = fresh_key()
    model = kvcomm_server.model
    deep = "[" * 900 + "]" * 900
    bodies = [
        ("/v1/completions", f'{{"model": "{model}", "prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": {{"kvcomm": {{"x": {deep}}}}}}}'),
        ("/v1/completions", f'{{"model": "{model}", "prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": {{"x": {deep}}}}}'),
        ("/v1/chat/completions", f'{{"model": "{model}", "messages": {deep}, "max_tokens": 1}}'),
        ("/v1/chat/completions", f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], "tools": {deep}}}'),
        ("/v1/chat/completions", f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], '
                                 f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {deep}}}}}}}'),
        ("/v1/chat/completions/batch", f'{{"model": "{model}", "messages": [{deep}]}}'),
        ("/invocations", f'{{"model": "{model}", "prompt": [1], "kv_transfer_params": {deep}}}'),
        ("/tokenize", f'{{"model": "{model}", "prompt": {deep}}}'),
        ("/v1/kvcomm/contexts", f'{{"token_ids": {deep}}}'),
        ("/v1/completions", "[" * 200_000 + "]" * 200_000),
        ("/v1/completions", f'{{"model": "{model}", "prompt": [1180591620717411303424], "max_tokens": 1}}'),
        ("/v1/kvcomm/contexts", '{"token_ids": [1180591620717411303424]}'),
        ("/v1/kvcomm/contexts", '{"token_ids": [9223372036854775807]}'),
        ("/v1/completions", f'{{"model": "{model}", "prompt": [1], "max_tokens": 1e400}}'),
        ("/v1/completions", f'{{"model": "{model}", "prompt": [1], "temperature": NaN}}'),
    ]
    log_before = kvcomm_server.log.read_text()
    for path, body in bodies:
        request = urllib.request.Request(kvcomm_server.base_url + path, data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        assert status == 400, (path, body[:120], status)
        assert kvcomm_server.request("GET", "/health")[0] == 200, path
    spec = load_demo_pipeline()
    prompt = build_prompt(executor, spec.agents[0], {"task": _content(executor, spec.inputs[0]["task"])})
    assert kvcomm_server.complete(list(prompt.token_ids), key, 2)["choices"][0]["finish_reason"] in ("length", "stop")
    assert "Traceback" not in kvcomm_server.log.read_text()[len(log_before):]
