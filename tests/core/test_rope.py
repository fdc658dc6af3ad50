"""Tests for kvcomm.core.rope and kvcomm.integrations.transformers.rotary.

1. Every RoPE variant transformers implements (default, linear, dynamic NTK, llama3, yarn,
   longrope, partial rotary, interleaved pairing): keys realigned with the extracted ``Rotary``
   equal the keys a tiny random model computes itself at the target position.
2. Pure-math properties of ``Rotary`` (hypothesis): inverse, composition, norm, pass-through,
   and agreement with an independent fp64 per-pair reference.
3. Refusals: no RoPE, hybrid / sliding-window layers, lengths past dynamic frequencies,
   invalid construction.
4. The self-check catches a wrong ``Rotary``.

Everything runs on tiny fp32 CPU models built from configs (hidden 64, 2 layers, 4 heads,
2 KV heads, vocab 128), so the whole file takes a few seconds.
"""
from __future__ import annotations

import math
import types
from dataclasses import replace
from functools import lru_cache

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.integrations.transformers import rotary as hf_rotary
from kvcomm.integrations.transformers.rotary import SELF_CHECK_TOLERANCE, rotary_from_model, self_check
from kvcomm.core.rope import RopeError, Rotary

from support.rope_variants import BY_NAME, HEAD_DIM, THETA, TINY, VARIANTS, Variant, _rope, build  # noqa: F401 (test_dtypes imports them from here)

TOKENS = 12
LAYER0_TOLERANCE = 1e-5
ALL_LAYERS_TOLERANCE = 1e-4  # deeper layers add attention/MLP rounding on top; same bound as the self-check
# (p1, p2): keys computed at [p1, p1 + TOKENS) are realigned to [p2, p2 + TOKENS). Large, negative and
# offset shifts; every position stays below the smallest max_exact_length used here (longrope: 256).
SHIFTS = [(0, 1), (0, 37), (0, 150), (5, 155), (150, 3), (20, 170), (170, 0)]



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: a second intra-op thread only adds sync cost, and on a busy machine spinning
    OpenMP threads make each one milliseconds slower. Restored for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@lru_cache(maxsize=None)
def extracted(variant: Variant):
    return rotary_from_model(build(variant))


def token_ids(n: int = TOKENS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def run_keys(model, ids: torch.Tensor, start: int, hook_raw: bool = False):
    """Cached keys of ``ids`` at ``[start, start + T)`` per layer (``[kv_heads, T, head_dim]``), and
    layer 0's pre-RoPE keys from its ``k_proj`` if asked."""
    raw = {}
    handle = None
    if hook_raw:
        attn = _layer0_attention(model)

        def grab(_, __, out):
            raw["k"] = out.view(1, ids.shape[0], -1, HEAD_DIM).transpose(1, 2)[0]

        handle = attn.k_proj.register_forward_hook(grab)
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None], position_ids=torch.arange(start, start + ids.shape[0])[None],
                        use_cache=True)
    finally:
        if handle is not None:
            handle.remove()
    keys = [layer.keys[0] for layer in out.past_key_values.layers]
    assert all(k.dtype == torch.float32 for k in keys)
    return keys, raw.get("k")


def _layer0_attention(model):
    return model.model.layers[0].self_attn


# ------------------------------------------------------------------- 1. realignment on real models


