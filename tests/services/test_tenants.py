"""Tenant isolation, per-tenant and total byte caps, and a cross-tenant timing probe."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from scipy.stats import binomtest

from kvcomm.anchors.config import PoolConfig
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.pipeline import parse_pipeline
from kvcomm.core.rope import Rotary
from kvcomm.reuse.runner import run_agent, run_row
from kvcomm.services.tenants import TenantRegistry, adapter_key, owner_of, tenant_label
from support.one_thread import one_thread  # noqa: F401 (autouse fixture)
from support.two_agent_case import PIPELINE, agent_prompt

WORDS = "river mountain city forest ocean desert island valley bridge castle garden market".split()


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "."


def _in_threads(work, n: int) -> tuple[dict[int, object], list[str]]:
    """Run ``work(t)`` for t in range(n) on n threads at once: (results by t, errors as text;
    collected, since an exception in a thread would not fail the test)."""
    results, errors = {}, []

    def worker(t: int) -> None:
        try:
            results[t] = work(t)
        except Exception as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def _load(registry: TenantRegistry, executor, tenants: int, calls: int, seed: int = 0, check=None):
    """Each tenant runs ``calls`` two-agent rows on random documents; ``check`` after each call."""
    spec = parse_pipeline(PIPELINE)
    rng = random.Random(seed)
    for _ in range(calls):
        for t in range(tenants):
            engine = registry.engine(f"tenant-{t}")
            for agent in spec.agents:
                prompt = agent_prompt(executor, agent, {"doc": _doc(rng), "reader": _doc(rng)})
                run_agent(executor, engine, prompt, 2)
                if check is not None:
                    check()


@pytest.mark.slow
def test_total_cap_holds_after_every_call_under_sustained_load(tiny_executor):
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    free = TenantRegistry(tiny_executor.rotary, config)
    _load(free, tiny_executor, tenants=5, calls=4)
    uncapped = free.nbytes
    cap = uncapped // 4
    registry = TenantRegistry(tiny_executor.rotary, config, max_total_bytes=cap)
    seen = []

    def check():
        total = registry.nbytes
        seen.append(total)
        assert total <= cap, f"{total} bytes held, cap {cap}"
        assert registry.problems() == []

    _load(registry, tiny_executor, tenants=5, calls=4, check=check)
    assert max(seen) > cap // 2 and registry.enforcements > 0
    metrics = registry.metrics()
    assert metrics["bytes"] == registry.nbytes <= cap and len(metrics["tenants"]) == 5
    assert sum(sum(t["evicted"].values()) for t in metrics["tenants"].values()) > 0
    assert all(t["bytes"] == t["prefix_store_bytes"] + t["base_bytes"] + t["fixed_base_bytes"] + sum(t["pool_bytes"].values())
               for t in metrics["tenants"].values())
    assert "tenant-0" not in str(metrics)  # tenant keys may be API keys: only labels are exported


@pytest.mark.slow
def test_per_tenant_quota_keeps_one_tenants_load_from_evicting_another(tiny_executor):
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    probe = TenantRegistry(tiny_executor.rotary, config)
    _load(probe, tiny_executor, tenants=1, calls=2)
    quota = probe.nbytes  # tenant-0's whole state after 2 rows fits its quota
    registry = TenantRegistry(tiny_executor.rotary, config, max_tenant_bytes=quota, max_total_bytes=3 * quota)
    _load(registry, tiny_executor, tenants=1, calls=2)
    quiet = registry.engine("tenant-0")
    before = (quiet.nbytes, dict(quiet.evicted))
    noisy = TenantRegistry(tiny_executor.rotary, config)
    for t in (1, 2):  # two other tenants push hard, far past their quota
        for row in range(8):
            rng = random.Random(100 * t + row)
            spec = parse_pipeline(PIPELINE)
            run_agent(tiny_executor, registry.engine(f"tenant-{t}"), agent_prompt(tiny_executor, spec.agents[1], {"doc": _doc(rng), "reader": _doc(rng)}), 2)
            assert registry.engine(f"tenant-{t}").nbytes <= quota
            run_agent(tiny_executor, noisy.engine("x"), agent_prompt(tiny_executor, spec.agents[1], {"doc": _doc(rng), "reader": _doc(rng)}), 2)
    assert noisy.nbytes > quota  # the same load, unbounded, would have exceeded the quota
    assert (quiet.nbytes, quiet.evicted) == before


@pytest.mark.slow
def test_sharing_works_within_a_tenant_and_never_across(tiny_executor):
    spec = parse_pipeline(PIPELINE)
    registry = TenantRegistry(tiny_executor.rotary, ReuseConfig(pool=PoolConfig(gamma=1.0)))
    alice = [c.provenance for row in range(4) for c in run_row(spec, row, tiny_executor, registry.engine("alice"))]
    assert sum(p.estimated_tokens for p in alice) > 0  # anchors shared between alice's calls
    prompt = agent_prompt(tiny_executor, spec.agents[0], spec.inputs[0])
    _, seen = run_agent(tiny_executor, registry.engine("alice"), prompt, 2)
    assert seen.exact_tokens == len(prompt) - 1  # alice's own prompt: an exact hit
    _, bob = run_agent(tiny_executor, registry.engine("bob"), prompt, 2)
    assert bob.exact_tokens == 0 and bob.estimated_tokens == 0  # nothing of alice's reaches bob
    assert registry.engine("bob").pools.keys() <= {"doc"} and len(registry.engine("bob").pool("doc")) <= 1


@pytest.mark.slow
def test_a_tenants_adapter_engines_share_nothing_and_count_together_against_its_quota(tiny_executor):
    """A tenant's engine per LoRA adapter (``adapter_key``) is an engine of its own (what one
    adapter computed never reaches another or the base model), and the tenant's engines together
    stay within max_tenant_bytes, while another tenant's engine is untouched."""
    spec = parse_pipeline(PIPELINE)
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    probe = TenantRegistry(tiny_executor.rotary, config)
    prompt = agent_prompt(tiny_executor, spec.agents[0], spec.inputs[0])
    run_agent(tiny_executor, probe.engine("p"), prompt, 2)
    quota = 2 * probe.nbytes  # room for about two engines' worth of this prompt
    registry = TenantRegistry(tiny_executor.rotary, config, max_tenant_bytes=quota)
    critic, writer = adapter_key("alice", "critic-digest"), adapter_key("alice", "writer-digest")
    assert owner_of(critic) == owner_of(writer) == "alice" != critic and adapter_key("alice", None) == "alice"
    run_agent(tiny_executor, registry.engine(critic), prompt, 2)
    _, again = run_agent(tiny_executor, registry.engine(critic), prompt, 2)
    assert again.exact_tokens == len(prompt) - 1  # the same adapter: an exact hit
    for key in (writer, "alice"):
        _, other = run_agent(tiny_executor, registry.engine(key), prompt, 2)
        assert other.exact_tokens == other.estimated_tokens == 0  # another adapter, or the base model: nothing
    run_agent(tiny_executor, registry.engine("bob"), prompt, 2)
    bob = registry.engine("bob").nbytes
    alice = lambda: sum(registry.engine(k).nbytes for k in (critic, writer, "alice"))  # noqa: E731
    uncapped = TenantRegistry(tiny_executor.rotary, config)
    for key in (critic, writer, "alice"):
        run_agent(tiny_executor, uncapped.engine(key), prompt, 2)
    assert uncapped.nbytes > quota  # three engines' worth would be over alice's quota
    assert alice() <= quota and registry.problems() == [] and registry.engine("bob").nbytes == bob
    with pytest.raises(ValueError, match="tenant key must be"):  # a tenant cannot name another's adapter engine
        adapter_key(critic, None)
    with pytest.raises(ValueError, match="adapter identity"):
        adapter_key("alice", "x" * 200)


