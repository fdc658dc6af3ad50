"""The vLLM backend against the transformers reference, through the kvcomm connector.

One in-process engine per session (``vllm_llm`` fixture): prefix caching on, chunked
prefill with 64-token chunks, fp32 on both sides.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.core.kv import KV
from kvcomm.reuse.pipeline import load_demo_pipeline

pytestmark = pytest.mark.slow


def _chat(executor, text: str) -> list[int]:
    rendered = executor.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return executor.encode(rendered)


LONG = ("Read the notes and answer. Notes: the train leaves at nine, the bus at ten, the ferry at noon; "
        "tickets cost four dollars for the train, two for the bus and nine for the ferry. "
        "Question: which is cheapest, and when does it leave?")


def test_dense_call_matches_the_transformers_reference(vllm_executor, smol_executor):
    ids = _chat(vllm_executor, LONG)
    assert len(ids) > 64  # several prefill chunks
    ours, ref = vllm_executor.generate(ids, None, 24), smol_executor.generate(ids, None, 24)
    assert ours.reply_ids == ref.reply_ids
    assert torch.allclose(ours.computed.keys, ref.computed.keys, atol=1e-3)
    assert torch.allclose(ours.computed.values, ref.computed.values, atol=1e-3)
    assert torch.allclose(ours.reply_kv.keys, ref.reply_kv.keys, atol=1e-3)
    assert ours.ttft_s > 0


def test_injected_exact_prefix_gives_the_dense_reply_and_kv(vllm_executor, smol_executor):
    ids = _chat(vllm_executor, LONG)
    ref = smol_executor.generate(ids, None, 24)
    for cut in (1, 37, 64, len(ids) - 1):  # inside a block, on a block edge, all but the last token
        ours = vllm_executor.generate(ids, ref.computed.span(0, cut), 24)
        assert ours.reply_ids == ref.reply_ids, cut
        assert ours.computed.length == len(ids) - cut
        assert torch.allclose(ours.computed.keys, ref.computed.keys[:, :, cut:], atol=1e-3)


def test_injected_kv_is_really_used(vllm_executor, smol_executor):
    """Garbage KV for the first tokens must change the computed tail: the load is not a no-op."""
    ids = _chat(vllm_executor, LONG)
    ref = smol_executor.generate(ids, None, 8)
    wrong = KV(torch.randn_like(ref.computed.keys[:, :, :40]), torch.randn_like(ref.computed.values[:, :, :40]))
    ours = vllm_executor.generate(ids, wrong, 8)
    assert (ours.computed.values[1:] - ref.computed.values[1:, :, 40:]).abs().max() > 0.1


def test_a_preamble_is_dense_and_the_kv_behind_it_is_used(vllm_executor, smol_executor):
    """``preamble``: a request of its own computes [start, end) behind the injected [0, start); the
    call's request then injects everything up to the prefix's end (garbage in the preamble's slots
    must not survive)."""
    ids = _chat(vllm_executor, LONG)
    ref = smol_executor.generate(ids, None, 12)
    start, end, reused = 5, 70, len(ids) - 3  # the preamble spans a block edge
    truth = ref.computed.span(0, reused)
    prefix = KV(truth.keys.clone(), truth.values.clone())
    prefix.keys[:, :, start:end], prefix.values[:, :, start:end] = 9.0, -9.0
    ours = vllm_executor.generate(ids, prefix, 12, preamble=(start, end))
    assert torch.allclose(ours.preamble.keys, truth.keys[:, :, start:end], atol=1e-3)
    assert torch.allclose(ours.preamble.values, truth.values[:, :, start:end], atol=1e-3)
    assert ours.reply_ids == ref.reply_ids
    assert torch.allclose(ours.computed.keys, ref.computed.keys[:, :, reused:], atol=1e-3)


def test_base_kv_matches_the_reference(vllm_executor, smol_executor):
    from kvcomm.core.segments import Segment

    segment = Segment(tuple(vllm_executor.encode(" the ferry leaves at noon and costs nine dollars")), slot="task")
    ours, ref = vllm_executor.base_kv(segment), smol_executor.base_kv(segment)
    assert torch.allclose(ours.keys, ref.keys, atol=1e-3) and torch.allclose(ours.values, ref.values, atol=1e-3)


def test_streaming_and_cancellation(vllm_executor):
    ids = _chat(vllm_executor, LONG)
    full = vllm_executor.generate(ids, None, 12)
    seen: list[int] = []
    cut = vllm_executor.generate(ids, None, 12, on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert seen == list(full.reply_ids[:3]) and cut.reply_ids == full.reply_ids[:3]
    assert vllm_executor.generate(ids, None, 12, on_token=seen.append).reply_ids == full.reply_ids


def test_demo_pipeline_conformance(vllm_executor, smol_executor):
    """Same decisions, same dense replies; reuse replies agree with the reference's."""
    from kvcomm.cli import run_side_by_side

    spec = load_demo_pipeline()
    spec = dataclasses.replace(spec, inputs=spec.inputs[:3], max_new_tokens=12)  # short replies: CI time
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))  # admit reuse as soon as two anchors are compatible
    ref_dense, ref_reuse, _ = run_side_by_side(spec, smol_executor, config, progress=False)
    our_dense, our_reuse, _ = run_side_by_side(spec, vllm_executor, config, progress=False)

    dense_equal = [a.reply_ids == b.reply_ids for a, b in zip(ref_dense, our_dense)]
    same_prompt = [a.prompt_ids == b.prompt_ids for a, b in zip(ref_reuse, our_reuse)]
    same_plan = [
        (a.provenance.exact_tokens, a.provenance.estimated_tokens, a.provenance.computed_tokens)
        == (b.provenance.exact_tokens, b.provenance.estimated_tokens, b.provenance.computed_tokens)
        for a, b, same in zip(ref_reuse, our_reuse, same_prompt) if same
    ]
    reply_agree = [a.reply_ids == b.reply_ids for a, b in zip(ref_reuse, our_reuse)]
    estimated = sum(c.provenance.estimated_tokens for c in our_reuse)
    exact_calls = [(c, d) for c, d in zip(our_reuse, our_dense) if c.provenance.estimated_tokens == 0 and c.prompt_ids == d.prompt_ids]
    print(f"\nconformance: dense replies equal {sum(dense_equal)}/{len(dense_equal)}, "
          f"same reuse prompts {sum(same_prompt)}/{len(same_prompt)}, same plans {sum(same_plan)}/{len(same_plan)}, "
          f"reuse replies agree {sum(reply_agree)}/{len(reply_agree)}, estimated tokens {estimated}, "
          f"exact-only calls equal to dense {sum(c.reply_ids == d.reply_ids for c, d in exact_calls)}/{len(exact_calls)}")
    calls = len(spec.inputs) * len(spec.agents)
    assert len(dense_equal) == len(reply_agree) == calls and all(dense_equal)
    # Each row's first agent sees only the task, so its prompt is the same on both backends:
    # at least one compared plan per row; the first call has nothing to estimate from.
    assert len(same_plan) >= len(spec.inputs) and all(same_plan)
    assert estimated > 0
    assert len(exact_calls) >= 1 and all(c.reply_ids == d.reply_ids for c, d in exact_calls)
    assert sum(reply_agree) >= 0.8 * len(reply_agree)


