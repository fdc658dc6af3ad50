"""A request's KV captured once, when it finishes, in a real engine under both model runners.

The scheduler side asks vLLM to keep a capturing request's blocks when it finishes, the next
step's metadata names them (``FinalCapture``), the worker copies them in one go and reports the
request finished-sending, and vLLM frees them. The child process below runs one in-process
engine (``python test_capture_at_finish.py --child v1|v2``; V2 as in ``test_model_runner_v2``)
with a small KV cache (8 blocks of 32 tokens, prefix caching off) and records, per engine step,
the connector's copies and final captures, the block pool's free blocks, and an expected capture:
what the worker used to copy, each step's computed tokens copied out of their slots right after
that step's forward (the copy kernel on the same slots), kept per request. Scenarios:

- ``alone``: each prompt alone, a 40-token reply captured (prompt and reply);
- ``prefill``: the first prompt and its reply prefilled as one prompt (nothing generated but
  one token): the decoded KV against a dense prefill of the same tokens;
- ``abort``: a capturing request aborted after a few decode steps;
- ``crowd``: the four prompts at once on a cache that holds two: vLLM preempts some; the first
  request preempted is aborted while it waits (its blocks are gone: nothing to capture).

The tests assert on its JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BLOCKS, BLOCK_SIZE, REPLY, ABORT_AFTER = 8, 32, 40, 6
MAX_STEPS = 300
"""Engine steps a scenario may take (the longest, four requests on a cache that holds two,
takes about 90): a request whose blocks are never freed leaves the others waiting forever."""
CHILD_TIMEOUT_S = {"v1": 900, "v2": 1800}


def _child(runner: str) -> None:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from test_model_runner_v2 import PROMPTS, _register_triton_interpreter_backend

    if runner == "v2":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        _register_triton_interpreter_backend()
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    import kvcomm.integrations.vllm.connector.worker as worker_module
    from kvcomm.core.copy import copy_tokens
    from kvcomm.core.kv import KV
    from kvcomm.core.kv_target import KVTarget
    from kvcomm.integrations.vllm.wire.channel import Order, channel
    from kvcomm.integrations.vllm.inprocess.llm import make_llm, shutdown_llm

    llm = make_llm(max_model_len=5 * BLOCK_SIZE, block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8,
                   num_gpu_blocks_override=BLOCKS, enable_prefix_caching=False)
    try:
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        scheduler = core.scheduler
        tracked = scheduler.connector.connector_scheduler._tracked
        worker = get_kv_transfer_group()
        paged = worker.worker._paged
        chan = channel(str(engine.vllm_config.kv_transfer_config.engine_id))
        pool = scheduler.kv_cache_manager.block_pool
        report = {"runner_is_v2": bool(engine.vllm_config.use_v2_model_runner), "free_at_start": pool.get_num_free_blocks(),
                  "scenarios": {}}
        layers, (_, heads, dim) = len(paged.caches), paged.key_offsets.shape
        expected: dict[str, KV] = {}
        scheduled: dict[int, list] = {}
        steps: list[dict] = []

        def schedule(*args, **kwargs):
            output = real_schedule(*args, **kwargs)
            computed = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
            cached = output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            work = []
            for req_id, count in output.num_scheduled_tokens.items():
                if req_id in tracked:
                    t = tracked[req_id]
                    low, high = max(t.capture_from, computed[req_id]), min(t.capture_to, computed[req_id] + count)
                    blocks = list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])
                    work.append((t.handle, low, high, blocks))
            scheduled[id(output.kv_connector_metadata)] = work
            steps.append({"capturing": len(work), "copies": 0, "finals": 0, "preempted": sorted(output.preempted_req_ids or ())})
            return output

        real_schedule, scheduler.schedule = scheduler.schedule, schedule

        def wait_for_save(*args, **kwargs):
            # What the worker copied before: each step's computed tokens, out of their slots, after the forward.
            for handle, low, high, blocks in scheduled.pop(id(worker._connector_metadata), []):
                if high > low:
                    positions = torch.arange(low, high)
                    slots = torch.tensor(blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
                    copy_tokens(KVTarget.at_slots(paged, slots), KVTarget.contiguous(expected[handle], low, high - low))
            return real_wait_for_save(*args, **kwargs)

        real_wait_for_save, worker.wait_for_save = worker.wait_for_save, wait_for_save

        def get_finished(*args, **kwargs):
            steps[-1]["finals"] += len(worker._connector_metadata.final)
            return real_get_finished(*args, **kwargs)

        real_get_finished, worker.get_finished = worker.get_finished, get_finished

        def counted_copy(*args, **kwargs):
            steps[-1]["copies"] += 1
            return real_copy(*args, **kwargs)

        real_copy, worker_module.copy_tokens = worker_module.copy_tokens, counted_copy

        def run(name: str, jobs: list[dict], abort_after: int | None = None, abort_preempted: bool = False) -> dict:
            first = len(steps)
            for job in jobs:
                expected[job["name"]] = KV(torch.zeros(layers, heads, 5 * BLOCK_SIZE, dim), torch.zeros(layers, heads, 5 * BLOCK_SIZE, dim))
                chan.place(job["name"], Order(None, 0, len(job["ids"]) + job["max_tokens"]))
                params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False,
                                        extra_args={"kv_transfer_params": {"kvcomm": {}, "kvcomm_server": {"handle": job["name"]}}})
                engine.add_request(job["name"], TokensPrompt(prompt_token_ids=list(job["ids"])), params)
            tokens: dict[str, list[int]] = {}
            aborted: list[str] = []
            while engine.has_unfinished_requests() or any(chan.awaits_final(job["name"]) for job in jobs):
                if len(steps) - first > MAX_STEPS:
                    raise RuntimeError(f"scenario {name} still unfinished after {MAX_STEPS} engine steps; free blocks "
                                       f"{pool.get_num_free_blocks()} of {report['free_at_start']}")
                for output in engine.step():
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
                if abort_after is not None and len(steps) - first == abort_after:
                    aborted.append(jobs[0]["name"])
                    engine.abort_request([jobs[0]["name"]])
                if abort_preempted and not aborted and steps[-1]["preempted"]:
                    req_id = steps[-1]["preempted"][0]
                    request = scheduler.requests[req_id]
                    aborted.append(tracked[req_id].handle)
                    report.setdefault("preempted_at_abort", {"computed": request.num_computed_tokens, "status": str(request.status)})
                    engine.abort_request([tracked[req_id].handle])
            for _ in range(3):  # steps with nothing to do: a leaked request would still hold its blocks here
                engine.step()
            results = {}
            for job in jobs:
                capture, _ = chan.take(job["name"])
                got = tokens.get(job["name"], [])
                n = len(job["ids"])
                end = n + len(got) - 1  # the last sampled token is never fed back: no KV
                results[job["name"]] = {"tokens": got, "capture": capture, "end": end, "expected": expected.pop(job["name"])}
            report["scenarios"][name] = {
                "steps": steps[first:], "aborted": aborted, "free_after": pool.get_num_free_blocks(),
                "requests_left": len(scheduler.requests), "tracked_left": len(tracked),
                "captures": {name: None if r["capture"] is None else [r["capture"].start, r["capture"].end] for name, r in results.items()},
                "ends": {name: r["end"] for name, r in results.items()},
                "expected_equal": {name: bool(torch.equal(r["capture"].span(r["capture"].start, r["capture"].end).keys,
                                                        r["expected"].span(r["capture"].start, r["capture"].end).keys)
                                            and torch.equal(r["capture"].span(r["capture"].start, r["capture"].end).values,
                                                            r["expected"].span(r["capture"].start, r["capture"].end).values))
                                 for name, r in results.items() if r["capture"] is not None},
            }
            return results

        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                  add_generation_prompt=True), add_special_tokens=False)
                   for p in PROMPTS]

        def diff(a: KV, b: KV) -> float:
            return float(max((a.keys - b.keys).abs().max(), (a.values - b.values).abs().max()))

        alone = {}
        for i, ids in enumerate(prompts):
            alone.update(run(f"alone{i}", [{"name": f"alone{i}", "ids": ids, "max_tokens": REPLY}]))
        ref = alone["alone0"]
        whole = prompts[0] + ref["tokens"][:-1]
        dense = run("prefill", [{"name": "prefill", "ids": whole, "max_tokens": 1}])["prefill"]
        report["scenarios"]["prefill"]["decoded_vs_prefill_max_diff"] = diff(ref["capture"].span(0, ref["end"]),
                                                                             dense["capture"].span(0, ref["end"]))
        cut = run("abort", [{"name": "cut", "ids": prompts[1], "max_tokens": REPLY}], abort_after=ABORT_AFTER)["cut"]
        report["scenarios"]["abort"]["cut"] = {"captured": None if cut["capture"] is None else [cut["capture"].start, cut["capture"].end],
                                               "generated": len(cut["tokens"]), "prompt": len(prompts[1])}
        crowd = run("crowd", [{"name": f"crowd{i}", "ids": ids, "max_tokens": REPLY} for i, ids in enumerate(prompts)],
                    abort_preempted=True)
        report["scenarios"]["crowd"]["against_alone"] = {
            name: {"reply_equal": r["tokens"] == alone[f"alone{name[-1]}"]["tokens"],
                   "max_diff": diff(r["capture"].span(0, r["end"]), alone[f"alone{name[-1]}"]["capture"].span(0, r["end"]))}
            for name, r in crowd.items() if r["capture"] is not None and r["capture"].has(0, r["end"])}
    finally:
        shutdown_llm(llm)
    print("REPORT " + json.dumps(report), flush=True)


def _report(runner: str, tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    if runner == "v2":
        pytest.importorskip("triton")
    log = tmp_path_factory.mktemp(f"final-{runner}") / "child.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", runner], env=env,
                              stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=CHILD_TIMEOUT_S[runner])
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"the engine's child failed (exit {done.returncode}); its log: {log}\n" + log.read_text()[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


_REPORTS: dict[str, dict | BaseException] = {}


@pytest.fixture(params=["v1", "v2"])
def report(request, tmp_path_factory) -> dict:
    if request.param not in _REPORTS:  # one child run per runner, whatever its outcome
        try:
            _REPORTS[request.param] = _report(request.param, tmp_path_factory)
        except BaseException as failed:
            _REPORTS[request.param] = failed
            raise
    found = _REPORTS[request.param]
    if isinstance(found, BaseException):
        raise found
    assert found["runner_is_v2"] == (request.param == "v2")
    return found


def test_every_block_is_freed_after_requests_finish_are_aborted_and_are_preempted(report):
    start = report["free_at_start"]
    assert start == BLOCKS - 1  # vLLM keeps one block aside (the null block)
    for name, scenario in report["scenarios"].items():
        assert scenario["free_after"] == start, (name, scenario["free_after"], start)
        assert scenario["requests_left"] == 0 and scenario["tracked_left"] == 0, name
    assert report["scenarios"]["abort"]["aborted"] == ["cut"]
    crowd = report["scenarios"]["crowd"]
    assert any(step["preempted"] for step in crowd["steps"]), "nothing was preempted; the test's cache is too large"
    assert len(crowd["aborted"]) == 1 and report["preempted_at_abort"]["computed"] == 0
    assert crowd["captures"][crowd["aborted"][0]] is None  # its blocks were gone: nothing to capture, freed at once


def test_a_reply_is_copied_once_when_its_request_finishes_never_while_it_decodes(report):
    for name, scenario in report["scenarios"].items():
        steps = scenario["steps"]
        decoding = [s for s in steps if s["capturing"] and not s["finals"]]
        assert decoding and all(s["copies"] == 0 for s in decoding), name
        captured = sum(1 for c in scenario["captures"].values() if c is not None)
        assert sum(s["finals"] for s in steps) == sum(s["copies"] for s in steps) == captured, (name, steps)
        assert all(s["copies"] == s["finals"] for s in steps), name


def test_the_capture_is_byte_identical_to_copying_each_step_and_matches_a_dense_prefill(report):
    for name, scenario in report["scenarios"].items():
        for request, (start, end) in ((r, c) for r, c in scenario["captures"].items() if c is not None):
            assert start == 0 and end == scenario["ends"][request], (name, request, start, end)
        assert scenario["expected_equal"] and all(scenario["expected_equal"].values()), (name, scenario["expected_equal"])
    assert report["scenarios"]["prefill"]["decoded_vs_prefill_max_diff"] < 1e-3
    cut = report["scenarios"]["abort"]["cut"]
    assert cut["captured"] == [0, cut["prompt"] + cut["generated"] - 1] and 0 < cut["generated"] < REPLY
    against = report["scenarios"]["crowd"]["against_alone"]
    assert len(against) == 3, against  # every request but the aborted one
    assert all(o["reply_equal"] and o["max_diff"] < 1e-3 for o in against.values()), against


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"] and sys.argv[2:] in (["v1"], ["v2"]):
        _child(sys.argv[2])
    else:
        sys.exit("usage: test_capture_at_finish.py --child v1|v2")
