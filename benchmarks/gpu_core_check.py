"""The kvcomm core on a CUDA GPU without vLLM: RoPE realignment, the transformers executor and
the reuse engine in fp32, bf16 and fp16.

    python benchmarks/gpu_core_check.py [--device cuda] [--ttft SHAPE:DTYPE ...] [--json PATH]

``gpu_check.py`` checks the vLLM plugin on a GPU; this one checks what runs on torch and
transformers alone, so it runs where vLLM's GPU build cannot be installed. Its imports are
torch, Triton, transformers (with its own dependencies: tokenizers, safetensors, huggingface_hub),
numpy and this checkout's files: no faiss (the anchor index falls back to an exact numpy
search), platformdirs, gguf, vLLM, pytest or wheel-bundled model, and the project need not be
installed: run from a bare checkout, the script maps ``kvcomm.anchors``, ``kvcomm.integrations``
and ``kvcomm.eval`` to their folders as ``pyproject.toml``'s ``package-dir`` does
(:func:`use_this_checkout`). ``tests/benchmarks/test_gpu_core_check_closure.py`` runs it with
every other installed distribution hidden.

On the lent GPU machine (torch, Triton, transformers and numpy only, no registry, 64 MiB a call):
carry nothing beyond the tracked files and run, from the repository root,

    python benchmarks/gpu_core_check.py --json $OUT/gpu_core.json

(the defaults: ``--device cuda --ttft 1.7b:bf16 8b:bf16``, sized for the 6 minutes a call
may take on an H100; GPU untested at this commit). On a CUDA device the script drops
``TRITON_INTERPRET`` and ``KVCOMM_TRITON`` from its environment before anything imports Triton,
so a shell that ran the CPU check cannot make the GPU run interpret its kernels; the summary
says which path ran (``triton_interpreter``).

Models are random, built from configs (nothing is downloaded): the checks are about arithmetic
and data paths, not answers. The tokenizer (:func:`check_tokenizer`) is a byte-level BPE
trained at start on the texts the checks use (a second, deterministic), with SmolLM2's ChatML
template; ``--tokenizer DIR`` takes a folder saved with ``save_pretrained`` instead (e.g. the
embedded SmolLM2's, the tokenizer of the 2026-12-04 measurements).

1. ``selfcheck[VARIANT,DTYPE]``: ``rotary_from_model`` passes on the device for a tiny model of
   every RoPE variant of ``tests/support/rope_variants.py`` (default, linear, dynamic NTK, llama3, yarn,
   longrope, partial rotary, interleaved) in fp32, bf16 and fp16; the row gives the max
   realignment error as a share of the dtype's tolerance. ``control[DTYPE]``: a rotary with the
   wrong theta fails the same check (the check can fail).
2. ``exact[DTYPE]``: a dense prefill on the device; then the dense KV of the first n - 1 prompt
   tokens is injected: the first reply token's log-probabilities within the dtype's rounding
   (64 ulps; 1e-4 in fp32) and, in fp32, the same greedy reply. In bf16/fp16 the reply is
   reported, not checked: a one-token forward over a cache rounds differently from a full
   prefill on a GPU (other attention kernels), and a random model's near-ties can flip.
3. ``cpu=device[MODE]``: the two-agent pipeline of ``tests/support/two_agent_case.py`` in fp32
   through ``run_row`` with a reuse engine in modes realign, kvcomm and cacheblend, on the CPU and
   on the device with the same weights: the same decisions (provenance) and replies.
4. ``ttft[SHAPE:DTYPE]``: the demo's review pipeline (5 documents of ~1K tokens, 4 agents) on a
   random Llama of each ``--ttft`` shape and dtype (``SHAPES``), dense vs kvcomm at the demo's settings, calls alternating as in
   `kvcomm demo`: total TTFT over all 20 calls, misses included, and the token split, after an
   untimed run of three rows on a throwaway engine (first-use costs). Printed, not checked.

5. ``fused[LAYOUT:DTYPE]``: the fused writer's Triton kernel (``kvcomm::place``) writes what its
   torch composite writes (within one rounding of the dtype) into every paged layout of
   ``tests/support/paged_layouts.py``, for a plan of a warm engine (estimated segments, an exact
   prefix, fixed text), and ``kvcomm::copy_tokens`` (the vLLM worker's capture) reads slots back
   bit-exactly. ``reuse_cost[SHAPE:DTYPE]``: one reusing call's device work as the vLLM worker
   does it (plan with matching and admission, then the fused write into a FlashAttention-layout
   paged cache; 1,000 shared tokens, 5 anchors), median ms against a dense prefill of 1,100
   tokens of a random model of that shape (issue 42's floor: ~1-2 %). Printed, not checked.

One line per check (PASS/FAIL/INFO), then one line ``SUMMARY {json}`` (verdict counts, failed
checks, the TTFT totals and reuse costs, torch/device/Triton path); exit status 0 only when no
check fails.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # bench_ops' warm engine
sys.path.insert(0, str(REPO / "tests"))  # the RoPE variants and the two-agent pipeline the test suite uses


def use_this_checkout() -> None:
    """Make ``kvcomm`` and its subpackages import from this checkout, installed or not: ``kvcomm``
    from ``REPO/kvcomm`` and every other ``package-dir`` entry of ``pyproject.toml`` (``kvcomm.anchors``
    -> ``anchors/``, ...) from its folder, unless it already resolves there (an editable install of
    this checkout). What resolves elsewhere (another checkout's install) is replaced, not mixed.
    Python 3.10 has no ``tomllib``: there the project must be installed (``pip install -e .``)."""
    try:
        import tomllib
    except ImportError:
        return

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import kvcomm

    if Path(kvcomm.__file__).resolve().parent != REPO / "kvcomm":
        raise RuntimeError(f"kvcomm imports from {kvcomm.__file__}, not from this checkout ({REPO}): "
                           "it was imported before use_this_checkout()")
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dir.items():
        if name == "kvcomm":
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == REPO / folder:
            continue
        spec = importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(kvcomm, name.rpartition(".")[2], module)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, max_position_embeddings=8192),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=8192),
    "tiny": {},
}
"""Model shapes the TTFT step times (random weights): SmolLM2-1.7B's (full multi-head KV) and
Llama-3-8B's (grouped KV heads), big enough that a GPU prefill is not all launch overhead;
``tiny`` is the 2-layer test model (a quick run of the step)."""


def check_tokenizer(vocab_size: int = 8192):
    """The check's tokenizer: a byte-level BPE (any text encodes, nothing maps to an unknown id)
    trained on the texts the checks encode (the bundled pipelines, the two-agent pipeline, the
    exact-injection text, the ChatML system line), ``<|im_start|>``/``<|im_end|>`` as special
    tokens, ``<|im_end|>`` as eos, SmolLM2's ChatML chat template. Needs transformers' own
    ``tokenizers``, no file; the same vocabulary on every run."""
    from support.two_agent_case import PIPELINE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvcomm.integrations.transformers.embedded import CHATML_TEMPLATE

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    data = REPO / "kvcomm" / "data"
    texts = [text for file in sorted(data.glob("*.json")) for text in strings(json.loads(file.read_text(encoding="utf-8")))]
    texts += list(strings(PIPELINE)) + [EXACT_TEXT, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


EXACT_TEXT = "The harbour log lists ferries, crates and passengers. " * 20


def _tokenizer(folder: str | None):
    if folder is None:
        return check_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _llama(tokenizer, dtype: torch.dtype, device: str, seed: int = 0, init_on_device: bool = False, **shape):
    """A random Llama with ``tokenizer``'s vocabulary: tiny unless ``shape`` says otherwise.
    Initialized on the CPU (the same weights on every device for a seed) unless ``init_on_device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048), **shape},
    )
    torch.manual_seed(seed)
    with torch.device(device if init_on_device else "cpu"):
        model = LlamaForCausalLM(config)
    return model.to(dtype).to(device).eval()