@pytest.mark.parametrize("name", [v.name for v in VARIANTS])
def test_realigned_keys_equal_model_keys(name, record_property):
    variant = BY_NAME[name]
    model = build(variant)
    rotary, check = extracted(variant)

    # What was extracted: pairing, width, scaling, frequency limit, and a passing self-check.
    assert rotary.interleaved is variant.interleaved
    assert rotary.head_dim == HEAD_DIM
    assert rotary.rotary_dim == variant.rotary_dim
    assert rotary.attention_scaling == pytest.approx(variant.attention_scaling, rel=1e-6)
    assert rotary.max_exact_length == variant.max_exact_length
    assert check.passed and check.max_abs_error <= LAYER0_TOLERANCE

    ids = token_ids()
    starts = sorted({p for pair in SHIFTS for p in pair})
    assert max(starts) + TOKENS <= (variant.max_exact_length or math.inf)
    keys = {start: run_keys(model, ids, start) for start in starts}
    layer0 = {"shift": 0.0, "unrotate-rotate": 0.0}
    every = {"shift": 0.0, "unrotate-rotate": 0.0}
    for p1, p2 in SHIFTS:
        pos1, pos2 = torch.arange(p1, p1 + TOKENS), torch.arange(p2, p2 + TOKENS)
        for layer, (k1, k2) in enumerate(zip(keys[p1][0], keys[p2][0])):
            for path, realigned in (("shift", rotary.shift(k1, p2 - p1)),
                                    ("unrotate-rotate", rotary.rotate(rotary.unrotate(k1, pos1), pos2))):
                assert realigned.shape == k2.shape and realigned.dtype == k2.dtype
                error = float((realigned - k2).abs().max())
                every[path] = max(every[path], error)
                if layer == 0:
                    layer0[path] = max(layer0[path], error)
                    assert error <= LAYER0_TOLERANCE, (name, path, p1, p2, error)
                assert error <= ALL_LAYERS_TOLERANCE, (name, path, layer, p1, p2, error)
        # the realignment is not trivially satisfied: keys really differ between the two positions
        assert float((keys[p1][0][0] - keys[p2][0][0]).abs().max()) > 1e-2
    if rotary.rotary_dim < rotary.head_dim:
        # pass-through channels of layer 0 do not depend on position at all
        rest = [keys[s][0][0][..., rotary.rotary_dim:] for s in starts]
        assert all(torch.equal(rest[0], r) for r in rest[1:])
    record_property("max_abs_error", {"layer0": layer0, "all_layers": every})
    print(f"\n{name}: layer0 {layer0} all layers {every} self-check {check.max_abs_error:.2e}")


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.config != "GPTNeoXConfig"])
def test_unrotate_recovers_pre_rope_keys_with_attention_scaling(name):
    """Position-free keys equal ``k_proj`` output: the scaling yarn/longrope multiply in is divided out."""
    variant = BY_NAME[name]
    model = build(variant)
    rotary, _ = extracted(variant)
    ids = token_ids(seed=2)
    for start in (0, 37, 150):
        keys, raw = run_keys(model, ids, start, hook_raw=True)
        free = rotary.unrotate(keys[0], torch.arange(start, start + TOKENS))
        assert float((free - raw).abs().max()) <= LAYER0_TOLERANCE
        if start == 0:  # R(0) is the identity: the cache holds s * k for the first token
            torch.testing.assert_close(keys[0][:, :1], raw[:, :1] * rotary.attention_scaling, rtol=0,
                                       atol=LAYER0_TOLERANCE)
    if variant.attention_scaling != 1.0:
        assert rotary.attention_scaling > 1.0 + 1e-2
        # ignoring the scaling leaves position-free keys off by the factor s
        unscaled = replace(rotary, attention_scaling=1.0)
        free = unscaled.unrotate(keys[0], torch.arange(150, 150 + TOKENS))
        assert float((free - raw).abs().max()) > 100 * LAYER0_TOLERANCE
        torch.testing.assert_close(free, raw * rotary.attention_scaling, rtol=0, atol=LAYER0_TOLERANCE)


def test_detected_pairing_and_partial_width():
    assert extracted(BY_NAME["cohere-interleaved"])[0].interleaved is True
    assert extracted(BY_NAME["default"])[0].interleaved is False
    for name in ("phi-partial", "neox-partial"):
        rotary = extracted(BY_NAME[name])[0]
        assert rotary.rotary_dim < rotary.head_dim == HEAD_DIM
    # the model's own frequencies, not recomputed ones
    module = build(BY_NAME["llama3"]).model.rotary_emb
    assert torch.equal(extracted(BY_NAME["llama3"])[0].inv_freq, module.inv_freq.float())


