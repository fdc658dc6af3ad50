"""Reuse modes (exact, realign, cacheblend) and prompt log-probabilities for KL evaluations."""

from __future__ import annotations

import math

import pytest
import torch

from kvcomm.reuse.config import ReuseConfig

from kvcomm.reuse.engine import CHECK_LAYER, ReuseEngine
from kvcomm.core.kv import KV, positions
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.reuse.plan import BlendRequest
from kvcomm.core.rope import Rotary
from kvcomm.reuse.runner import run_agent, run_row
from kvcomm.reuse.scopes import SCOPES
from kvcomm.reuse.strategies import MODES
from kvcomm.core.segments import Prompt, Segment, content_id
from support.evidence import earn
from support.two_agent_case import PIPELINE as TWO_AGENT_PIPELINE, agent_prompt

PIPELINE = {**TWO_AGENT_PIPELINE, "max_new_tokens": 6}


def _prompt(executor, agent_index: int, fill: dict[str, str]) -> Prompt:
    return agent_prompt(executor, parse_pipeline(PIPELINE).agents[agent_index], fill)


def _reader(executor, row: int) -> Prompt:
    return _prompt(executor, 0, PIPELINE["inputs"][row])


def _asker(executor, row: int) -> Prompt:
    return _prompt(executor, 1, {"doc": PIPELINE["inputs"][row]["doc"], "reader": "A short summary of the text."})


def _dense(executor, prompt: Prompt, keep_logprobs: bool = False):
    return executor.generate(prompt.token_ids, None, 1, None, keep_logprobs=keep_logprobs)


def _adds_up(p) -> bool:
    return p.exact_tokens + p.estimated_tokens + p.computed_tokens == p.prompt_tokens


# -- configuration and accounting (no model) --------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "dense"}, "running without an engine"),
        ({"mode": "blend"}, "valid modes: kvcomm, exact, realign, cacheblend"),
        ({"recompute_ratio": 0.0}, "recompute_ratio must be in (0, 1]"),
        ({"recompute_ratio": 1.5}, "recompute_ratio must be in (0, 1]"),
        ({"recompute_ratio": -0.1}, "recompute_ratio must be in (0, 1]"),
        ({"recompute_ratio": float("nan")}, "recompute_ratio must be in (0, 1]"),
        ({"base_source": "prefill"}, "unknown base_source 'prefill'; valid: first_use, standalone"),
        ({"scope": "everything"}, "unknown reuse scope 'everything'; valid: all, all-reader-replies, content"),
        ({"prefix_store_bytes": -1}, "prefix_store_bytes must be an integer >= 0 (got -1)"),
        ({"workspace_bytes": -1}, "workspace_bytes must be an integer >= 0 (got -1)"),
        ({"workspace_bytes": 1.5}, "workspace_bytes must be an integer >= 0 (got 1.5)"),
    ],
)
def test_bad_config_is_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match="invalid reuse config") as error:
        ReuseConfig(**kwargs)
    assert message in str(error.value)


def test_valid_configs():
    assert ReuseConfig().mode == "kvcomm" and ReuseConfig().recompute_ratio == 0.15 and CHECK_LAYER == 1
    assert ReuseConfig().scope == "all-reader-replies"  # the rule's choice (docs/decisions.md, 2026-12-06)
    assert set(SCOPES) == {"all", "all-reader-replies", "content"}  # each picked by a measured workload
    for mode in MODES:
        ReuseConfig(mode=mode, recompute_ratio=1.0)
    for scope in SCOPES:
        ReuseConfig(scope=scope)


@pytest.mark.parametrize("n, ratio, count", [(20, 0.15, 3), (7, 0.15, 2), (1, 0.15, 1), (100, 0.15, 15), (9, 1.0, 9), (3, 0.5, 2)])
def test_blend_count_is_ceil_of_ratio(n, ratio, count):
    assert BlendRequest(5, 5 + n, ratio, 1).count == count


