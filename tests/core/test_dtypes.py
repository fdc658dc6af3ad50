"""bf16 and fp16 models end to end: RoPE arithmetic, the self-check, the CLI and reuse.

1. ``Rotary`` on low-precision keys computes in fp32 and rounds once (bitwise contract), and a
   realign-then-rotate round trip in bf16/fp16 is no worse than the model's own RoPE rounding
   (hypothesis), and more accurate than rounding cos/sin to the key dtype as the model does.
2. The self-check on tiny random bf16/fp16 models of every RoPE variant (partial rotary,
   interleaved pairing, yarn and longrope attention scaling): passes, with errors bounded by the
   model's own rounding against its fp32 twin, and fails for a wrong rotary (wrong theta).
3. The embedded SmolLM2 (slow): ``kvcomm selfcheck --dtype bfloat16|float16`` exits 0, and reuse
   through ``run_agent`` on a bf16 model runs, with its KL to dense bf16 reported and bounded.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import math

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.core.divergence import kl_topk_other, top1_matches, topk_reference
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine
from kvcomm.anchors.config import PoolConfig
from kvcomm.integrations.transformers import rotary as hf_rotary
from kvcomm.integrations.transformers.embedded import DTYPES, parse_dtype
from kvcomm.integrations.transformers.rotary import (
    MODEL_ROPE_ROUNDING, SELF_CHECK_TOLERANCE, rotary_from_model, self_check, self_check_tolerance,
)
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.core.rope import RopeError, Rotary
from kvcomm.reuse.runner import run_agent
from .test_rope import BY_NAME, HEAD_DIM, TINY, VARIANTS, build, reference_rotate, rotaries
from support.two_agent_case import PIPELINE, agent_prompt

LOW = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "fp16"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------- 1. arithmetic on low-precision keys


def _rotary() -> Rotary:
    return Rotary(1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), 1.15, 19, False)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_low_precision_rotation_is_fp32_math_rounded_once(dtype, interleaved):
    """rotate/unrotate/shift of bf16/fp16 keys equal the fp32 result of the same (exactly
    upcast) keys, rounded once to the key dtype; with an fp32 source and a low-precision
    ``out`` too (how assembly writes reused KV). Pass-through channels are copied bit for bit."""
    rotary = Rotary(_rotary().inv_freq, 1.15, 19, interleaved)
    x = (torch.randn(3, 2, 40, 19, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    p = torch.arange(300, 340)
    for name, args in (("rotate", (p,)), ("unrotate", (p,)), ("shift", (-123,))):
        got = getattr(rotary, name)(x, *args)
        assert got.dtype == dtype
        assert torch.equal(got, getattr(rotary, name)(x.float(), *args).to(dtype)), name
        assert torch.equal(got[..., rotary.rotary_dim:], x[..., rotary.rotary_dim:])
    out = torch.full_like(x, float("nan"))
    wide = (torch.randn(3, 2, 40, 19, generator=torch.Generator().manual_seed(1)) * 4)
    assert rotary.rotate(wide, p, out=out) is out
    assert torch.equal(out, rotary.rotate(wide, p).to(dtype))


def _transformers_style_rotate(rotary: Rotary, x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """A rotation by ``angle`` ``[T, pairs]`` the way transformers applies RoPE in a low-precision
    model: cos and sin rounded to ``x.dtype``, products and sums in ``x.dtype`` (no scaling)."""
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    half = rotary.rotary_dim // 2
    x1, x2 = (x[..., 0:2 * half:2], x[..., 1:2 * half:2]) if rotary.interleaved else (x[..., :half], x[..., half:2 * half])
    out = x.clone()
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if rotary.interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = o1, o2
    else:
        out[..., :half], out[..., half:2 * half] = o1, o2
    return out


def _pair_norms(rotary: Rotary, x: torch.Tensor) -> torch.Tensor:
    half = rotary.rotary_dim // 2
    x = x.double()
    a, b = (x[..., 0:2 * half:2], x[..., 1:2 * half:2]) if rotary.interleaved else (x[..., :half], x[..., half:2 * half])
    return torch.hypot(a, b)


def _pair_errors(rotary: Rotary, got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per pair, the larger of its two channels' absolute errors."""
    half = rotary.rotary_dim // 2
    e = (got.double() - expected.double()).abs()
    a, b = (e[..., 0:2 * half:2], e[..., 1:2 * half:2]) if rotary.interleaved else (e[..., :half], e[..., half:2 * half])
    return torch.maximum(a, b)


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(rotaries(), st.sampled_from(LOW), st.integers(1, 6), st.integers(0, 2**31 - 1),
       st.integers(0, 8192), st.integers(0, 8192))