@pytest.mark.slow
def test_concurrent_tenants_keep_the_cap_and_raise_nothing(tiny_executor):
    config = ReuseConfig(pool=PoolConfig(gamma=1.0))
    registry = TenantRegistry(tiny_executor.rotary, config, max_total_bytes=400_000)
    _, errors = _in_threads(lambda t: _load_one(registry, tiny_executor, t), 4)
    assert not errors
    assert registry.problems() == []  # caps hold, access counts add up, indexes match their pools
    assert registry.nbytes <= 400_000 and len(registry) == 4
    assert sum(sum(t["evicted"].values()) for t in registry.metrics()["tenants"].values()) > 0  # the cap did bind


def test_concurrent_tenants_get_the_results_of_a_serial_run(tiny_executor):
    """Tenants share nothing, so thread timing cannot change what reuse does: each tenant's calls
    (replies, exact/estimated/computed tokens, fallbacks) under 4 concurrent threads equal the same
    calls run one tenant after another. A per-tenant quota of half what a tenant would hold
    makes eviction part of what must agree."""
    config = ReuseConfig(pool=PoolConfig(gamma=1.0), base_source="standalone")

    def calls(registry: TenantRegistry, t: int) -> list[tuple]:
        spec, rng, out = parse_pipeline(PIPELINE), random.Random(t), []
        for _ in range(4):
            for agent in spec.agents:
                prompt = agent_prompt(tiny_executor, agent, {"doc": _doc(rng), "reader": _doc(rng)})
                generation, p = run_agent(tiny_executor, registry.engine(f"t{t}"), prompt, 2)
                out.append((generation.reply_ids, p.exact_tokens, p.estimated_tokens, p.computed_tokens, p.fallback))
        return out

    probe = TenantRegistry(tiny_executor.rotary, config)
    calls(probe, 0)
    quota = probe.nbytes // 2
    serial_registry = TenantRegistry(tiny_executor.rotary, config, max_tenant_bytes=quota)
    serial = {t: calls(serial_registry, t) for t in range(4)}
    registry = TenantRegistry(tiny_executor.rotary, config, max_tenant_bytes=quota)
    results, errors = _in_threads(lambda t: calls(registry, t), 4)
    assert not errors
    assert results == serial
    assert sum(c[2] for per_tenant in serial.values() for c in per_tenant) > 0  # reuse did happen
    assert registry.enforcements > 0  # the quota did bind
    assert registry.problems() == []
    # every tenant's prefix was assembled in memory lent by one shared workspace, held by four threads at once
    assert all(registry.engine(f"t{t}").workspace is registry.workspace for t in range(4))
    assert 0 < registry.workspace.idle_bytes <= config.workspace_bytes