def test_dynamic_limit_holds_after_frequencies_grew():
    """transformers keeps grown dynamic-NTK frequencies for a sequence of exactly max_position_embeddings
    tokens after a longer one; max_exact_length must stop one short of it."""
    variant = replace(BY_NAME["dynamic"], name="dynamic-64",
                      kwargs=(("rope_parameters", _rope("dynamic", factor=2.0)), ("max_position_embeddings", 64)))
    model = build(variant)
    rotary, _ = extracted(variant)
    assert rotary.max_exact_length == 63
    rotary.check_length(63)
    with pytest.raises(RopeError):
        rotary.check_length(64)
    ids = token_ids(8)

    def error_after_growth(length):
        run_keys(model, token_ids(100, seed=3), 0)  # grows the model's frequencies
        start = length - ids.shape[0]
        at_start = run_keys(model, ids, start)[0][0]  # before anything resets them
        at_zero = run_keys(model, ids, 0)[0][0]
        return float((rotary.shift(at_zero, start) - at_start).abs().max())

    assert error_after_growth(63) <= LAYER0_TOLERANCE
    assert error_after_growth(64) > 1e-2  # what a limit of 64 would have let through


def test_longrope_keys_change_past_limit():
    """Past original_max_position_embeddings longrope switches to long factors: realignment is wrong there,
    which is why check_length refuses it."""
    variant = BY_NAME["longrope"]
    model = build(variant)
    rotary, _ = extracted(variant)
    ids = token_ids()
    at_zero = run_keys(model, ids, 0)[0][0]
    start = rotary.max_exact_length - TOKENS + 1  # last position = limit: sequence of limit + 1 tokens
    at_start = run_keys(model, ids, start)[0][0]
    assert float((rotary.shift(at_zero, start) - at_start).abs().max()) > 1e-2
    with pytest.raises(RopeError, match="exceeds 256"):
        rotary.check_length(start + TOKENS)


# ------------------------------------------------------------------------- 2. pure-math properties

# Tolerances. Rotary computes angles theta = fl32(p * f) and cos/sin in fp32, then applies them in the
# input dtype. Against exact math a rotation is then off by at most
#   |d theta| <= ulp(theta)/2 <= 2^-24 * theta   (angle rounding)   plus ~3e-7 (cos/sin, x s, / s rounding),
# and a pair rotated by an angle off by d moves by <= |d| * |pair|. Identities that compose *different*
# angles (p + q vs p then q) accumulate up to three such roundings; identities that reuse the same angles
# (unrotate . rotate) only see the cos^2 + sin^2 = 1 +- few ulp rounding. ANGLE_ULP and BASE carry a 2x
# margin; fp32 inputs add a few ulp of the output (covered by BASE).
ANGLE_ULP = 2 * 2.0**-24
BASE = 2e-6


def _tol(x: torch.Tensor, rotary: Rotary, max_angle: float, roundings: int) -> float:
    pair = float(x.abs().max()) * math.sqrt(2) * max(rotary.attention_scaling, 1 / rotary.attention_scaling)
    return pair * (roundings * ANGLE_ULP * max_angle + BASE)


@st.composite
def rotaries(draw):
    half = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["random", "geometric"]))
    if kind == "random":
        freqs = draw(st.lists(st.floats(0.0, 1.0, allow_nan=False, width=32), min_size=half, max_size=half))
        inv_freq = torch.tensor(freqs)
    else:
        theta = draw(st.floats(100.0, 1e6))
        inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    extra = draw(st.integers(0, 5))  # partial rotary: head_dim > rotary_dim (odd widths too)
    scaling = draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0)))
    return Rotary(inv_freq, scaling, 2 * half + extra, draw(st.booleans()))