def test_a_blend_request_cut_with_the_plan_keeps_its_ratio_over_what_is_left():
    blend = BlendRequest(2, 9, 0.5, 1)
    assert blend.cut(6) == BlendRequest(2, 6, 0.5, 1) and blend.cut(6).count == 2
    assert blend.cut(12) == blend
    assert blend.cut(2) is None


def _synthetic(length: int, seed: int, layers: int = 2, heads: int = 2, dim: int = 8) -> KV:
    g = torch.Generator().manual_seed(seed)
    return KV(torch.randn(layers, heads, length, dim, generator=g), torch.randn(layers, heads, length, dim, generator=g))


def _synthetic_prompt(template: str, doc: tuple[int, ...]) -> Prompt:
    return Prompt(template, (Segment((1, 2, 3)), Segment(doc, slot="doc"), Segment((4, 5, 6, 7))))


def test_provenance_counts_recomputed_tokens_as_computed():
    rotary = Rotary(torch.tensor([1.0, 0.1]), head_dim=8)
    engine = ReuseEngine(rotary, ReuseConfig(mode="cacheblend", recompute_ratio=0.5))
    prompt = _synthetic_prompt("t", (10, 11, 12, 13))
    full = _synthetic(len(prompt), 0)
    plan = engine.plan(prompt, lambda s: _synthetic(len(s), 1))
    assert plan.reuse_end == 0 and plan.blend is None  # nothing stored yet for the template
    engine.learn(plan, full)
    other = _synthetic_prompt("t", (20, 21, 22, 23, 24))
    plan = engine.plan(other, lambda s: _synthetic(len(s), 2))
    assert plan.exact_length == 3 and plan.reuse_end == len(other) - 1
    assert plan.blend == BlendRequest(3, len(other) - 1, 0.5, 1)
    assert plan.blend.count == 4
    plan.recompute = (3, 4, 8, 10)  # two shared tokens, two fixed-segment tokens
    p = plan.provenance()
    assert (p.exact_tokens, p.estimated_tokens, p.computed_tokens, p.recomputed_tokens) == (3, 4, 5, 4)
    assert _adds_up(p) and p.reuse_end == len(other) - 1
    assert p.reused_shared_tokens == 5 - 2 and not p.fallback
    plan.recompute = (2,)
    with pytest.raises(ValueError, match="recomputed positions"):
        plan.provenance()


def test_realign_plan_is_realigned_base_without_anchors():
    """Synthetic KV: mode realign reuses the shared segment as its realigned base and the
    fixed segment after it as its realigned stored base, bit for bit, and records no anchor."""
    rotary = Rotary(torch.tensor([1.0, 0.1]), head_dim=8)
    engine = ReuseEngine(rotary, ReuseConfig(mode="realign"))
    first = _synthetic_prompt("t", (10, 11, 12, 13))
    engine.learn(engine.plan(first, lambda s: _synthetic(len(s), 1)), _synthetic(len(first), 0))
    second = _synthetic_prompt("t", (20, 21, 22, 23, 24))
    base = _synthetic(5, 2)
    plan = engine.plan(second, lambda s: base)
    kv = engine.materialize(plan)
    assert plan.reuse_end == len(second) - 1 and plan.learn == [] and not engine.pools
    assert all(piece.match is None for piece in plan.pieces)
    assert torch.equal(kv.keys[:, :, 3:8], rotary.rotate(base.keys, positions(3, 5)))
    assert torch.equal(kv.values[:, :, 3:8], base.values)
    fixed = engine._fixed_bases[("t", content_id((4, 5, 6, 7)))]
    assert torch.equal(kv.keys[:, :, 8:11], rotary.rotate(fixed.keys[:, :, :3], positions(8, 3)))
    assert plan.provenance().estimated_tokens == 8 and plan.provenance().computed_tokens == 1