def _load_one(registry: TenantRegistry, executor, t: int) -> None:
    spec = parse_pipeline(PIPELINE)
    rng = random.Random(t)
    for _ in range(3):
        for agent in spec.agents:
            run_agent(executor, registry.engine(f"t{t}"), agent_prompt(executor, agent, {"doc": _doc(rng), "reader": _doc(rng)}), 2)


def test_bad_tenant_keys_and_caps_are_refused():
    rotary = Rotary(torch.ones(4))
    registry = TenantRegistry(rotary)
    for key in ("", None, 7, "k" * 300):
        with pytest.raises(ValueError, match="tenant key must be a non-empty string"):
            registry.engine(key)
    with pytest.raises(ValueError, match="max_total_bytes must be a positive integer"):
        TenantRegistry(rotary, max_total_bytes=0)
    with pytest.raises(KeyError, match="unknown tenant"):
        registry.drop("nobody")
    assert len(registry) == 0 and tenant_label("a") != tenant_label("b") and len(tenant_label("a")) == 12


# -- the timing probe ------------------------------------------------------------------------

PROBE = {"agents": [{"name": "keeper", "system": "Be brief.", "template": "Note: {secret}\nOK?"}],
         "inputs": [{"secret": "-"}], "max_new_tokens": 1}
CHANNELS = {
    # the exact prefix store: the channel a plain prefix cache opens
    "exact": ReuseConfig(mode="exact"),
    # anchors and bases only (a prefix store with no room): the secret's base exists once
    # someone prefilled it ("first_use"), and then it is estimated (gamma 1: reuse as soon as
    # two anchors are compatible)
    "estimated": ReuseConfig(mode="kvcomm", prefix_store_bytes=0, base_source="first_use", pool=PoolConfig(gamma=1.0)),
}
ALPHA = 1e-6
"""The isolated probe fails when the attacker's success count has a two-sided binomial p-value
below ALPHA. Without a leak the count is Binomial(trials, 1/2) exactly (each held-out coin flip
is independent of B's timing), so the test fails spuriously with probability <= ALPHA: it does
not flake. At 200 trials it still catches any attacker right 67.5% of the time or more; the
shared-cache controls are caught at 90-100%."""


