"""The `kvcomm` command on small real models saved as local folders (``--model PATH``):
``run PIPELINE.json`` end to end with its options and both outputs (the numbers checked
against the per-call rows, not only present), and ``selfcheck`` refusing models that
cannot be realigned with exit status 1."""

from __future__ import annotations

import json
import re
import statistics

import numpy as np
import pytest
import torch

from kvcomm.cli import main
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)

PIPELINE = {
    "agents": [
        {"name": "reader", "system": "You read closely.", "template": "Text: {doc}\nSay what it is about."},
        {"name": "asker", "system": "You ask questions.", "template": "Text: {doc}\nNotes: {reader}\nAsk one question."},
    ],
    "inputs": [
        {"doc": "The river Seine flows through Paris and into the English Channel."},
        {"doc": "Mount Fuji is the highest mountain in Japan, near Tokyo."},
        {"doc": "The Nile is a long river in Africa that flows north into the sea."},
        {"doc": "Bananas are yellow fruits that grow in warm countries."},
        {"doc": "Copper is a metal that conducts heat and electricity well."},
        {"doc": "The violin has four strings and is played with a bow."},
    ],
    "max_new_tokens": 4,
}
ROWS = len(PIPELINE["inputs"])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir(), local_files_only=True)


def _save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_llama(tokenizer, tmp_path_factory) -> str:
    """A random 2-layer Llama folder with SmolLM2's tokenizer (head size 64, so vLLM's CPU
    attention accepts it too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return _save(LlamaForCausalLM(config).eval(), tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def pipeline_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pipeline") / "pipeline.json"
    path.write_text(json.dumps(PIPELINE))
    return str(path)


def _run_json(capsys, *argv: str) -> dict:
    assert main(["run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_json_numbers_follow_from_the_calls(tiny_llama, pipeline_file, tokenizer, capsys):
    report = _run_json(capsys, pipeline_file, "--model", tiny_llama, "--gamma", "1", "--base-source", "first_use")
    assert report["model"] == tiny_llama and report["backend"] == "transformers"
    assert report["gamma"] == 1.0 and report["base_source"] == "first_use"
    calls, summary = report["calls"], report["summary"]
    assert [(c["input_index"], c["agent"]) for c in calls] == [(r, a) for r in range(ROWS) for a in ("reader", "asker")]
    for call in calls:
        assert call["exact_tokens"] + call["estimated_tokens"] + call["computed_tokens"] == call["prompt_tokens"]
        assert call["reply_equal"] == (call["dense_reply"] == call["reuse_reply"])
        assert call["dense_cached_tokens"] == call["reuse_cached_tokens"] == 0  # transformers: no prefix cache
    assert summary["dense_cached_tokens"] == summary["reuse_cached_tokens"] == 0
    assert summary["dense_prompt_tokens"] == sum(c["dense_prompt_tokens"] for c in calls) > 0
    # the reader's prompt holds no earlier reply: its length is the chat template's own
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
    from kvcomm.integrations.transformers.executor import TransformersExecutor
    from kvcomm.reuse.pipeline import parse_pipeline
    from kvcomm.reuse.runner import _content, build_prompt

    executor = TransformersExecutor(*load_model_and_tokenizer(tiny_llama))
    spec = parse_pipeline(PIPELINE)
    for call in calls[::2]:
        prompt = build_prompt(executor, spec.agents[0], {"doc": _content(executor, PIPELINE["inputs"][call["input_index"]]["doc"])})
        assert call["prompt_tokens"] == len(prompt)

    prompt = sum(c["prompt_tokens"] for c in calls)
    reused = sum(c["exact_tokens"] + c["estimated_tokens"] for c in calls)
    rho = reused / prompt
    assert summary["estimated_tokens"] > 0 and 0 < rho < 1  # gamma 1: later rows estimate
    assert summary["prompt_tokens"] == prompt and summary["calls"] == len(calls)
    assert summary["token_reuse_rate"] == pytest.approx(rho)
    assert summary["estimated_token_rate"] == pytest.approx(sum(c["estimated_tokens"] for c in calls) / prompt)
    assert summary["ttft_speedup_ceiling"] == pytest.approx(1 / (1 - rho))
    assert summary["agent_reuse_rate"] == pytest.approx(statistics.fmean(c["reused"] for c in calls))
    assert summary["fallback_rate"] == pytest.approx(statistics.fmean(c["fallback"] for c in calls))
    assert summary["reply_agreement_rate"] == pytest.approx(statistics.fmean(c["reply_equal"] for c in calls))
    with_reuse = [c for c in calls if c["exact_tokens"] + c["estimated_tokens"] > 0]
    assert summary["mean_ttft_speedup"] == pytest.approx(statistics.fmean(c["ttft_dense_s"] / c["ttft_reuse_s"] for c in with_reuse))
    totals = {side: sum(c[f"ttft_{side}_s"] for c in calls) for side in ("dense", "reuse")}  # misses included
    assert summary["total_ttft_dense_s"] == pytest.approx(totals["dense"])
    assert summary["total_ttft_reuse_s"] == pytest.approx(totals["reuse"])
    assert summary["total_ttft_speedup"] == pytest.approx(totals["dense"] / totals["reuse"])
    assert report["mode"] == "kvcomm" and summary["recomputed_tokens"] == 0 == sum(c["recomputed_tokens"] for c in calls)
    for side in ("dense", "reuse"):
        times = [c[f"ttft_{side}_s"] for c in calls]
        assert summary[f"ttft_{side}_p50_s"] == pytest.approx(float(np.percentile(times, 50)))
        assert summary[f"ttft_{side}_p95_s"] == pytest.approx(float(np.percentile(times, 95)))
    for row in report["agents"]:
        mine = [c for c in calls if c["agent"] == row["agent"]]
        assert row["calls"] == ROWS
        assert row["token_reuse_rate"] == pytest.approx(
            sum(c["exact_tokens"] + c["estimated_tokens"] for c in mine) / sum(c["prompt_tokens"] for c in mine))
    # first_use: new content's base comes from the prefill that computes it
    assert any("its base is taken from this prefill" in c["note"] for c in calls)


def test_run_max_anchors_caps_every_pool_and_the_table_matches_its_rows(tiny_llama, pipeline_file, capsys):
    # plans make anchors only of what they compute anyway (cold slots are served realigned): V caps what they make
    capped = _run_json(capsys, pipeline_file, "--model", tiny_llama, "--gamma", "0", "--max-anchors", "2", "--base-source", "standalone")
    assert capped["max_anchors"] == 2 and capped["base_source"] == "standalone"
    assert capped["anchors"] and 1 <= max(capped["anchors"].values()) <= 2
    assert not any("its base is taken from this prefill" in c["note"] for c in capped["calls"])

    assert main(["run", pipeline_file, "--model", tiny_llama, "--gamma", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["input", "agent", "prompt", "exact", "estim", "comp", "cached", "dense", "cached", "reuse",
                              "ttft", "dense", "ttft", "reuse", "same", "reply", "reason"]
    assert set(out[1]) == {"-"} and len(out[1]) == len(out[0])
    rows = [line.split() for line in out[2 : 2 + 2 * ROWS]]
    assert [(int(r[0]), r[1]) for r in rows] == [(i, a) for i in range(ROWS) for a in ("reader", "asker")]
    prompt, exact, estimated, computed = (sum(int(r[k]) for r in rows) for k in (2, 3, 4, 5))
    assert exact + estimated + computed == prompt
    assert out[2 + 2 * ROWS] == ""
    rho = (exact + estimated) / prompt
    assert out[3 + 2 * ROWS] == (f"token-level reuse {rho:.1%} (exact {exact}, estimated {estimated}, "
                                 f"computed {computed} of {prompt} prompt tokens)")
    assert all(r[6] == r[7] == "0" for r in rows)  # transformers: no prefix cache of its own
    for r in rows:  # each row's reason, in words, from its own counts
        assert " ".join(r[13:]).startswith(f"reused {int(r[3]) + int(r[4]):,} of {int(r[2]):,} tokens"), r
    equal = sum(r[12] == "yes" for r in rows)
    assert re.fullmatch(r"agent-level reuse [\d.]+%   calls that computed shared content and estimated none [\d.]+%",
                        out[4 + 2 * ROWS]), out[4 + 2 * ROWS]
    assert re.fullmatch(rf"replies equal to dense's, token for token: {equal}/{len(rows)} calls; precision floor, dense "
                        rf"bfloat16 vs dense float32 on the same calls: \d+/{len(rows)}", out[5 + 2 * ROWS]), out[5 + 2 * ROWS]
    assert f"(ceiling 1/(1-rho) = {1 / (1 - rho):.2f}x)" in out[6 + 2 * ROWS]
    dense_s, reuse_s = (sum(int(r[k]) for r in rows) / 1000 for k in (8, 10))  # the rows' TTFT columns, whole ms
    total = re.fullmatch(r"total TTFT over all calls, misses included: dense ([\d.]+) s, reuse ([\d.]+) s = ([\d.]+)x .*",
                         out[6 + 2 * ROWS])
    assert total, out[6 + 2 * ROWS]
    assert float(total[1]) == pytest.approx(dense_s, abs=0.006 + len(rows) * 5e-4)
    assert float(total[2]) == pytest.approx(reuse_s, abs=0.006 + len(rows) * 5e-4)
    assert out[7 + 2 * ROWS].startswith("TTFT p50 / p95: dense ")
    assert out[8 + 2 * ROWS].startswith("served by the runtime's own prefix cache") and "dense 0 of its " in out[8 + 2 * ROWS]
    assert f"reuse 0 of its {prompt} (counted as computed) besides the {exact + estimated} kvcomm injected" in out[8 + 2 * ROWS]
    anchors = dict(item.split("=") for item in re.sub(r"^anchors per slot: ", "", out[-1]).split(", "))
    # plans make anchors only of what they compute anyway: the first row's document (its
    # template text new to the engine); the later rows serve theirs realigned (a cold slot)
    assert int(anchors["doc"]) == 1


def test_run_kvblend_recomputes_part_of_what_it_injects(tiny_llama, pipeline_file, capsys):
    report = _run_json(capsys, pipeline_file, "--model", tiny_llama, "--gamma", "1", "--mode", "kvblend")
    assert report["mode"] == "kvblend"
    calls = report["calls"]
    blended = [c for c in calls if c["recomputed_tokens"]]
    assert blended, "gamma 1: later rows estimate, and kvblend recomputes some of those tokens"
    for call in calls:
        assert call["exact_tokens"] + call["estimated_tokens"] + call["computed_tokens"] == call["prompt_tokens"]
        assert call["recomputed_tokens"] <= call["computed_tokens"]
    assert report["summary"]["recomputed_tokens"] == sum(c["recomputed_tokens"] for c in calls)


def test_run_refuses_a_blend_mode_on_vllm_before_loading_the_model(pipeline_file, tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")  # a load would fail with another message
    for mode, instead in (("kvblend", "kvcomm"), ("cacheblend", "realign")):
        assert main(["run", pipeline_file, "--model", missing, "--backend", "vllm", "--mode", mode]) == 2
        err = capsys.readouterr().err
        assert f"--mode {mode} recomputes" in err and "--backend transformers" in err and f"--mode {instead}" in err


def _refused(capsys, folder: str) -> dict:
    assert main(["selfcheck", "--model", folder, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] is False and result["model"] == folder
    return result


def test_selfcheck_exits_1_for_a_model_without_rope(tokenizer, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=256, bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    folder = _save(model.eval(), tokenizer, tmp_path / "gpt2")
    assert "has no rotary embedding" in _refused(capsys, folder)["error"]
    assert main(["selfcheck", "--model", folder]) == 1  # the plain output says it on stderr
    captured = capsys.readouterr()
    last = captured.err.splitlines()[-1]  # after the weight-loading progress bar
    assert last.startswith("RoPE self-check FAILED: ") and "use dense prefill" in last and captured.out == ""


def test_selfcheck_exits_1_for_linear_attention_layers(tokenizer, tmp_path, capsys):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, full_attention_interval=2,
    )
    assert "linear_attention" in config.layer_types
    folder = _save(Qwen3NextForCausalLM(config).eval(), tokenizer, tmp_path / "qwen3-next")
    error = _refused(capsys, folder)["error"]
    assert "linear_attention" in error and "hybrid linear-attention" in error


def test_selfcheck_exits_1_when_realigned_keys_do_not_match(tokenizer, tmp_path, capsys):
    """SmolLM3 leaves RoPE out of some layers (``no_rope_layers``): those keys carry no
    rotation, so rotating them to a new position is wrong and the check must catch it."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, no_rope_layers=[1, 0], use_sliding_window=False, pad_token_id=None,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    assert set(config.layer_types) == {"full_attention"}  # refused by the check itself, not by layer type
    folder = _save(SmolLM3ForCausalLM(config).eval(), tokenizer, tmp_path / "smollm3-nope")
    assert "RoPE self-check failed" in _refused(capsys, folder)["error"]