def test_scope_content_ends_reuse_with_the_shared_segment():
    """Scope "content" (``compute_trailing_text``): the fixed text after the last shared segment
    is computed; what is served before it is bit for bit what scope "all" serves."""
    assert SCOPES["content"].compute_trailing_text and not SCOPES["all"].compute_trailing_text
    rotary = Rotary(torch.tensor([1.0, 0.1]), head_dim=8)
    scopes = {False: "all", True: "content"}
    engines = {on: ReuseEngine(rotary, ReuseConfig(mode="realign", scope=scopes[on])) for on in (False, True)}
    first = _synthetic_prompt("t", (10, 11, 12, 13))
    second = _synthetic_prompt("t", (20, 21, 22, 23, 24))
    base = _synthetic(5, 2)
    for engine in engines.values():
        engine.learn(engine.plan(first, lambda s: _synthetic(len(s), 1)), _synthetic(len(first), 0))
    served, cut = (engines[on].plan(second, lambda s: base) for on in (False, True))
    assert served.reuse_end == len(second) - 1  # the fixed text (4, 5, 6) is served realigned
    assert cut.reuse_end == 3 + 5 and _adds_up(cut.provenance()) and "template text" in cut.note
    assert cut.provenance().computed_tokens == 4
    full, short = engines[False].materialize(served), engines[True].materialize(cut)
    assert torch.equal(short.keys, full.keys[:, :, : cut.reuse_end])
    assert torch.equal(short.values, full.values[:, :, : cut.reuse_end])


def test_exact_mode_plans_no_estimate_and_needs_no_base():
    rotary = Rotary(torch.tensor([1.0, 0.1]), head_dim=8)
    engine = ReuseEngine(rotary, ReuseConfig(mode="exact"))
    first = _synthetic_prompt("t", (10, 11, 12, 13))
    engine.learn(engine.plan(first, None), _synthetic(len(first), 0))
    plan = engine.plan(_synthetic_prompt("t", (20, 21)), None)  # no base provider: none is asked
    assert plan.exact_length == 3 and plan.estimated_tokens == 0 and plan.pieces == [] and not engine.uses_bases
    assert engine.plan(first, None).exact_length == len(first) - 1


# -- modes on the tiny random Llama ------------------------------------------------------------


@pytest.mark.slow
def test_exact_mode_never_estimates(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(mode="exact"))
    provenance = [c.provenance for row in range(3) for c in run_row(spec, row, tiny_executor, engine)]
    assert all(p.estimated_tokens == 0 and p.recomputed_tokens == 0 and _adds_up(p) for p in provenance)
    assert any(p.exact_tokens > 0 for p in provenance)  # the template's first segment
    assert not engine.pools and not engine._bases  # no anchors, no base KV
    prompt = _reader(tiny_executor, 0)
    _, again = run_agent(tiny_executor, engine, prompt, 1)
    assert again.exact_tokens == len(prompt) - 1 and again.estimated_tokens == 0


@pytest.mark.slow
def test_realign_estimates_from_second_occurrence_without_anchors(tiny_executor):
    executor = tiny_executor
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="realign"))
    _, first = run_agent(executor, engine, _asker(executor, 0), 1)
    assert first.estimated_tokens == 0 and first.fallback  # the template's fixed segments have no base yet
    prompt = _asker(executor, 1)
    plan = engine.plan(prompt, executor.base_kv)
    kv = engine.materialize(plan)
    assert plan.reuse_end == len(prompt) - 1 and plan.estimated_tokens > 0
    assert not engine.pools and plan.learn == []
    for index, segment in enumerate(prompt.segments):
        start, end = prompt.starts[index], min(prompt.end(index), plan.reuse_end)
        if segment.is_shared:
            base = engine._bases[segment.shared_id][0].span(0, end - start)
            assert torch.equal(kv.keys[:, :, start:end], executor.rotary.rotate(base.keys, positions(start, end - start)))
            assert torch.equal(kv.values[:, :, start:end], base.values)
    # Layer 0 sees only the token and its position, so realignment is exact there.
    dense = _dense(executor, prompt).computed
    assert (kv.keys[0] - dense.keys[0, :, : kv.length]).abs().max() <= 1e-5
    assert (kv.values[0] - dense.values[0, :, : kv.length]).abs().max() <= 1e-5
    assert (kv.values[1] - dense.values[1, :, : kv.length]).abs().max() > 1e-3  # deeper layers are not
    generation = executor.generate(prompt.token_ids, kv, 1, None)
    engine.learn(plan, generation.computed)
    assert not engine.pools


