"""In-process vLLM engines with the kvcomm connector, one after another in one process.

vLLM keeps one worker-side KV connector per process and gives it to every later engine
until the engine that made it shuts down. These tests run in a subprocess of their own, so
the session's engine (``vllm_llm``) is not in the way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ENGINES_IN_TURN = r"""
import json, sys
import torch
from kvcomm.core.segments import Segment
from kvcomm.integrations.transformers.embedded import load_tokenizer
from kvcomm.integrations.vllm.inprocess.llm import make_llm
from kvcomm.integrations.vllm.inprocess.executor import VllmExecutor

model = sys.argv[1]
def start():
    return VllmExecutor(make_llm(model, block_size=32, max_num_batched_tokens=64), load_tokenizer(model))

first = start()
ids = first.encode("Two agents read the same report and answer in turn.")
segment = Segment(tuple(ids), "doc")
replies, bases = [list(first.generate(ids, None, 4).reply_ids)], [first.base_kv(segment)]
try:
    make_llm(model, block_size=32)
    refused = None
except RuntimeError as error:
    refused = str(error)
from vllm import LLM  # around make_llm: the second engine starts, on the first one's connector
from kvcomm.integrations.vllm.inprocess.llm import DEFAULTS, shutdown_llm
from kvcomm.integrations.vllm.wire.config import transfer_config
rogue = LLM(model=model, **{**DEFAULTS, "block_size": 32, "max_num_batched_tokens": 64}, kv_transfer_config=transfer_config())
try:
    VllmExecutor(rogue, load_tokenizer(model))
    diagnosed = None
except RuntimeError as error:
    diagnosed = str(error)
shutdown_llm(rogue)
first.close()
with start() as second:
    verified = second.rotary is not None
    replies.append(list(second.generate(ids, None, 4).reply_ids))
    bases.append(second.base_kv(segment))
same_base = torch.equal(bases[0].keys, bases[1].keys) and torch.equal(bases[0].values, bases[1].values)
print(json.dumps({"refused": refused, "diagnosed": diagnosed, "verified": verified, "replies": replies, "same_base": same_base}))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from support.pipeline_run import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.slow
def test_a_second_engine_is_refused_while_the_first_runs_and_works_after_it_closed(tiny_model):
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-c", _ENGINES_IN_TURN, tiny_model], capture_output=True, text=True,
                          timeout=600, env=env, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # While the first engine runs, a second would get its worker-side connector: refused, saying what to do.
    assert result["refused"] is not None and "shutdown_llm" in result["refused"]
    # An engine built around make_llm gets no connector of its own: its executor says why.
    assert result["diagnosed"] is not None and "never registered" in result["diagnosed"]
    # After close, the next engine registers its own connector: RoPE verified, KV captured through it.
    assert result["verified"]
    assert result["same_base"]
    assert result["replies"][0] == result["replies"][1] and len(result["replies"][0]) > 0