def selfcheck_rows(device: str) -> list[tuple[str, str, str]]:
    from support.rope_variants import VARIANTS, build

    from kvcomm.core.rope import RopeError
    from kvcomm.integrations.transformers.rotary import rotary_from_model, self_check

    rows = []
    for name, dtype in DTYPES.items():
        for variant in VARIANTS:
            model = copy.deepcopy(build(variant)).to(dtype).to(device)  # build() caches: never convert its model
            try:
                rotary, check = rotary_from_model(model)
            except RopeError as error:
                rows.append((f"selfcheck[{variant.name},{name}]", "FAIL", str(error)[:160]))
                continue
            share = check.max_abs_error / (check.tolerance * max(1.0, check.key_scale))
            rows.append((f"selfcheck[{variant.name},{name}]", "PASS",
                         f"max error {check.max_abs_error:.3g} = {share:.0%} of tolerance"))
        model = copy.deepcopy(build(VARIANTS[0])).to(dtype).to(device)
        right = rotary_from_model(model)[0]
        check = self_check(model, replace(right, inv_freq=right.inv_freq * 1.01))
        rows.append((f"control[{name}]", "FAIL" if check.passed else "PASS",
                     f"1% wrong frequencies: error {check.max_abs_error:.3g} vs tolerance "
                     f"{check.tolerance * max(1.0, check.key_scale):.3g}"))
    return rows