@pytest.mark.slow
def test_cacheblend_full_ratio_reproduces_dense(tiny_executor):
    executor = tiny_executor
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="cacheblend", recompute_ratio=1.0))
    run_agent(executor, engine, _asker(executor, 0), 1)
    run_agent(executor, engine, _reader(executor, 1), 1)  # first_use: row 1's doc takes its base here
    prompt = _asker(executor, 1)
    generation, p = run_agent(executor, engine, prompt, 4, keep_logprobs=True)
    estimated = p.prompt_tokens - p.exact_tokens - 1
    assert p.recomputed_tokens == estimated > 0 and p.estimated_tokens == 0 and _adds_up(p)
    assert generation.recomputed == tuple(range(p.exact_tokens, p.reuse_end))
    dense = _dense(executor, prompt, keep_logprobs=True)
    end = p.reuse_end
    assert (generation.computed.keys - dense.computed.keys[:, :, end:]).abs().max() <= 1e-4
    assert (generation.computed.values - dense.computed.values[:, :, end:]).abs().max() <= 1e-4
    assert (generation.prompt_logprobs - dense.prompt_logprobs[end:]).abs().max() <= 1e-4
    assert generation.reply_ids == executor.generate(prompt.token_ids, None, 4, None).reply_ids


@pytest.mark.slow
def test_kvblend_plans_as_kvcomm_then_recomputes_and_full_ratio_is_dense(tiny_executor):
    """kvblend: kvcomm's decisions and anchor estimates (the same KV), plus a CacheBlend request
    over the estimated tokens; at recompute ratio 1 the computed KV and the reply are dense's."""
    executor = tiny_executor
    spec = parse_pipeline(PIPELINE)
    planned = {}
    for mode in ("kvcomm", "kvblend"):
        engine = ReuseEngine(executor.rotary, ReuseConfig(mode=mode, recompute_ratio=1.0))
        for row in range(2):  # the asker's calibration calls make its doc an anchor twice; nothing is estimated yet
            run_row(spec, row, executor, engine)
            run_agent(executor, engine, _asker(executor, row), 1, calibrate=True)
        earn(engine.pool("doc"), ("asker", "doc"))  # the slot's evidence given: the modes' mechanism, not the rule
        run_agent(executor, engine, _reader(executor, 2), 1)  # row 2's doc takes its base
        planned[mode] = (engine, engine.plan(_asker(executor, 2), executor.base_kv))
    (plain_engine, plain), (engine, blend) = planned["kvcomm"], planned["kvblend"]
    assert plain.blend is None and plain.estimated_tokens > 0 and any(p.match is not None for p in plain.pieces)
    assert [(p.start, p.base.length) for p in blend.pieces] == [(p.start, p.base.length) for p in plain.pieces]
    assert blend.blend == BlendRequest(blend.exact_length, blend.reuse_end, 1.0, 1)
    kv = engine.materialize(blend)
    assert torch.equal(kv.keys, plain_engine.materialize(plain).keys)
    prompt = _asker(executor, 2)
    generation = executor.generate(prompt.token_ids, kv, 4, None, blend=blend.blend)
    dense = executor.generate(prompt.token_ids, None, 4, None)
    end = blend.reuse_end
    assert len(generation.recomputed) == blend.estimated_tokens
    assert (generation.computed.keys - dense.computed.keys[:, :, end:]).abs().max() <= 1e-4
    assert (generation.computed.values - dense.computed.values[:, :, end:]).abs().max() <= 1e-4
    assert generation.reply_ids == dense.reply_ids


