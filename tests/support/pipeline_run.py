"""Run the demo pipeline's annotated requests through a ``vllm.LLM`` with the kvcomm plugin in
one engine mode, in a process of its own, and print what happened as one JSON line.

``python pipeline_run.py inproc``: worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
``python pipeline_run.py mp``: vLLM's default (engine core and worker in processes of their own).
``python pipeline_run.py mp MODEL_DIR 2 [STATE_DIR [MAX_TENANT_BYTES]]``: on another model, with
tensor parallelism 2 (one worker process per rank), saving state at exit, under a byte cap;
``python pipeline_run.py save-tiny-llama DIR`` saves a model it can split.

Per call: the prompt length, the returned provenance (``kv_transfer_params["kvcomm"]``), vLLM's
cached token count and the reply token ids; plus the engine's executor backend, the engine
client's class, and the pids of the engine's worker processes (none in-process).
Rows 0-2 of the demo pipeline (each agent sees the earlier agents' replies), then the first
prompt again (an exact repeat), then a request that does not opt in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TENANT = "pipeline-run"
MAX_TOKENS = 12


class _Text:
    """The prompt building part of an executor: SmolLM2's tokenizer and chat template."""

    def __init__(self, tokenizer):
        from kvcomm.integrations.transformers.executor import TransformersExecutor

        self.tokenizer = tokenizer
        self.encode = TransformersExecutor.encode.__get__(self)
        self.render = TransformersExecutor.render.__get__(self)


def _options(prompt) -> dict:
    spans = [{"start": start, "end": start + len(segment), "slot": segment.slot}
             for segment, start in zip(prompt.segments, prompt.starts) if segment.is_shared]
    return {"kvcomm": {"template": prompt.template_id, "tenant": TENANT, "segments": spans}}


def run_in_subprocess(*args: str) -> dict:
    """``python pipeline_run.py ARGS...`` in a process of its own (1 GiB CPU KV cache, one
    thread, vLLM's default engine unless the mode is ``inproc``); returns its JSON line and
    fails with the end of its stderr if it exits non-zero."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if args[0] == "inproc":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def save_tiny_model(folder: str, kv_heads: int = 2, sliding_window: int | None = None) -> str:
    """A random 2-layer Llama (4 query heads, ``kv_heads`` KV heads, fp32) with SmolLM2's
    tokenizer, saved where vLLM can load it: a model tensor parallelism can split. With
    ``sliding_window`` it is a Mistral (the same layers, windowed attention) instead."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from support.tokenizer import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    config_class, model_class, extra = (LlamaConfig, LlamaForCausalLM, {}) if sliding_window is None else (
        MistralConfig, MistralForCausalLM, {"sliding_window": sliding_window})
    config = config_class(
        **extra, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=2048, torch_dtype="float32",
        initializer_range=0.1,  # wide enough that greedy replies vary (at 0.02 they repeat one token)
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
    )
    with torch.random.fork_rng():  # seed 0 without touching the caller's generator
        torch.manual_seed(0)
        model = model_class(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(mode: str, model: str | None = None, tensor_parallel_size: int = 1, state_dir: str | None = None,
         max_tenant_bytes: int | None = None) -> None:
    if mode not in ("inproc", "mp"):
        raise SystemExit(f"mode must be inproc or mp, got {mode!r}")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcomm.core.segments import Segment
    from kvcomm.reuse.pipeline import load_demo_pipeline
    from kvcomm.reuse.runner import _content, build_prompt
    from kvcomm.integrations.vllm.inprocess.llm import make_llm
    from kvcomm.integrations.vllm.wire.config import transfer_config
    from support.tokenizer import embedded_tokenizer

    llm = make_llm(model, in_process=mode == "inproc", max_num_batched_tokens=64, max_num_seqs=8, block_size=32,
                   tensor_parallel_size=tensor_parallel_size,
                   kv_transfer_config=transfer_config(extra={
                       "plan": True, "gamma": 1.0, "strict": True, **({"state_dir": state_dir} if state_dir else {}),
                       **({"max_tenant_bytes": max_tenant_bytes} if max_tenant_bytes else {})}))
    text = _Text(embedded_tokenizer())
    eos = text.tokenizer.eos_token_id

    def serve(token_ids, options, salt=TENANT, max_tokens=MAX_TOKENS) -> dict:
        request = TokensPrompt(prompt_token_ids=list(token_ids))
        if salt:
            request["cache_salt"] = salt
        extra = None if options is None else {"kv_transfer_params": options}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        output = llm.generate([request], params, use_tqdm=False)[0]
        return {"prompt_tokens": len(token_ids), "kvcomm": (output.kv_transfer_params or {}).get("kvcomm"),
                "cached": output.num_cached_tokens, "reply": list(output.outputs[0].token_ids)}

    spec = load_demo_pipeline()
    calls, first = [], None
    for row in range(3):
        shared = {name: _content(text, spec.inputs[row][name]) for name in spec.input_slots}
        for agent in spec.agents:
            prompt = build_prompt(text, agent, shared)
            first = first or prompt
            call = serve(prompt.token_ids, _options(prompt))
            calls.append(call)
            reply = [t for t in call["reply"] if t != eos]
            shared[agent.name] = Segment(tuple(reply), slot="_") if reply else None
    repeat = serve(first.token_ids, _options(first))
    plain = serve(first.token_ids, None, salt=None)
    core = llm.llm_engine.engine_core
    print(json.dumps({
        "mode": mode, "env": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "backend": llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
        "client": type(core).__name__, "calls": calls, "repeat": repeat, "plain": plain,
        "tensor_parallel_size": llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
    }))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.tokenizer
    if sys.argv[1] == "save-tiny-llama":
        print(save_tiny_model(sys.argv[2]))
    else:
        main(sys.argv[1], *(sys.argv[2:3] or [None]), *map(int, sys.argv[3:4]), *sys.argv[4:5], *map(int, sys.argv[5:6]))