@pytest.mark.slow
def test_eval_on_the_vllm_backend_without_kl(tiny_llama, tmp_path, capsys):
    """``eval --backend vllm --no-kl`` runs vLLM in process with the kvcomm connector and
    writes results whose reuse numbers come from vLLM's side."""
    out = tmp_path / "eval"
    argv = ["eval", "--workload", "mmlu", "--limit", "3", "--agents", "1", "--modes", "exact,kvcomm", "--gammas", "1",
            "--max-new-tokens", "2", "--out", str(out), "--backend", "vllm", "--no-kl", "--no-progress", "--model", tiny_llama]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    assert "agent calls in" in printed and "prefix hit" in printed
    assert "quality guard off: the vllm backend keeps no log-probabilities" in printed  # the default budget, said
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["backend"] == "vllm" and results["settings"]["kl"] is False
    assert results["settings"]["model"] == tiny_llama and (out / "results.csv").is_file()
    pooled = {row["mode"]: row for row in results["aggregates"] if row["seed"] == "pooled"}
    assert set(pooled) == {"dense", "exact", "kvcomm"}
    for row in pooled.values():
        assert row["calls"] == 3 * 2 and row["kl_mean"] is None and row["noise_kl_mean"] is None
        assert row["exact_tokens"] + row["estimated_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
    assert pooled["dense"]["token_reuse_rate"] == 0
    for mode, row in pooled.items():  # vLLM's prefix-cache hits, each run's own, reported per call and summed
        mine = [c for c in results["calls"] if c["mode"] == mode]
        assert row["cached_tokens"] == sum(c["cached_tokens"] for c in mine)
        assert all(0 <= c["cached_tokens"] <= c["computed_tokens"] for c in mine)
        assert mine[0]["cached_tokens"] == 0  # a run's first call: nothing of its own cached yet
    assert "cached_tokens" in (out / "results.csv").read_text().splitlines()[0].split(",")
    # every row's prompts open with the same system prompt and instructions: exact hits from row 2 on
    assert pooled["exact"]["exact_tokens"] > 0 and pooled["exact"]["estimated_tokens"] == 0
    assert all(c["kl_positions"] == 0 for c in results["calls"])