@pytest.mark.slow
def test_cacheblend_recomputes_top_deviating_share(tiny_executor):
    executor = tiny_executor
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="cacheblend", recompute_ratio=0.15))
    run_agent(executor, engine, _asker(executor, 0), 1)
    prompt = _asker(executor, 2)
    plan = engine.plan(prompt, executor.base_kv)
    kv = engine.materialize(plan)
    estimated = plan.estimated_tokens
    assert plan.blend is not None and plan.blend.count == math.ceil(0.15 * estimated) and plan.blend.check_layer == 1
    generation = executor.generate(prompt.token_ids, kv, 1, None, blend=plan.blend)
    plan.recompute = generation.recomputed
    p = plan.provenance()
    assert p.recomputed_tokens == len(set(generation.recomputed)) == math.ceil(0.15 * estimated)
    assert p.estimated_tokens == estimated - p.recomputed_tokens and _adds_up(p)
    assert list(generation.recomputed) == sorted(generation.recomputed)
    # The selection: largest L2 distance of the injected keys at the check layer from the real (dense) ones.
    dense = _dense(executor, prompt).computed
    start, end = plan.exact_length, plan.reuse_end
    deviation = (dense.keys[1, :, start:end] - kv.keys[1, :, start:end]).pow(2).sum(dim=(0, 2))
    expected = sorted(int(i) + start for i in torch.topk(deviation, p.recomputed_tokens).indices)
    assert list(generation.recomputed) == expected
    engine.learn(plan, generation.computed)
    assert not engine.pools


@pytest.mark.slow
def test_blend_recompute_over_exact_kv_changes_nothing(tiny_executor):
    """Recomputing any subset of an exact prefix (each token seeing the unselected tokens
    before it and the selected ones up to it) must give back the dense KV and logits: a
    wrong mask, position or write-back would not."""
    executor = tiny_executor
    prompt = _asker(executor, 3)
    dense = _dense(executor, prompt, keep_logprobs=True)
    n = len(prompt)
    end = n - 5
    prefix = dense.computed.span(0, end)
    for ratio in (0.3, 0.7):
        generation = executor.generate(prompt.token_ids, prefix, 1, None, keep_logprobs=True, blend=BlendRequest(4, end, ratio, 0))
        assert len(generation.recomputed) == BlendRequest(4, end, ratio, 0).count
        assert (generation.computed.keys - dense.computed.keys[:, :, end:]).abs().max() <= 1e-4
        assert (generation.computed.values - dense.computed.values[:, :, end:]).abs().max() <= 1e-4
        assert (generation.prompt_logprobs - dense.prompt_logprobs[end:]).abs().max() <= 1e-4
    assert torch.equal(prefix.keys, dense.computed.keys[:, :, :end])  # the injected KV itself is not modified


@pytest.mark.slow
def test_blend_check_layer_out_of_range(tiny_executor):
    prompt = _reader(tiny_executor, 0)
    prefix = _dense(tiny_executor, prompt).computed.span(0, 10)
    with pytest.raises(ValueError, match="check_layer 2 is out of range for a 2-layer model"):
        tiny_executor.generate(prompt.token_ids, prefix, 1, None, blend=BlendRequest(0, 10, 0.5, 2))
    with pytest.raises(ValueError, match="not inside"):
        tiny_executor.generate(prompt.token_ids, prefix, 1, None, blend=BlendRequest(0, 11, 0.5, 0))