FRESH_THREAD = """
import threading, torch
torch.set_num_threads(1)  # the process's count; a fresh thread's OpenMP default is the cores' (2 here)
from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor
from kvcomm.integrations.vllm.inprocess.llm import make_llm
from kvcomm.integrations.transformers.embedded import load_tokenizer
executor = VllmExecutor(make_llm(max_num_batched_tokens=64, max_num_seqs=2, block_size=32), load_tokenizer())
ids = executor.encode("Name three colours of the rainbow and one fruit for each of them.")
reference = executor.generate(ids, None, 4).reply_ids
outcome = []
def call():
    try:
        outcome.append(executor.generate(ids, None, 4).reply_ids)
    except Exception as error:
        outcome.append(error)
thread = threading.Thread(target=call)
thread.start()
thread.join()
executor.close()
print("OUTCOME", outcome[0] == reference, repr(outcome[0])[:300])
"""


def test_a_call_from_a_fresh_thread_runs_whatever_its_default_thread_count(tmp_path):
    """AutoGen runs a client's calls in worker threads; one that has run no torch op holds
    OpenMP's default thread count, not the process's, and vLLM's CPU attention refused such a
    step ("Check failed: input->metadata->thread_num == thread_num (2 vs. 1)"). Its own process:
    the engine must be built under a count other than a fresh thread's default."""
    if (os.cpu_count() or 1) < 2 or os.environ.get("OMP_NUM_THREADS") == "1":
        pytest.fail("needs a fresh thread's default thread count above 1 (2+ cores, OMP_NUM_THREADS not 1)")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", FRESH_THREAD], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    outcome = [line for line in done.stdout.splitlines() if line.startswith("OUTCOME")]
    assert done.returncode == 0 and outcome and outcome[0].startswith("OUTCOME True"), (outcome, done.stderr[-2000:])