@st.composite
def cases(draw, n_positions=1):
    rotary = draw(rotaries())
    tokens = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = torch.randn(2, tokens, rotary.head_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    positions = [torch.tensor(draw(st.lists(st.integers(0, 4096), min_size=tokens, max_size=tokens)))
                 for _ in range(n_positions)]
    return rotary, x.to(dtype), positions


def max_angle(rotary: Rotary, *positions) -> float:
    return float(max(p.abs().max() for p in positions)) * float(rotary.inv_freq.max())


def pairs(rotary: Rotary, x: torch.Tensor):
    """``(first, second)`` channels of each rotated pair, independent of Rotary's own code."""
    half = rotary.rotary_dim // 2
    if rotary.interleaved:
        return x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    return x[..., :half], x[..., half:2 * half]


def reference_rotate(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Explicit per-pair 2x2 rotations in fp64, times the scaling."""
    x = x.double()
    a, b = pairs(rotary, x)
    angle = positions.double()[:, None] * rotary.inv_freq.double()
    cos, sin = angle.cos(), angle.sin()
    ra, rb = (a * cos - b * sin) * rotary.attention_scaling, (b * cos + a * sin) * rotary.attention_scaling
    out = x.clone()
    if rotary.interleaved:
        out[..., 0:rotary.rotary_dim:2], out[..., 1:rotary.rotary_dim:2] = ra, rb
    else:
        half = rotary.rotary_dim // 2
        out[..., :half], out[..., half:rotary.rotary_dim] = ra, rb
    return out


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(actual, expected, tol):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= tol, (error, tol)


@PROPERTY
@given(cases())
def test_rotate_matches_reference(case):
    rotary, x, (p,) = case
    close(rotary.rotate(x, p).double(), reference_rotate(rotary, x, p), _tol(x, rotary, max_angle(rotary, p), 1))


@PROPERTY
@given(cases())
def test_unrotate_inverts_rotate(case):
    rotary, x, (p,) = case
    # same angles both ways: only cos/sin/scaling rounding, no angle error
    close(rotary.unrotate(rotary.rotate(x, p), p), x, _tol(x, rotary, 0.0, 0))
    close(rotary.rotate(rotary.unrotate(x, p), p), x, _tol(x, rotary, 0.0, 0))


@PROPERTY
@given(cases(n_positions=2))
def test_rotations_compose(case):
    rotary, x, (p, q) = case
    q = q[0]  # one shift for all tokens (shift takes a scalar)
    expected = rotary.rotate(x, p + q)
    close(rotary.shift(rotary.rotate(x, p), int(q)), expected, _tol(x, rotary, max_angle(rotary, p + q), 3))
    # and a shift is exactly a rotate of the position-free keys at the new positions
    close(rotary.shift(rotary.rotate(x, p), int(q)), rotary.rotate(rotary.unrotate(rotary.rotate(x, p), p), p + q),
          _tol(x, rotary, max_angle(rotary, p + q), 3))


@PROPERTY
@given(cases(), st.integers(-4096, 4096), st.integers(-4096, 4096))
def test_shifts_add(case, a, b):
    rotary, x, _ = case
    angle = max(abs(a), abs(b), abs(a + b)) * float(rotary.inv_freq.max())
    close(rotary.shift(rotary.shift(x, a), b), rotary.shift(x, a + b), _tol(x, rotary, angle, 3))
    close(rotary.shift(rotary.shift(x, a), -a), x, _tol(x, rotary, angle, 2))
    # a tensor delta is the same as an int one
    assert torch.equal(rotary.shift(x, torch.tensor(a)), rotary.shift(x, a))


@PROPERTY
@given(cases())
def test_shift_by_zero_is_identity(case):
    rotary, x, _ = case
    # cos 0 = 1 and sin 0 = 0 exactly; only s / s may round by an ulp of fp32
    close(rotary.shift(x, 0), x, float(x.abs().max()) * 2**-22)


@PROPERTY
@given(cases())
def test_rotation_scales_pair_norms_and_keeps_other_channels(case):
    rotary, x, (p,) = case
    s, rd = rotary.attention_scaling, rotary.rotary_dim
    rotated, free, shifted = rotary.rotate(x, p), rotary.unrotate(x, p), rotary.shift(x, 17)
    norm = lambda t: torch.hypot(*pairs(rotary, t.double()))  # noqa: E731
    tol = 2e-6 * max(s, 1 / s) * float(x.abs().max())
    close(norm(rotated), norm(x) * s, tol)
    close(norm(free), norm(x) / s, tol)
    close(norm(shifted), norm(x), tol)
    close(rotated[..., :rd].double().norm(dim=-1), x[..., :rd].double().norm(dim=-1) * s, 4 * tol)
    for out in (rotated, free, shifted):
        assert out.dtype == x.dtype and out.shape == x.shape
        assert torch.equal(out[..., rd:], x[..., rd:])  # untouched, bit for bit


def test_zero_frequency_pairs_are_untouched():
    rotary = Rotary(torch.tensor([0.5, 0.0]), 1.0, 4)
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = rotary.rotate(x, torch.tensor([0, 100, 4096]))
    assert torch.equal(out[..., 1], x[..., 1]) and torch.equal(out[..., 3], x[..., 3])


def test_batched_positions_and_devices_of_inputs():
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), 1.2, 10, True)
    x = torch.randn(2, 3, 5, 10, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)
    per_batch = torch.stack([rotary.rotate(x[i], positions) for i in range(2)])
    # same arithmetic per element; allow an ulp in case a vectorized path fuses multiply-adds differently
    torch.testing.assert_close(rotary.rotate(x, positions), per_batch, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.rotate(x, positions.to(torch.int32)), per_batch, rtol=0, atol=1e-6)


def test_rotate_into_preallocated_buffer():
    """``rotate(..., out=)`` writes into a given buffer, also a strided view of a larger cache."""
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), 1.3, 11, False)
    x = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 106)
    expected = rotary.rotate(x, positions)
    cache = torch.full((2, 10, 11), float("nan"))
    view = cache[:, 3:9]
    result = rotary.rotate(x, positions, out=view)
    assert result.data_ptr() == view.data_ptr()
    assert torch.equal(cache[:, 3:9], expected)
    assert cache[:, :3].isnan().all() and cache[:, 9:].isnan().all()  # nothing written outside the view
    buffer = torch.empty_like(x)
    assert rotary.rotate(x, positions, out=buffer) is buffer and torch.equal(buffer, expected)


# --------------------------------------------------------------------------------------- 3. refusals


def test_model_without_rope_is_refused():
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128)
    with pytest.raises(RopeError, match="rotary"):
        rotary_from_model(transformers.GPT2LMHeadModel(config))


@pytest.fixture
def no_model_runs(monkeypatch):
    """Fail if anything tries to run the model (refusals must come first)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("model was run before the refusal")

    monkeypatch.setattr(hf_rotary, "self_check", forbidden)
    monkeypatch.setattr(hf_rotary, "_keys", forbidden)


def _stub(config):
    """Something with a config and nothing else: the layer-type refusal must not need more."""
    return types.SimpleNamespace(config=config)


def test_hybrid_linear_attention_is_refused(no_model_runs):
    config = transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)
    assert "linear_attention" in config.layer_types and "full_attention" in config.layer_types
    with pytest.raises(RopeError, match="linear_attention"):
        rotary_from_model(_stub(config))
    # the real (tiny) model too: it has a rotary module, the layer types still refuse it
    torch.manual_seed(0)
    with pytest.raises(RopeError, match="hybrid linear-attention"):
        rotary_from_model(transformers.Qwen3NextForCausalLM(config))


@pytest.mark.parametrize("model", [
    lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**TINY, "head_dim": HEAD_DIM})),  # sliding/full layer_types
    lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=16)),  # no layer_types, sliding_window
    lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**{k: v for k, v in TINY.items() if k != "max_position_embeddings"})),
    lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
], ids=["gemma2", "mistral-window16", "mistral-default-window", "qwen3-sliding"])
def test_sliding_window_is_refused(model, no_model_runs):
    """Real tiny models (random weights) of each architecture, refused before anything runs."""
    torch.manual_seed(0)
    built = model().eval()
    assert hf_rotary._rotary_module(built) is not None  # they do have RoPE: the layer types refuse them
    with pytest.raises(RopeError, match="sliding_attention"):
        rotary_from_model(built)