@pytest.mark.slow
def test_keep_logprobs(tiny_executor):
    executor = tiny_executor
    prompt = _reader(executor, 0)
    n = len(prompt)
    dense = _dense(executor, prompt, keep_logprobs=True)
    vocab = executor.model.config.vocab_size
    assert dense.prompt_logprobs.shape == (n, vocab) and dense.prompt_logprobs.dtype == torch.float32
    with torch.no_grad():
        logits = executor.model(input_ids=torch.tensor([prompt.token_ids])).logits[0]
    assert (dense.prompt_logprobs - torch.log_softmax(logits.float(), dim=-1)).abs().max() <= 1e-4
    assert _dense(executor, prompt).prompt_logprobs is None
    partial = executor.generate(prompt.token_ids, dense.computed.span(0, 20), 1, None, keep_logprobs=True)
    assert partial.prompt_logprobs.shape == (n - 20, vocab)
    assert (partial.prompt_logprobs - dense.prompt_logprobs[20:]).abs().max() <= 1e-4
    assert partial.reply_ids == dense.reply_ids

    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="realign"))
    assert all(c.prompt_logprobs is None for c in run_row(spec, 0, executor, engine))
    run_row(spec, 1, executor, engine)  # first_use: row 1's new content takes its bases here
    for call in run_row(spec, 1, executor, engine, keep_logprobs=True):
        p = call.provenance
        assert call.prompt_logprobs.shape == (len(call.prompt_ids) - p.reuse_end, vocab)
        assert p.reuse_end == len(call.prompt_ids) - 1
    for call in run_row(spec, 1, executor, None, keep_logprobs=True):
        assert call.prompt_logprobs.shape == (len(call.prompt_ids), vocab)


# -- SmolLM2 ------------------------------------------------------------------------------------


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference || other) over positions, from log-probabilities."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


@pytest.mark.slow
def test_cacheblend_is_closer_to_dense_than_realign_on_smollm2(smol_executor):
    """With real weights, recomputing the most deviating tokens moves the next-token
    distributions of the computed tail toward dense prefill's (measured: KL 0.106 realign,
    0.051 at ratio 0.15, 0.023 at 0.3, 0 at 1.0). The injected prefix is cut after the last
    shared segment so that the KL averages over the ~11 tokens of the fixed tail."""
    executor = smol_executor
    doc = (
        "The committee met on Tuesday to review the budget. Spending on roads rose by a fifth, "
        "while the library fund was cut. Two members objected and asked for a second vote next month."
    )
    other = "A small bakery in the old town sells bread, cakes and coffee from six in the morning."
    fill = lambda d: {"doc": d, "reader": "The committee changed the budget and some members objected."}  # noqa: E731
    engine = ReuseEngine(executor.rotary, ReuseConfig(mode="realign"))
    run_agent(executor, engine, _prompt(executor, 1, fill(other)), 1)
    prompt = _prompt(executor, 1, fill(doc))
    plan = engine.plan(prompt, executor.base_kv)
    assert plan.reuse_end == len(prompt) - 1 and not engine.pools
    end = prompt.end(max(i for i, s in enumerate(prompt.segments) if s.is_shared))
    kv = engine.materialize(plan).span(0, end)
    dense = _dense(executor, prompt, keep_logprobs=True).prompt_logprobs[end:]
    kls = {}
    for ratio in (None, 0.15, 0.3, 1.0):
        blend = None if ratio is None else BlendRequest(plan.exact_length, end, ratio, 1)
        generation = executor.generate(prompt.token_ids, kv, 1, None, keep_logprobs=True, blend=blend)
        kls[ratio] = _kl(dense, generation.prompt_logprobs)
    assert kls[0.3] < kls[0.15] < kls[None], kls
    assert abs(kls[1.0]) <= 1e-4, kls


@pytest.mark.slow
def test_kvcomm_with_scope_content_serves_no_template_text_after_shared_content(tiny_executor):
    """Estimates go on (with their following segments between shared segments), but a served
    prefix always ends with a shared segment's token."""
    spec = parse_pipeline(PIPELINE)
    engine = ReuseEngine(tiny_executor.rotary, ReuseConfig(scope="content"))
    plans = []
    plan = engine.plan
    engine.plan = lambda *args: plans.append(plan(*args)) or plans[-1]
    for row in range(4):
        run_row(spec, row, tiny_executor, engine)
    estimated = [p for p in plans if p.estimated_tokens > 0]
    assert estimated
    for p in estimated:
        last = p.pieces[-1]
        assert p.prompt.segments[last.segment_index].is_shared and last.following_base is None
        assert p.reuse_end == last.start + last.base.length