def exact_rows(tokenizer, device: str) -> list[tuple[str, str, str]]:
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    rows = []
    ids = tokenizer.encode(EXACT_TEXT, add_special_tokens=False)
    for name, dtype in DTYPES.items():
        executor = TransformersExecutor(_llama(tokenizer, dtype, device, num_hidden_layers=4), tokenizer)
        dense = executor.generate(ids, None, 12, keep_logprobs=True)
        cut = len(ids) - 1
        injected = executor.generate(ids, dense.computed.span(0, cut), 12, keep_logprobs=True)
        gap = float((injected.prompt_logprobs[-1] - dense.prompt_logprobs[-1]).abs().max())
        eps = torch.finfo(dtype).eps
        ok = gap <= max(1e-4, 64 * eps) and (dtype != torch.float32 or injected.reply_ids == dense.reply_ids)
        rows.append((f"exact[{name}]", "PASS" if ok else "FAIL",
                     f"{cut} of {len(ids)} tokens injected: reply {'same' if injected.reply_ids == dense.reply_ids else 'differs'}, "
                     f"last-token log-prob max |diff| {gap:.3g}"))
    return rows


def _pipeline_decisions(executor, mode: str) -> list[tuple]:
    from support.two_agent_case import PIPELINE

    from kvcomm.anchors.config import PoolConfig
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.engine import ReuseEngine
    from kvcomm.reuse.pipeline import parse_pipeline
    from kvcomm.reuse.runner import run_row

    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode=mode, pool=PoolConfig(gamma=1.0)))
    out = []
    for row in range(len(spec.inputs)):
        for call in run_row(spec, row, executor, engine):
            p = call.provenance
            out.append((call.agent, row, p.exact_tokens, p.estimated_tokens, p.computed_tokens, p.note, call.reply_ids))
    return out


def device_agreement_rows(tokenizer, device: str) -> list[tuple[str, str, str]]:
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    rows = []
    on_cpu = TransformersExecutor(_llama(tokenizer, torch.float32, "cpu"), tokenizer)
    on_device = TransformersExecutor(_llama(tokenizer, torch.float32, device), tokenizer)
    for mode in ("realign", "kvcomm", "cacheblend"):
        cpu, dev = _pipeline_decisions(on_cpu, mode), _pipeline_decisions(on_device, mode)
        estimated = sum(c[3] for c in dev)
        same = cpu == dev
        rows.append((f"cpu=device[{mode}]", "PASS" if same and estimated > 0 else "FAIL",
                     f"{len(dev)} calls, {estimated} tokens reused from the engine; decisions and replies "
                     f"{'equal' if same else 'differ: ' + str(next((a, b) for a, b in zip(cpu, dev) if a != b))[:200]}"))
    return rows