def test_realign_round_trip_is_no_worse_than_the_models_own_rope_rounding(rotary, dtype, tokens, seed, p, q):
    """A key cached at ``p`` in bf16/fp16, de-rotated to a position-free base stored in the same
    dtype, then rotated to ``q`` (how a base is reused): every pair is within ``eps |pair|`` of the
    exact rotation by ``q - p`` (two roundings of half an ulp, the math in fp32), below the model's
    own worst-case RoPE rounding of a single rotation, ``1.5 eps |pair|`` (``MODEL_ROPE_ROUNDING``
    per channel of |k|max). fp32 angle rounding adds ``2^-24 (p + q) |f|max |pair|``."""
    x = (torch.randn(2, tokens, rotary.head_dim, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    at_p, at_q = torch.full((tokens,), p), torch.full((tokens,), q)
    realigned = rotary.rotate(rotary.unrotate(x, at_p), at_q)
    assert realigned.dtype == dtype
    exact = reference_rotate(Rotary(rotary.inv_freq, 1.0, rotary.head_dim, rotary.interleaved), x, at_q - at_p)
    eps = torch.finfo(dtype).eps
    norms = _pair_norms(rotary, x)
    angle = 2 * 2.0**-24 * (p + q) * float(rotary.inv_freq.max())
    subnormal = 2 * torch.finfo(dtype).tiny * eps  # below the normal range rounding is absolute
    bound = norms * (eps * (1 + 2**-6) + angle) + subnormal
    assert eps * (1 + 2**-6) < MODEL_ROPE_ROUNDING / math.sqrt(2) * eps
    assert bool((_pair_errors(rotary, realigned, exact) <= bound).all())
    # the pass-through channels never change
    assert torch.equal(realigned[..., rotary.rotary_dim:], x[..., rotary.rotary_dim:])


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_round_trip_is_more_accurate_than_the_models_own_rotation(dtype):
    """On many keys: one rotation here (fp32 math, one rounding) is much closer to the exact
    rotation than the same rotation done the way the model does it (cos/sin, products and sums
    rounded to the key dtype); the realign round trip (two roundings) is still no worse than the
    model's single rotation, in mean and in max."""
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64), 1.0, 64, False)
    x = (torch.randn(4, 3, 256, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    p, q = torch.arange(1000, 1256), torch.arange(37, 293)

    def model_error(delta):
        angle = (delta.double()[:, None] * rotary.inv_freq.double()).float()
        return (_transformers_style_rotate(rotary, x, angle).double() - reference_rotate(rotary, x, delta)).abs()

    once = (rotary.rotate(x, q).double() - reference_rotate(rotary, x, q)).abs()
    assert float(once.mean()) < 0.75 * float(model_error(q).mean())
    trip = (rotary.rotate(rotary.unrotate(x, p), q).double() - reference_rotate(rotary, x, q - p)).abs()
    model = model_error(q - p)
    assert float(trip.mean()) <= float(model.mean()) and float(trip.max()) <= float(model.max())


# ------------------------------------------------------------------------- 2. the self-check


def test_tolerance_is_relative_to_the_dtype_rounding():
    assert self_check_tolerance(torch.float32) == SELF_CHECK_TOLERANCE == self_check_tolerance(torch.float64)
    for dtype in LOW:
        eps = torch.finfo(dtype).eps
        assert self_check_tolerance(dtype) == pytest.approx(2 * (2 * MODEL_ROPE_ROUNDING + 0.5) * eps)
    assert self_check_tolerance(torch.float16) < self_check_tolerance(torch.bfloat16) < 0.1
    with pytest.raises(RopeError, match="floating point"):
        self_check_tolerance(torch.int64)


def _low(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The tiny fp32 model of variant ``name`` cast to ``dtype`` with ``.to`` (its rotary
    buffers, inv_freq included, are cast too: the model then rotates with rounded frequencies)."""
    return copy.deepcopy(build(BY_NAME[name])).to(dtype)


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """``name, dtype -> model``: the tiny fp32 model saved and loaded back with
    ``from_pretrained(dtype=dtype)``, as users load checkpoints (inv_freq stays fp32)."""
    cache = {}

    def load(name: str, dtype: torch.dtype):
        if (name, dtype) not in cache:
            path = tmp_path_factory.mktemp(name)
            build(BY_NAME[name]).save_pretrained(path)
            cache[name, dtype] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return cache[name, dtype]

    return load


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_low_precision_models_pass_the_self_check(name, dtype, record_property):
    """Every RoPE variant, cast to bf16/fp16: the same rotary as in fp32 is found (pairing,
    width, scaling, limit), its check passes with errors a fp32-sized tolerance would refuse."""
    variant = BY_NAME[name]
    model = _low(name, dtype)
    rotary, check = rotary_from_model(model)
    assert check.dtype == dtype and check.passed
    assert rotary.interleaved is variant.interleaved and rotary.rotary_dim == variant.rotary_dim
    assert rotary.attention_scaling == pytest.approx(variant.attention_scaling, rel=1e-6)
    assert rotary.max_exact_length == variant.max_exact_length
    assert check.max_abs_error <= check.tolerance * max(1.0, check.key_scale)
    # the reason low-precision models were refused: their own rounding exceeds the fp32 tolerance
    assert check.max_abs_error > SELF_CHECK_TOLERANCE * max(1.0, check.key_scale)
    record_property("self_check", {"max_abs_error": check.max_abs_error, "key_scale": check.key_scale})


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", ["default", "cohere-interleaved", "phi-partial", "yarn", "longrope"])
def test_from_pretrained_low_precision_models_pass(name, dtype, reloaded):
    model = reloaded(name, dtype)
    assert model.dtype == dtype
    rotary, check = rotary_from_model(model)
    assert check.passed and check.dtype == dtype
    assert rotary.interleaved is BY_NAME[name].interleaved


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("name", ["default", "phi-partial", "yarn"])
def test_realignment_error_is_within_the_models_own_rounding_per_layer(name, dtype, reloaded):
    """Per layer, realigned low-precision keys differ from the model's own keys at the target by
    no more than the model's own rounding: how far its keys at each of the two positions are from
    its fp32 twin's (same checkpoint), plus the fp32 self-check tolerance and half an ulp of the
    cast. Nothing on the right-hand side depends on the rotary under test."""
    fp32, low = build(BY_NAME[name]), reloaded(name, dtype)
    rotary, _ = rotary_from_model(low)
    ids = torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(3))
    shift = 150
    k0, ks = hf_rotary._keys(low, ids, 0), hf_rotary._keys(low, ids, shift)
    f0, fs = hf_rotary._keys(fp32, ids, 0), hf_rotary._keys(fp32, ids, shift)
    per_layer = lambda t: t.abs().amax(dim=(1, 2, 3))  # noqa: E731
    shifted = rotary.shift(k0.float(), shift)
    error = per_layer(shifted.to(dtype).float() - ks.float())
    drift = per_layer(k0.float() - f0) + per_layer(ks.float() - fs)
    fp32_bound = SELF_CHECK_TOLERANCE * per_layer(fs).clamp(min=1.0)
    half_ulp = torch.finfo(dtype).eps / 2 * per_layer(shifted)
    assert bool((error <= drift + fp32_bound + half_ulp).all()), (error, drift, fp32_bound, half_ulp)
    assert bool((error > 0).any())
    assert torch.equal(rotary.shift(k0, shift), shifted.to(dtype))


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("change", ["theta", "freq", "pairing", "width"])
def test_self_check_fails_for_a_wrong_rotary_in_low_precision(dtype, change):
    """(A wrong attention scaling is no realignment error: a shift keeps it, and de-rotation
    divides out what rotation multiplies in.)"""
    name = "phi-partial" if change == "width" else "default"
    model = _low(name, dtype)
    right, good = rotary_from_model(model)
    if change == "theta":  # theta 1e5 instead of the model's 1e4
        wrong = Rotary(1.0 / 1e5 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM), 1.0, HEAD_DIM, False)
    elif change == "freq":
        wrong = Rotary(right.inv_freq * 1.05, right.attention_scaling, HEAD_DIM, right.interleaved)
    elif change == "pairing":
        wrong = Rotary(right.inv_freq, right.attention_scaling, HEAD_DIM, not right.interleaved)
    else:  # the pass-through channels of a partial rotary rotated too
        wrong = Rotary(torch.cat([right.inv_freq, right.inv_freq]), 1.0, HEAD_DIM, right.interleaved)
    bad = self_check(model, wrong)
    assert good.passed and not bad.passed
    assert bad.max_abs_error > 10 * bad.tolerance * max(1.0, bad.key_scale), (bad, good)


@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_rotary_from_model_refuses_a_wrong_frequency_model_in_low_precision(dtype, monkeypatch):
    model = _low("default", dtype)
    module = model.model.rotary_emb
    monkeypatch.setattr(module, "original_inv_freq", module.inv_freq.float() * 0.9, raising=False)
    with pytest.raises(RopeError, match=f"self-check failed.*{str(dtype).removeprefix('torch.')} keys"):
        rotary_from_model(model)


def test_dtype_names_and_bad_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert set(DTYPES) == {"float32", "bfloat16", "float16"}
    for bad in ("bf16", "float64", torch.float64, "int8"):
        with pytest.raises(ValueError, match="choose one of float32, bfloat16, float16"):
            parse_dtype(bad)


# ------------------------------------------------------------------ 3. the embedded model (slow)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_selfcheck_command_in_low_precision(dtype, capsys):
    from kvcomm.cli import main

    assert main(["selfcheck", "--dtype", dtype, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["dtype"] == dtype
    assert SELF_CHECK_TOLERANCE * result["key_scale"] < result["max_abs_error"] <= result["tolerance"]
    assert main(["selfcheck", "--dtype", dtype]) == 0
    assert f"passed for {result['model']} in {dtype}" in capsys.readouterr().out


def test_selfcheck_command_refuses_an_unknown_dtype(capsys):
    from kvcomm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["selfcheck", "--dtype", "float64"])
    assert exit_.value.code == 2
    assert "invalid choice: 'float64'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smol_by_dtype():
    from kvcomm.integrations.transformers.embedded import load_model_and_tokenizer
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = TransformersExecutor(*load_model_and_tokenizer(None, dtype))
        return cache[dtype]

    return get


class _Recording:
    """The executor, unchanged, noting the dtypes of the prefixes ``run_agent`` injects."""

    def __init__(self, executor):
        self._executor, self.prefix_dtypes = executor, set()

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def generate(self, token_ids, prefix, *args, **kwargs):
        if prefix is not None:
            self.prefix_dtypes.add((prefix.keys.dtype, prefix.values.dtype))
        return self._executor.generate(token_ids, prefix, *args, **kwargs)


def _reuse_kl(executor, config: ReuseConfig) -> dict:
    """The two-agent case (reader then asker on every row) with one engine: per asker call,
    KL(dense || reuse) on the positions the reuse call computed, against a dense prefill of the
    same prompt on the same executor; plus how much was reused and the KV dtypes seen."""
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(executor.rotary, config)
    executor = _Recording(executor)
    kls, tops, estimated, prompt_tokens, dtypes = [], [], 0, 0, set()
    for row in spec.inputs:
        run_agent(executor, engine, agent_prompt(executor, spec.agents[0], row), 8)
        asker = agent_prompt(executor, spec.agents[1], {"doc": row["doc"], "reader": "A short summary of the text."})
        reuse, provenance = run_agent(executor, engine, asker, 8, keep_logprobs=True)
        dense = executor.generate(asker.token_ids, None, 0, None, keep_logprobs=True).prompt_logprobs
        reference = topk_reference(dense, 20).tail(reuse.prompt_logprobs.shape[0])
        kls.append(kl_topk_other(reference, reuse.prompt_logprobs))
        tops.append(top1_matches(reference, reuse.prompt_logprobs))
        estimated += provenance.estimated_tokens
        prompt_tokens += provenance.prompt_tokens
        dtypes.add(reuse.computed.keys.dtype)
    kl = torch.cat(kls)
    dtypes |= {d for pair in executor.prefix_dtypes for d in pair}
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "same_top1": float(torch.cat(tops).double().mean()),
            "estimated_tokens": estimated, "prompt_tokens": prompt_tokens, "dtypes": dtypes}


@pytest.mark.slow
def test_bf16_reuse_through_run_agent_and_its_kl(smol_by_dtype, record_property):
    """Reuse on the embedded model in bf16 (realigned bases and anchor estimates, gamma 1) runs
    through ``run_agent``; its KL to dense bf16 is reported next to fp32's and stays within the
    same order: at most fp32's reuse KL plus a bf16-sized allowance. Bases and anchors
    (deviations) are held in the model dtype, so the injected prefix is bf16."""
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    bf16 = _reuse_kl(smol_by_dtype("bfloat16"), config)
    fp32 = _reuse_kl(smol_by_dtype("float32"), ReuseConfig(pool=PoolConfig(gamma=1.0)))
    record_property("bf16", {k: v for k, v in bf16.items() if k != "dtypes"})
    record_property("fp32", {k: v for k, v in fp32.items() if k != "dtypes"})
    print(f"\nbf16 reuse {bf16}\nfp32 reuse {fp32}")
    assert bf16["estimated_tokens"] > 0.15 * bf16["prompt_tokens"]
    assert bf16["dtypes"] == {torch.bfloat16} and fp32["dtypes"] == {torch.float32}
    assert math.isfinite(bf16["kl_mean"]) and bf16["kl_mean"] > 0
    assert bf16["kl_mean"] <= 3 * fp32["kl_mean"] + 0.05
    assert bf16["same_top1"] >= fp32["same_top1"] - 0.15


def test_bf16_executor_casts_a_prefix_in_another_dtype_once():
    """A prefix handed to a bf16 executor in fp32 is cast to bf16 on injection: the generation
    is the one the same prefix, cast by the caller, gives (tiny random Llama, SmolLM2's tokenizer)."""
    from transformers import AutoTokenizer

    from kvcomm.integrations.transformers.embedded import embedded_model_dir
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)}, eos_token_id=tokenizer.eos_token_id)
    executor = TransformersExecutor(transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16), tokenizer)
    assert executor.kv_dtype == torch.bfloat16 and executor.self_check.dtype == torch.bfloat16
    ids = executor.encode("The river Seine flows through Paris and into the English Channel.")
    head = executor.generate(ids[:10], None, 0, None)
    wide = head.computed.to(torch.float32)
    cast = executor.generate(ids, wide, 4, None, keep_logprobs=True)
    same = executor.generate(ids, head.computed, 4, None, keep_logprobs=True)
    assert cast.computed.keys.dtype == torch.bfloat16 and cast.reply_ids == same.reply_ids
    assert torch.equal(cast.prompt_logprobs, same.prompt_logprobs) and torch.equal(cast.computed.keys, same.computed.keys)


