"""Device cost of one reusing call: kernels, host syncs and bytes moved, counted at dispatch level.

    python benchmarks/bench_ops.py [--json] [--layers 2,32] [--anchors 2,8] [--segments 1,4] [--tokens 64]

For each case a tiny random Llama-shaped model (``--layers`` layers, 2 KV heads of 64 channels,
fp32) and an engine whose slots hold ``--anchors`` anchors each (learned through calibration
calls on random KV) serve one prompt with ``--segments`` shared segments of ``--tokens`` tokens,
every one estimated. Counted (``op_counter.DispatchCounter``): the reuse path from the prompt
to its reused KV in the executor's cache (plan: matching and admission; materialize: realign,
estimate, write; the transformers executor's injection), not the tail forward, on the second of two
identical calls (the first also builds what a process builds once: its angle table, constant
buffers; ``first_call_kernel_ops``). ``floor_bytes``
is what the call must touch at least: each new segment's base, each candidate anchor's base
(matching) and deviation, the stored KV of the exact prefix, and the output written.
``bytes_moved`` is the counter's dispatch-level figure (for ``kvcomm::`` operators, the distinct
bytes ``OP_BYTES`` computes); under ``TRITON_INTERPRET=1`` the kernels' loads and stores are
measured as well: ``bytes_loaded`` and ``bytes_stored`` (every access of every program),
``table_bytes_loaded`` (the part read from integer addressing tables) and ``distinct_bytes``
(each address once). Host syncs are counted by CUDA's rules (``op_counter``). ``learn_*``: learning from one dense call of the same prompt (made by a
calibration plan, its KV given), counted the same way.

``--target paged`` counts what the vLLM worker launches instead: the plan, then the fused write of
its pieces straight into a paged cache (FlashAttention's ``[2, blocks, block_size, H, D]`` per
layer) at the request's slots, and separately (``capture_*``) one step's capture: ``--tokens``
computed tokens copied from their slots into the request's capture buffer, every layer at once.

``--target vllm-step`` counts the vLLM worker's hooks in real engine steps (an in-process
``vllm.LLM`` on the embedded model with the connector, ``VllmExecutor``): a request of
``--tokens`` prompt tokens whose first ``--tokens`` - 1 are injected (the steps that load),
generating 8 tokens (decode steps of a request whose prompt and reply are captured), and the
step after it finished (the one that copies its KV out of the blocks vLLM kept, once). Per
step, the hooks' counts (``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``,
``get_finished``; the step tensors and block ids the scheduler sent are host memory), the
capture copies (``copies``, with ``captures`` positions) and, apart,
``build_connector_worker_meta`` (learning and planning).

Run it with ``TRITON_INTERPRET=1`` to count the path a GPU takes (the fused ops' Triton kernels,
run by Triton's interpreter); without it, on a CPU, the torch composite runs and is counted.
Targets (issues 42 and 50): kernel_ops <= 16 + 4 S and equal across layers and anchors;
host_syncs <= 1 per reusing call, 0 per capture and 0 in the worker's hooks per step;
bytes_moved <= 1.2 floor_bytes; bytes_loaded + bytes_stored <= 1.5 floor_bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_counter import DispatchCounter  # noqa: E402

from kvcomm.anchors.config import PoolConfig  # noqa: E402
from kvcomm.anchors.evidence import EVIDENCE_MIN_PAIRS  # noqa: E402
from kvcomm.core.copy import copy_tokens  # noqa: E402
from kvcomm.core.kv import KV  # noqa: E402
from kvcomm.core.kv_target import KVTarget, Paged  # noqa: E402
from kvcomm.core.place import place_all  # noqa: E402
from kvcomm.reuse.assemble import pieces  # noqa: E402
from kvcomm.core.segments import Prompt, Segment  # noqa: E402
from kvcomm.reuse.config import ReuseConfig  # noqa: E402
from kvcomm.reuse.engine import ReuseEngine  # noqa: E402

KV_HEADS, HEAD_DIM = 2, 64


def tiny_executor(layers: int):
    """A transformers executor on a random Llama of ``layers`` layers (2 KV heads x 64 channels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers.executor import TransformersExecutor

    config = LlamaConfig(vocab_size=512, hidden_size=KV_HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
                         rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()

    class Tokenizer:  # the executor needs only these to exist
        eos_token_id, bos_token = 0, None

        def encode(self, text, add_special_tokens=False):
            return [1]

    return TransformersExecutor(model, Tokenizer())


def prompt(template: str, contents: list[tuple[int, ...]]) -> Prompt:
    """[lead] + per slot: [shared content] + [separator] + [tail]; each template its own lead."""
    segments = [Segment(tuple(range(400, 416)) if template == "reader" else tuple(range(500, 516)))]
    for i, content in enumerate(contents):
        segments += [Segment(content, slot=f"slot{i}"), Segment((420 + i, 421, 422, 423))]
    segments.append(Segment((430, 431, 432)))
    return Prompt(template, tuple(segments))


def synthetic_kv(p: Prompt, start: int, layers: int, heads: int = KV_HEADS, dim: int = HEAD_DIM) -> KV:
    """'Real' KV of ``p``'s tokens from ``start`` (``[layers, heads, n, dim]`` keys and values, fp32,
    on the CPU), shaped like a model's: a vector per token id plus a vector per template (what the
    context before a segment does to it) plus noise 0.05 its size. So a content's deviation between
    two templates is the same for every content, which anchors can estimate (random KV per call
    would give deviations no estimate beats realignment on, and the estimate-or-realign rule would
    rightly never serve one)."""

    def vector(seed: int, n: int = 1) -> torch.Tensor:
        return torch.randn(2, layers, heads, n, dim, generator=torch.Generator().manual_seed(seed))

    tokens = p.token_ids[start:]
    by_token = torch.cat([vector(token) for token in tokens], dim=3)
    context = vector(10**6 + sum(map(ord, p.template_id)))
    noise = 0.05 * vector((31 * sum(tokens) + 7 * len(tokens) + 2 * sum(map(ord, p.template_id))) % 2**31, len(tokens))
    kv = by_token + context + noise
    return KV(kv[0], kv[1])


def calibrate(engine: ReuseEngine, p: Prompt, layers: int, heads: int = KV_HEADS, dim: int = HEAD_DIM,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """A calibration call on ``synthetic_kv``, moved to ``device`` in ``dtype``: learns bases,
    fixed bases, anchors and the slots' evidence from it."""
    plan = engine.calibration_plan(p)
    real = synthetic_kv(p, plan.reuse_end, layers, heads, dim)
    engine.learn(plan, KV(real.keys.to(device, dtype), real.values.to(device, dtype)))


def warm_engine(rotary, layers: int, anchors: int, segments: int, tokens: int, heads: int = KV_HEADS, dim: int = HEAD_DIM,
                dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[ReuseEngine, Prompt]:
    """An engine whose slots hold ``anchors`` anchors each, having measured their estimates closer
    to dense than realignment, and a prompt of ``segments`` new shared contents of ``tokens``
    tokens that it estimates (their bases learned elsewhere)."""
    engine = ReuseEngine(rotary, ReuseConfig(pool=PoolConfig(max_anchors=anchors)))

    def contents(j: int) -> list[tuple[int, ...]]:
        return [tuple(1000 + 97 * s + 31 * j + t % 50 for t in range(tokens)) for s in range(segments)]

    def learn(template: str, j: int) -> None:
        calibrate(engine, prompt(template, contents(j)), layers, heads, dim, dtype, device)

    # Bases read by "writer", then anchors of template "reader"; the last EVIDENCE_MIN_PAIRS
    # contents meet a pool able to estimate them (measured pairs for the slots' evidence) and
    # take the place of the first (the pool holds ``anchors``).
    for j in range(anchors + EVIDENCE_MIN_PAIRS):
        learn("writer", j)
        learn("reader", j)
    new = anchors + EVIDENCE_MIN_PAIRS
    learn("writer", new)  # the new contents' bases, elsewhere
    return engine, prompt("reader", contents(new))


def paged_cache(layers: int, tokens: int, block_size: int = 16) -> Paged:
    """A FlashAttention-layout paged cache (``[2, blocks, block_size, H, D]`` per layer, fp32)
    with room for ``tokens`` tokens."""
    blocks = -(-tokens // block_size) + 1
    caches = tuple(torch.zeros(2, blocks, block_size, KV_HEADS, HEAD_DIM) for _ in range(layers))
    within = torch.arange(block_size * KV_HEADS * HEAD_DIM).view(block_size, KV_HEADS, HEAD_DIM)
    return Paged(caches, within, within + blocks * block_size * KV_HEADS * HEAD_DIM, block_size * KV_HEADS * HEAD_DIM)


def case(executor, layers: int, anchors: int, segments: int, tokens: int, target: str = "buffer") -> dict:
    chosen = os.environ.get("KVCOMM_TRITON")
    os.environ["KVCOMM_TRITON"] = "0"  # set-up on the torch path (Triton's interpreter is slow), what is counted on the chosen one
    try:
        return _case(executor, layers, anchors, segments, tokens, chosen, target)
    finally:
        if chosen is None:
            os.environ.pop("KVCOMM_TRITON", None)
        else:
            os.environ["KVCOMM_TRITON"] = chosen


def _case(executor, layers: int, anchors: int, segments: int, tokens: int, chosen: str | None, target: str) -> dict:
    engine, p = warm_engine(executor.rotary, layers, anchors, segments, tokens)
    if chosen is not None:
        os.environ["KVCOMM_TRITON"] = chosen
    else:
        os.environ.pop("KVCOMM_TRITON", None)
    counters, captures = [], []
    paged = paged_cache(layers, len(p) + tokens) if target == "paged" else None
    scattered = torch.arange(len(p)).flip(0)  # the request's slots (scattered, last block first)
    for _ in range(2):  # the first call also makes what a process makes once (angle tables, constant buffers)
        with DispatchCounter(host=(scattered,)) as counter:
            plan = engine.plan(p)
            if paged is None:
                with engine.materialized(plan) as kv:
                    cache = executor._cache(kv)  # the transformers executor's injection
                    del cache
            else:  # the vLLM worker: the pieces written at the request's slots
                place_all(pieces(plan), KVTarget.at_slots(paged, scattered[: plan.reuse_end]), executor.rotary)
        counters.append(counter)
        if paged is not None:
            buffer = torch.empty(layers, 2, KV_HEADS, len(p) + tokens, HEAD_DIM)
            captured = scattered[:tokens]
            with DispatchCounter(host=(scattered,)) as counter:
                copy_tokens(KVTarget.at_slots(paged, captured),
                            KVTarget.contiguous(KV(buffer[:, 0], buffer[:, 1]), len(p), tokens))
            captures.append(counter)
    learned = _learning(engine, p, layers)
    estimated = [piece for piece in plan.pieces if piece.match is not None]
    if len(estimated) != segments:
        raise RuntimeError(f"expected {segments} estimated segments, the plan estimated {len(estimated)}: {plan.note}")
    c = counters[1].counts
    captured = {} if not captures else {
        "capture_kernel_ops": captures[1].counts.kernel_ops, "capture_host_syncs": captures[1].counts.host_syncs,
        "capture_syncs": captures[1].counts.syncs, "capture_bytes_loaded": captures[1].counts.bytes_loaded,
        "capture_bytes_stored": captures[1].counts.bytes_stored, "capture_distinct_bytes": captures[1].counts.distinct_bytes,
        "capture_bytes_moved": captures[1].counts.bytes_moved, "capture_floor_bytes": 2 * layers * 2 * KV_HEADS * tokens * HEAD_DIM * 4}
    return {**captured, "target": target, "layers": layers, "anchors": anchors, "segments": segments, "tokens": tokens,
            "kernel_ops": c.kernel_ops, "host_syncs": c.host_syncs, "syncs": c.syncs,
            "learn_kernel_ops": learned.kernel_ops, "learn_host_syncs": learned.host_syncs, "learn_syncs": learned.syncs, "bytes_moved": c.bytes_moved,
            "bytes_loaded": c.bytes_loaded, "bytes_stored": c.bytes_stored, "table_bytes_loaded": c.table_bytes_loaded,
            "distinct_bytes": c.distinct_bytes,
            "floor_bytes": floor_bytes(plan), "triton_launches": c.triton_launches, "reuse_end": plan.reuse_end,
            "first_call_kernel_ops": counters[0].counts.kernel_ops, "ops": dict(sorted(c.ops.items(), key=lambda kv: -kv[1]))}


def _learning(engine: ReuseEngine, p: Prompt, layers: int):
    """The counts of learning from one dense call of ``p`` (its real KV made beforehand, on the device)."""
    plan = engine.calibration_plan(p)
    n = len(p) - plan.reuse_end
    gen = torch.Generator().manual_seed(2)
    real = KV(torch.randn(layers, KV_HEADS, n, HEAD_DIM, generator=gen), torch.randn(layers, KV_HEADS, n, HEAD_DIM, generator=gen))
    with DispatchCounter() as counter:
        engine.learn(plan, real)
    return counter.counts


def vllm_step(tokens: int) -> dict:
    """Per engine step, the worker hooks' device cost (see the module docstring)."""
    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor
    from kvcomm.integrations.vllm.inprocess.llm import make_llm
    from kvcomm.integrations.vllm.connector.worker import KvcommConnectorWorker

    import kvcomm.integrations.vllm.connector.worker as worker_module

    steps: list[dict] = [{}]
    hooks = ("wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "build_connector_worker_meta")
    originals = {name: getattr(KvcommConnectorWorker, name) for name in hooks}
    real_copy = worker_module.copy_tokens

    def copy(source, target):
        mine = steps[-1]
        mine["copies"] = mine.get("copies", 0) + 1
        mine["captures"] = mine.get("captures", 0) + int(source.slots.numel())
        return real_copy(source, target)

    def counted(name):
        original = originals[name]

        def hook(self, *args):
            meta = args[-1]
            host = tuple(t for step in getattr(meta, "requests", ()) for t in (step.load_positions, step.load_slots))
            with DispatchCounter(host=host) as counter:
                out = original(self, *args)
            part = "learn_and_plan" if name == "build_connector_worker_meta" else "hooks"
            mine = steps[-1].setdefault(part, {"kernel_ops": 0, "host_syncs": 0, "triton_launches": 0, "syncs": {}})
            c = counter.counts
            mine["kernel_ops"] += c.kernel_ops
            mine["host_syncs"] += c.host_syncs
            mine["triton_launches"] += c.triton_launches
            for why, n in c.syncs.items():
                mine["syncs"][why] = mine["syncs"].get(why, 0) + n
            if name == "wait_for_save" and getattr(meta, "requests", None):
                steps[-1]["loads"] = sum(int(s.load_positions.numel()) for s in meta.requests)
            if name == "get_finished":
                steps[-1]["finals"] = len(getattr(meta, "final", ()))
            if name == "build_connector_worker_meta":
                steps.append({})
            return out

        return hook

    executor = VllmExecutor(make_llm(max_num_batched_tokens=64), load_tokenizer())
    try:
        ids = list(executor.lead_in_ids) + list(range(1000, 1000 + tokens))
        prefix = executor.generate(ids, None, 1).computed.span(0, len(ids) - 1)
        for name in hooks:
            setattr(KvcommConnectorWorker, name, counted(name))
        worker_module.copy_tokens = copy
        try:
            steps[:] = [{}]
            executor.generate(ids, prefix, 8)
        finally:
            worker_module.copy_tokens = real_copy
            for name, original in originals.items():
                setattr(KvcommConnectorWorker, name, original)
    finally:
        executor.close()
    steps = [s for s in steps if s]
    for s in steps:
        s["kind"] = "finished" if s.get("finals") else "load" if s.get("loads") else "decode"
    hooks_syncs = [s.get("hooks", {}).get("host_syncs", 0) for s in steps]
    return {"target": "vllm-step", "prompt_tokens": len(ids), "injected": len(ids) - 1, "steps": steps,
            "max_hook_syncs_per_step": max(hooks_syncs), "loading_steps": sum(1 for s in steps if s.get("loads")),
            "copies_per_step": [s.get("copies", 0) for s in steps],
            "capturing_steps": sum(1 for s in steps if s.get("copies"))}


def floor_bytes(plan) -> int:
    """The least a reusing call must touch: see the module docstring."""
    total = 0 if plan.exact_kv is None else plan.exact_kv.span(0, plan.exact_length).nbytes
    for piece in plan.pieces:
        total += piece.base.nbytes
        n = piece.base.length
        if piece.match is not None:
            for anchor in piece.match.anchors:
                deviation = anchor.deviations[piece.match.slot]
                total += anchor.base.span(0, n).nbytes + deviation.shared.span(0, n).nbytes
                if piece.following_base is not None:
                    total += deviation.following.nbytes
        if piece.following_base is not None:
            total += piece.following_base.nbytes
    like = plan.exact_kv if plan.exact_kv is not None else plan.pieces[0].base
    per_token = like.nbytes // like.length
    return total + per_token * plan.reuse_end


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="2,32")
    parser.add_argument("--anchors", default="2,8")
    parser.add_argument("--segments", default="1,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--target", choices=("buffer", "paged", "vllm-step"), default="buffer",
                        help="buffer: materialize + the transformers executor's injection; paged: the vLLM worker's write "
                             "and capture; vllm-step: the vLLM worker's hooks in real engine steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.target == "vllm-step":
        step = vllm_step(args.tokens)
        if args.json:
            print(json.dumps(step))
        else:
            for i, s in enumerate(step["steps"]):
                h, lp = s.get("hooks", {}), s.get("learn_and_plan", {})
                print(f"step {i} ({s['kind']}): {s.get('loads', 0)} loaded, {s.get('copies', 0)} capture copies of "
                      f"{s.get('captures', 0)} positions: hooks {h.get('kernel_ops', 0)} "
                      f"kernel ops, {h.get('host_syncs', 0)} host syncs {h.get('syncs', {})}; learning and planning "
                      f"{lp.get('host_syncs', 0)} host syncs {lp.get('syncs', {})}")
        return 0
    cases = []
    for layers in map(int, args.layers.split(",")):
        executor = tiny_executor(layers)
        for anchors in map(int, args.anchors.split(",")):
            for segments in map(int, args.segments.split(",")):
                cases.append(case(executor, layers, anchors, segments, args.tokens, args.target))
    result = {"path": "transformers" if args.target == "buffer" else "vllm-worker", "triton": os.environ.get("TRITON_INTERPRET") == "1",
              "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "cases": cases}
    if args.json:
        print(json.dumps(result))
    else:
        for c in cases:
            print(f"L={c['layers']:>2} A={c['anchors']} S={c['segments']} T={c['tokens']}: {c['kernel_ops']:>5} kernel ops, "
                  f"{c['host_syncs']:>3} host syncs, {c['bytes_moved'] / c['floor_bytes']:.2f} x floor bytes "
                  f"({c['bytes_moved']:,} / {c['floor_bytes']:,})"
                  + ("" if c["bytes_loaded"] is None else
                     f"; measured: {(c['bytes_loaded'] + c['bytes_stored']) / c['floor_bytes']:.2f} x floor every access, "
                     f"{c['distinct_bytes'] / c['floor_bytes']:.2f} x distinct")
                  + ("" if "capture_kernel_ops" not in c else
                     f"; capture: {c['capture_kernel_ops']} kernel ops, {c['capture_host_syncs']} host syncs, "
                     f"{c['capture_bytes_moved'] / c['capture_floor_bytes']:.2f} x floor bytes"
                     + ("" if c["capture_bytes_loaded"] is None else
                        f", measured {(c['capture_bytes_loaded'] + c['capture_bytes_stored']) / c['capture_floor_bytes']:.2f} x")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