def ttft_rows(tokenizer, device: str, dtype_name: str, shape_name: str) -> tuple[list[tuple[str, str, str]], dict]:
    from kvcomm.anchors.config import PoolConfig
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.pipeline import load_bundled_pipeline
    from kvcomm.eval.demo_report import demo_json
    from kvcomm.cli import DEMO_GAMMA, DEMO_PIPELINE
    from kvcomm.eval.demo import DenseTransformers, run_demo
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    model = _llama(tokenizer, DTYPES[dtype_name], device, init_on_device=True, **SHAPES[shape_name])
    executor = TransformersExecutor(model, tokenizer)
    spec = load_bundled_pipeline(DEMO_PIPELINE)
    config = ReuseConfig(pool=PoolConfig(gamma=DEMO_GAMMA), base_source="first_use")
    # an untimed run of the first three rows on an engine that is then dropped: CUDA loads each
    # kernel, and the allocator grows its pool, on first use; a serving process has done both
    run_demo(replace(spec, inputs=spec.inputs[:3]), executor, DenseTransformers(executor), config, progress=False)
    calls, _ = run_demo(spec, executor, DenseTransformers(executor), config, progress=False)
    report = demo_json(calls, {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
                               "dtype": dtype_name, "model_shape": shape_name})
    s = report["summary"]
    split = sum(c.exact_tokens for c in calls), sum(c.estimated_tokens for c in calls), sum(c.prompt_tokens for c in calls)
    rows = [(f"ttft[{shape_name}:{dtype_name}]", "INFO",
             f"{len(calls)} calls: dense {s['total_ttft_dense_s']:.3f} s vs kvcomm {s['total_ttft_reuse_s']:.3f} s total TTFT "
             f"({s['total_ttft_speedup']:.2f}x); tokens exact {split[0]} + estimated {split[1]} of {split[2]}")]
    for agent in report["agents"]:
        rows.append((f"ttft[{shape_name}:{dtype_name},{agent['agent']}]", "INFO",
                     f"p50 dense {1000 * agent['ttft_dense_p50_s']:.1f} ms, kvcomm {1000 * agent['ttft_reuse_p50_s']:.1f} ms; "
                     f"p95 {1000 * agent['ttft_dense_p95_s']:.1f} / {1000 * agent['ttft_reuse_p95_s']:.1f} ms"))
    return rows, report


def _rotary(head_dim: int, theta: float):
    from kvcomm.core.rope import Rotary

    return Rotary(1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0, head_dim)


def fused_rows(device: str) -> list[tuple[str, str, str]]:
    from bench_ops import warm_engine
    from support.paged_layouts import layouts, paged, read

    from kvcomm.core.copy import copy_tokens
    from kvcomm.core.kv_target import KVTarget
    from kvcomm.core.place import place_all
    from kvcomm.reuse.assemble import pieces

    layers, heads, dim, blocks, block_size = 4, 2, 64, 12, 16
    ulps = {"fp32": 2e-6, "bf16": 2 ** -7, "fp16": 2 ** -10}
    rows, before = [], os.environ.get("KVCOMM_TRITON")
    rotary = _rotary(dim, 10000.0)
    try:
        for dtype_name, dtype in DTYPES.items():
            os.environ["KVCOMM_TRITON"] = "0"
            engine, prompt = warm_engine(rotary, layers, 3, 2, 40, heads, dim, dtype, device)
            plan = engine.plan(prompt)
            written = pieces(plan)
            slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(0))[: plan.reuse_end].to(device)
            for name, make in layouts(blocks, block_size, heads, dim, dtype, device).items():
                got = {}
                for triton in ("1", "0"):
                    os.environ["KVCOMM_TRITON"] = triton
                    held = [make() for _ in range(layers)]
                    place_all(written, KVTarget.at_slots(paged(held), slots), engine.rotary)
                    got[triton] = [read(layer, slots) for layer in held]
                error = max(float(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1)).max())
                            for pair_a, pair_b in zip(got["1"], got["0"]) for a, b in zip(pair_a, pair_b))
                os.environ["KVCOMM_TRITON"] = "1"
                out = torch.zeros(layers, 2, heads, len(slots), dim, dtype=dtype, device=device)
                copy_tokens(KVTarget.at_slots(paged(held), slots), KVTarget.contiguous(KV_of(out), 0, len(slots)))
                exact = all(torch.equal(out[layer, 0], k) and torch.equal(out[layer, 1], v)
                            for layer, (k, v) in enumerate(got["0"]))
                ok = error <= 2 * ulps[dtype_name] and exact
                rows.append((f"fused[{name}:{dtype_name}]", "PASS" if ok else "FAIL",
                             f"{plan.reuse_end} tokens ({sum(p.match is not None for p in plan.pieces)} segments estimated): "
                             f"kernel vs composite {error / ulps[dtype_name]:.2f} ulp; capture copy "
                             f"{'exact' if exact else 'DIFFERS'}"))
    finally:
        if before is None:
            os.environ.pop("KVCOMM_TRITON", None)
        else:
            os.environ["KVCOMM_TRITON"] = before
    return rows