def _probe(executor, config: ReuseConfig, isolated: bool, trials: int, seed: int,
           sent_always: bool | None = None) -> list[tuple[bool, float, int, tuple]]:
    """Per trial: tenant A sends the secret prompt or (coin flip) a decoy of the same shape,
    then tenant B sends the secret prompt. Returns (A sent it, B's TTFT, B's reused tokens,
    B's plan and reply). ``sent_always``: A always sends the secret (True) or always the decoy
    (False), with the same secrets, decoys and coin draws as the seed gives otherwise."""
    agent = parse_pipeline(PROBE).agents[0]
    registry = TenantRegistry(executor.rotary, config)
    alice = registry.engine("alice")
    bob = registry.engine("bob") if isolated else alice
    rng = random.Random(seed)
    out = []
    for trial in range(trials):
        secret = f"Vault {trial} code {rng.randrange(10**5):05d}."
        decoy = f"Vault {trial} code {rng.randrange(10**5):05d}."
        sent = rng.random() < 0.5 if sent_always is None else (rng.random() < 2) == sent_always
        run_agent(executor, alice, agent_prompt(executor, agent, {"secret": secret if sent else decoy}), 1)
        generation, seen = run_agent(executor, bob, agent_prompt(executor, agent, {"secret": secret}), 1)
        plan = (seen.exact_tokens, seen.estimated_tokens, seen.computed_tokens, seen.fallback, tuple(generation.reply_ids))
        out.append((sent, seen.ttft_s, seen.exact_tokens + seen.estimated_tokens, plan))
    return out


def _attack(trials: list[tuple[bool, float, int, tuple]], features: tuple[int, ...] = (2, 1)) -> int:
    """Correct guesses of an attacker who, for each half of the trials, picks the best
    single threshold rule (``features``: 2 = reused tokens, 1 = TTFT; either direction,
    thresholds halfway between observed values) on the other half."""

    def fit(train):
        best = (-1, None)
        for feature in features:
            values = sorted({t[feature] for t in train})
            for threshold in [(a + b) / 2 for a, b in zip(values, values[1:])] or values:  # midpoints
                for above in (True, False):
                    hits = sum(((t[feature] >= threshold) == above) == t[0] for t in train)
                    best = max(best, (hits, (feature, threshold, above)), key=lambda b: b[0])
        return best[1]

    half = len(trials) // 2
    correct = 0
    for train, test in ((trials[:half], trials[half:]), (trials[half:], trials[:half])):
        feature, threshold, above = fit(train)
        correct += sum(((t[feature] >= threshold) == above) == t[0] for t in test)
    return correct


@pytest.mark.parametrize("channel", CHANNELS)
def test_tenant_b_gets_the_same_plan_whatever_tenant_a_sent(tiny_executor, channel):
    """Deterministic, no timing: B's plan (exact / estimated / computed tokens, fallback) and
    reply are the same in a world where A always sent B's secret first and in one where A
    always sent a decoy. With one shared engine (the control) they differ: the probe sees it."""
    config = CHANNELS[channel]
    worlds = {sent: _probe(tiny_executor, config, True, 30, 3, sent_always=sent) for sent in (True, False)}
    assert [t[3] for t in worlds[True]] == [t[3] for t in worlds[False]]
    shared = {sent: _probe(tiny_executor, config, False, 30, 3, sent_always=sent) for sent in (True, False)}
    differ = sum(a[3][:3] != b[3][:3] for a, b in zip(shared[True], shared[False]))
    assert differ >= 25, f"the control should leak in (almost) every trial, leaked in {differ}/30"


@pytest.mark.slow
@pytest.mark.parametrize("channel", CHANNELS)
def test_cross_tenant_timing_probe_is_at_chance_level(smol_executor, channel):
    started, cpu = time.perf_counter(), time.process_time()
    config = CHANNELS[channel]
    control = _probe(smol_executor, config, isolated=False, trials=20, seed=1)
    leaked = _attack(control, features=(2,))  # reused tokens only: deterministic, timing cannot flake it
    assert leaked >= 17, f"the harness must catch a shared cache: only {leaked}/{len(control)} guessed"
    isolated = _probe(smol_executor, config, isolated=True, trials=200, seed=2)
    guessed = _attack(isolated)
    p = binomtest(guessed, len(isolated), 0.5).pvalue
    print(f"probe ({channel}): shared cache {leaked}/20 guessed; isolated {guessed}/{len(isolated)} "
          f"(rate {guessed / len(isolated):.3f}, two-sided p {p:.3g}); {time.perf_counter() - started:.0f} s, "
          f"{time.process_time() - cpu:.0f} s CPU")
    assert p >= ALPHA, f"attacker guessed {guessed}/{len(isolated)} across tenants (p = {p:.3g} < {ALPHA})"