def test_full_attention_configs_pass_the_layer_check():
    hf_rotary._check_layer_types(transformers.MistralConfig(**TINY, sliding_window=None))
    hf_rotary._check_layer_types(transformers.Qwen3Config(**TINY))
    hf_rotary._check_layer_types(transformers.LlamaConfig(**TINY))
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None)).eval()
    rotary, check = rotary_from_model(model)
    assert check.passed and not rotary.interleaved


def test_sliding_window_cache_really_drops_keys():
    """Why sliding windows are refused: the cache holds fewer keys than tokens, yet the self-check alone
    (both runs equally truncated) would pass."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=16)).eval()
    keys, _ = run_keys(model, token_ids(40), 0)
    assert keys[0].shape[-2] < 40
    module = hf_rotary._rotary_module(model)
    assert self_check(model, hf_rotary._candidate(module, HEAD_DIM, False), tokens=24).passed


@pytest.mark.parametrize("name, limit", [("dynamic", 511), ("longrope", 256)])
def test_check_length_refuses_beyond_exact_length(name, limit):
    rotary = extracted(BY_NAME[name])[0]
    assert rotary.max_exact_length == limit
    rotary.check_length(1)
    rotary.check_length(limit)
    with pytest.raises(RopeError, match=f"{limit + 1} tokens exceeds {limit}"):
        rotary.check_length(limit + 1)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "cohere-interleaved"])
def test_static_variants_have_no_length_limit(name):
    rotary = extracted(BY_NAME[name])[0]
    assert rotary.max_exact_length is None
    rotary.check_length(10**7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(inv_freq=torch.tensor([])), "non-empty"),
    (dict(inv_freq=torch.ones(2, 2)), "1-D"),
    (dict(inv_freq=torch.tensor(1.0)), "1-D"),
    (dict(inv_freq=torch.ones(4), head_dim=6), "exceeds head_dim"),
    (dict(inv_freq=torch.ones(4), head_dim=-1), "exceeds head_dim"),
    (dict(inv_freq=torch.ones(4), attention_scaling=0.0), "positive"),
    (dict(inv_freq=torch.ones(4), attention_scaling=-1.0), "positive"),
    (dict(inv_freq=torch.ones(4), attention_scaling=float("nan")), "positive"),
])
def test_invalid_rotary_is_refused(kwargs, message):
    with pytest.raises(RopeError, match=message):
        Rotary(**kwargs)


def test_rotary_defaults_and_wrong_width():
    rotary = Rotary(torch.ones(4, dtype=torch.float64))
    assert rotary.head_dim == rotary.rotary_dim == 8 and rotary.inv_freq.dtype == torch.float32
    with pytest.raises(RopeError, match="head_dim 8"):
        rotary.rotate(torch.zeros(3, 9), torch.arange(3))
    assert issubclass(RopeError, ValueError)


# ------------------------------------------------------------------------------------ 4. self-check


@pytest.mark.parametrize("name, change", [
    ("default", "freq"), ("default", "pairing"), ("cohere-interleaved", "pairing"), ("phi-partial", "width"),
])
def test_self_check_catches_a_wrong_rotary(name, change):
    model = build(BY_NAME[name])
    right, _ = extracted(BY_NAME[name])
    if change == "freq":
        wrong = replace(right, inv_freq=right.inv_freq * 1.05)
    elif change == "pairing":
        wrong = replace(right, interleaved=not right.interleaved)
    else:  # rotate the pass-through channels too
        wrong = Rotary(torch.cat([right.inv_freq, right.inv_freq]), 1.0, HEAD_DIM, right.interleaved)
    good, bad = self_check(model, right), self_check(model, wrong)
    assert good.passed and good.max_abs_error <= LAYER0_TOLERANCE
    assert not bad.passed
    assert bad.max_abs_error > 100 * SELF_CHECK_TOLERANCE * max(1.0, bad.key_scale)
    assert bad.layer0_abs_error > 100 * SELF_CHECK_TOLERANCE


def test_rotary_from_model_refuses_when_no_pairing_passes(monkeypatch):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    module = model.model.rotary_emb
    # the frequencies read from the module no longer match what the model uses
    monkeypatch.setattr(module, "original_inv_freq", module.inv_freq * 0.9, raising=False)
    with pytest.raises(RopeError, match="self-check failed"):
        rotary_from_model(model)