def _tiny_in(executor, dtype: torch.dtype):
    """``executor``'s tiny model, copied and cast to ``dtype``, with the same tokenizer."""
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    return TransformersExecutor(copy.deepcopy(executor.model).to(dtype), executor.tokenizer)


def test_dtype_noise_floor_of_the_eval_command(tiny_executor):
    """``kvcomm eval --noise-floor``'s measurement: the same (tiny) model against itself is
    exactly 0 KL and all top-1 equal; in bf16 against fp32 it is above 0, over every position of
    every dense prompt of the workload."""
    from kvcomm.eval.cli_eval import dtype_noise_floor, format_noise_floor
    from kvcomm.eval.workloads import load_workload

    workload = load_workload("retrieval", limit=2, n_agents=1, max_new_tokens=3)
    same = dtype_noise_floor(workload, tiny_executor, tiny_executor)
    assert same["kl_mean"] == same["kl_max"] == 0.0 and same["same_top1"] == 1.0
    assert same["prompts"] == 2 * 2
    floor = dtype_noise_floor(workload, tiny_executor, _tiny_in(tiny_executor, torch.bfloat16))
    assert floor["prompts"] == same["prompts"] and floor["positions"] == same["positions"] > 100
    assert 0 < floor["kl_median"] <= floor["kl_max"] and 0 < floor["kl_mean"] < 0.1
    assert 0.5 < floor["same_top1"] <= 1.0
    assert same["replies_equal"] == 4 and same["reply_agreement"] == 1.0  # greedy replies too: the reply eq floor
    assert 0 <= floor["replies_equal"] <= 4 and floor["reply_agreement"] == floor["replies_equal"] / 4
    line = format_noise_floor({**floor, "dtype": "bfloat16", "reference_dtype": "float32"})
    assert line.startswith("noise floor, dense bfloat16 vs dense float32 on the same 4 prompts")
    assert line.endswith(f"greedy replies equal {floor['replies_equal']}/4 (the floor of 'reply eq')")