def KV_of(both: torch.Tensor):
    from kvcomm.core.kv import KV

    return KV(both[:, 0], both[:, 1])


def _median_ms(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def reuse_cost_rows(tokenizer, device: str, dtype_name: str, shape_name: str) -> list[tuple[str, str, str]]:
    from bench_ops import warm_engine
    from support.paged_layouts import layouts, paged

    from kvcomm.core.kv_target import KVTarget
    from kvcomm.core.place import place_all
    from kvcomm.reuse.assemble import pieces

    shape, dtype = SHAPES[shape_name], DTYPES[dtype_name]
    layers, heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // shape["num_attention_heads"]
    tokens, anchors, block_size = 1000, 5, 16
    engine, prompt = warm_engine(_rotary(dim, 500000.0), layers, anchors, 1, tokens, heads, dim, dtype, device)
    blocks = -(-(len(prompt) + 16) // block_size)
    cache = paged([layouts(blocks, block_size, heads, dim, dtype, device)["flash_attention"]() for _ in range(layers)])
    slots = torch.arange(len(prompt), device=device)
    state = {}

    def reuse():
        plan = state["plan"] = engine.plan(prompt)
        place_all(pieces(plan), KVTarget.at_slots(cache, slots[: plan.reuse_end]), engine.rotary)

    for _ in range(3):
        reuse()
    reuse_ms = _median_ms(reuse, 20, device)
    plan = state["plan"]
    estimated = sum(p.base.length for p in plan.pieces if p.match is not None)
    model = _llama(tokenizer, dtype, device, init_on_device=True, **shape)
    ids = torch.randint(100, 5000, (1, 1100), device=device)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, use_cache=True)
        dense_ms = _median_ms(lambda: model(ids, use_cache=True), 5, device)
    return [(f"reuse_cost[{shape_name}:{dtype_name}]", "INFO",
             f"plan + fused write of {plan.reuse_end} tokens ({estimated} estimated, {anchors} anchors, {layers} layers): "
             f"{reuse_ms:.3f} ms; dense prefill of 1,100 tokens {dense_ms:.2f} ms ({100 * reuse_ms / dense_ms:.1f} %)")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device to check (default cuda)")
    parser.add_argument("--tokenizer", help="a saved tokenizer folder (default: the check's own BPE, check_tokenizer())")
    parser.add_argument("--json", help="write every row and the TTFT reports here")
    parser.add_argument("--ttft", nargs="+", default=["1.7b:bf16", "8b:bf16"], metavar="SHAPE:DTYPE",
                        help=f"model shapes ({', '.join(SHAPES)}) and dtypes ({', '.join(DTYPES)}) the TTFT step times "
                             "(default: 1.7b:bf16 8b:bf16)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("selfcheck", "exact", "agreement", "fused", "ttft"),
                        help="checks to leave out")
    args = parser.parse_args(argv)
    for setting in args.ttft:
        shape, _, dtype_name = setting.partition(":")
        if shape not in SHAPES or dtype_name not in DTYPES:
            parser.error(f"--ttft {setting}: expected SHAPE:DTYPE with SHAPE in {', '.join(SHAPES)} and DTYPE in {', '.join(DTYPES)}")
    dropped = []
    if args.device.startswith("cuda"):
        # set, a GPU run would interpret its kernels on the host (TRITON_INTERPRET, read when Triton
        # is imported) or skip them (KVCOMM_TRITON=0) and time the wrong path
        dropped = [name for name in ("TRITON_INTERPRET", "KVCOMM_TRITON") if os.environ.pop(name, None) is not None]
        if "TRITON_INTERPRET" in dropped and "triton" in sys.modules:
            print("gpu_core_check: Triton was imported with TRITON_INTERPRET set; run the GPU check in a process without it",
                  file=sys.stderr)
            return 2
    use_this_checkout()
    from kvcomm.integrations.transformers.embedded import parse_device

    try:
        device = str(parse_device(args.device))
    except ValueError as error:
        print(f"gpu_core_check: {error}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default, stated)
    tokenizer = _tokenizer(args.tokenizer)
    print(f"== torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else "")
          + (f"; dropped {', '.join(dropped)} from the environment" if dropped else ""), flush=True)
    steps = {"selfcheck": lambda: selfcheck_rows(device), "exact": lambda: exact_rows(tokenizer, device),
             "agreement": lambda: device_agreement_rows(tokenizer, device), "fused": lambda: fused_rows(device)}
    rows, reports, started_all = [], {}, time.perf_counter()
    for name, step in steps.items():
        if name in args.skip:
            continue
        started = time.perf_counter()
        try:
            got = step()
        except Exception:  # one step failing must not hide the others
            got = [(name, "FAIL", _failure())]
        got.append((f"{name} time", "INFO", f"{time.perf_counter() - started:.1f} s"))
        for row in got:
            print(f"{row[1]:5} {row[0]:34} {row[2]}", flush=True)
        rows += got
    if "ttft" not in args.skip:
        for setting in args.ttft:
            shape, _, dtype_name = setting.partition(":")
            started = time.perf_counter()
            try:
                if device.startswith("cuda") and shape != "tiny":
                    for row in reuse_cost_rows(tokenizer, device, dtype_name, shape):
                        print(f"{row[1]:5} {row[0]:34} {row[2]}", flush=True)
                        rows.append(row)
                got, reports[setting] = ttft_rows(tokenizer, device, dtype_name, shape)
            except Exception:
                got = [(f"ttft[{setting}]", "FAIL", _failure())]
            got.append((f"ttft[{setting}] time", "INFO", f"{time.perf_counter() - started:.1f} s"))
            for row in got:
                print(f"{row[1]:5} {row[0]:34} {row[2]}", flush=True)
            rows += got
    ok = all(verdict != "FAIL" for _, verdict, _ in rows)
    print("ALL CHECKS HOLD" if ok else "SOME CHECKS FAILED", flush=True)
    summary = summarize(rows, reports, device, tokenizer, time.perf_counter() - started_all)
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": [asdict_row(r) for r in rows], "ttft": reports},
                                              indent=1, default=str))
    return 0 if ok else 1


def summarize(rows: list[tuple[str, str, str]], reports: dict, device: str, tokenizer, seconds: float) -> dict:
    """The run in one JSON object: verdict counts, the failed checks, each TTFT setting's totals
    (seconds) and token split, each reuse cost row, and what ran where."""
    from kvcomm.core.device import uses_triton

    ttft = {setting: {key: report["summary"][key] for key in ("total_ttft_dense_s", "total_ttft_reuse_s", "total_ttft_speedup")}
            for setting, report in reports.items()}
    return {
        "ok": all(verdict != "FAIL" for _, verdict, _ in rows),
        "verdicts": {verdict: sum(row[1] == verdict for row in rows) for verdict in ("PASS", "FAIL", "INFO")},
        "failed": [check for check, verdict, _ in rows if verdict == "FAIL"],
        "ttft": ttft,
        "reuse_cost": {check: detail for check, verdict, detail in rows if check.startswith("reuse_cost[")},
        "seconds": round(seconds, 1),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "triton_kernels": uses_triton(torch.device(device)),
        "tokenizer_vocabulary": len(tokenizer),
    }


def _failure() -> str:
    """The exception being handled and the innermost frames of its traceback, on one line."""
    return " | ".join(line.strip() for line in traceback.format_exc(limit=-4).splitlines())[-1200:]


def asdict_row(row: tuple[str, str, str]) -> dict:
    return dict(zip(("check", "verdict", "detail"), row))


if __name__ == "__main__":
    sys.exit(main())