@pytest.mark.slow
def test_run_command_in_bf16(capsys):
    from kvcomm.cli import main

    short = str(importlib.resources.files("kvcomm") / "data" / "demo_pipeline.json")
    assert main(["run", short, "--limit", "2", "--gamma", "1.0", "--base-source", "standalone",
                 "--dtype", "bfloat16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and report["summary"]["calls"] == 2 * 4
    assert report["summary"]["token_reuse_rate"] > 0
    first_row = [c for c in report["calls"] if c["input_index"] == 0]
    assert all(c["fallback"] and c["reply_equal"] for c in first_row)


def test_noise_floor_needs_another_dtype_and_the_transformers_backend(tiny_executor, tmp_path, capsys):
    import argparse

    from kvcomm.eval.cli_eval import add_eval_parser, run_eval_command

    parser = argparse.ArgumentParser(prog="kvcomm")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    base = ["eval", "--workload", "retrieval", "--limit", "1", "--agents", "1", "--out", str(tmp_path / "o"), "--no-progress"]
    assert run_eval_command(parser.parse_args(base + ["--noise-floor", "float32"]), executor=tiny_executor) == 2
    assert "--noise-floor float32 is the --dtype itself" in capsys.readouterr().err
    assert run_eval_command(parser.parse_args(base + ["--noise-floor", "bfloat16", "--backend", "vllm", "--no-kl",
                                                      "--modes", "kvcomm"]), executor=tiny_executor) == 2
    assert "transformers backend" in capsys.readouterr().err
