"""The quality guard through `kvcomm serve --quality-budget TIMES --guard-fraction 1`, at two
realistic budgets on one traffic (the demo pipeline's rows, the embedded SmolLM2): a strict
0.005 nats, below what estimated reuse costs this model on the first reply token, and a loose
0.5 nats above it. Every request that estimated KV is measured after its response; each
measured KL equals the one this test computes itself from the response's own first-token
log-probabilities (of a dense request's top-k tokens); under the strict budget the guard tightens or disables
the slots, under the loose one it does nothing. The strict server runs vLLM's default
multiprocess engine (the guard's record travels to the worker process), the loose one the
worker in the engine-core process."""

from __future__ import annotations

import re
import time

import pytest

from kvcomm.core.divergence import kl_topk_other_of
from kvcomm.integrations.serve.middleware import tenant_of
from kvcomm.services.tenants import tenant_label

from .test_http import annotations, metrics, provenance
from .test_http import executor  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

KEYS = ("kvcomm-test-guard-key",)
BUDGETS = {"strict": 0.005, "loose": 0.5}
TOP_K = 20
RECORD_TIMEOUT_S = 120


@pytest.fixture(scope="module", params=sorted(BUDGETS))
def guarded(request, tmp_path_factory):
    """(kind, budget, a `kvcomm serve` with the guard at that budget, every sample measured)."""
    pytest.importorskip("vllm")
    from support.serve_client import start_server

    from kvcomm.eval.kl_floor import kl_floor

    kind, budget = request.param, BUDGETS[request.param]
    times = budget / kl_floor().kl_mean  # the server reads the same cached floor: TIMES x floor = budget nats
    server = start_server(tmp_path_factory.mktemp(f"kvcomm-guard-{kind}") / "server.log", KEYS,
                          "--quality-budget", repr(times), "--guard-fraction", "1", multiprocess=kind == "strict")
    try:
        yield kind, budget, server
    finally:
        server.stop()


def first_token_logprobs(response: dict) -> dict[int, float]:
    top = response["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(token.removeprefix("token_id:")): value for token, value in top.items()}


def guard_series(server, name: str) -> dict[str, float]:
    """slot -> value of ``kvcomm_guard_<name>`` for this test's tenant."""
    label = tenant_label(tenant_of(KEYS[0]))
    found = {}
    for series, value in metrics(server).items():
        match = re.match(rf'^kvcomm_guard_{name}\{{(.*)\}}$', series)
        if match and f'tenant="{label}"' in match.group(1):
            found[re.search(r'slot="([^"]*)"', match.group(1)).group(1)] = value
    return found


def wait_for_sample(server, count: float) -> float:
    """Wait until the guard recorded ``count`` samples in all (they are measured after the response)."""
    deadline = time.monotonic() + RECORD_TIMEOUT_S
    while (recorded := metrics(server).get("kvcomm_guard_measured_total", 0.0)) < count:
        assert time.monotonic() < deadline, f"the guard recorded {recorded} of {count} samples in {RECORD_TIMEOUT_S} s:\n" + \
            server.log.read_text()[-3000:]
        time.sleep(0.5)
    return recorded


def test_the_guard_measures_each_sampled_request_and_acts_only_past_its_budget(guarded, executor):  # noqa: F811 (fixture)
    from kvcomm.core.segments import Segment
    from kvcomm.reuse.pipeline import load_demo_pipeline
    from kvcomm.reuse.runner import _content, build_prompt

    kind, budget, server = guarded
    key, spec = KEYS[0], load_demo_pipeline()
    measured, summaries, notes, samples = [], [], [], {}
    for row in range(len(spec.inputs)):
        shared = {name: _content(executor, spec.inputs[row][name]) for name in spec.input_slots}
        for agent in spec.agents:
            prompt = build_prompt(executor, agent, shared)
            dense = server.complete(prompt.token_ids, key, 1, None, logprobs=TOP_K, return_tokens_as_token_ids=True)
            reference = dict(sorted(first_token_logprobs(dense).items(), key=lambda kv: -kv[1])[:TOP_K])
            response = server.complete(prompt.token_ids, key, 8, annotations(prompt), logprobs=TOP_K,
                                       logprob_token_ids=list(reference), return_tokens_as_token_ids=True)
            summary = provenance(response)
            summaries.append(summary)
            notes.append(summary["note"])
            if summary["estimated_tokens"] > 0:
                wait_for_sample(server, len(measured) + 1)
                now = guard_series(server, "samples")
                slots = [slot for slot in now if now[slot] > samples.get(slot, 0.0)]
                samples = now
                guard_kl = {guard_series(server, "kl_last")[slot] for slot in slots}
                assert len(guard_kl) == 1  # one sample, recorded for every slot the plan estimated
                measured.append((guard_kl.pop(), kl_topk_other_of(reference, first_token_logprobs(response))))
            reply = [t for t in response["choices"][0]["token_ids"] if t != executor.tokenizer.eos_token_id]
            shared[agent.name] = Segment(tuple(reply), slot="_") if reply else None
    gamma, disabled = guard_series(server, "gamma"), guard_series(server, "disabled")
    tightenings = guard_series(server, "tightenings")
    kls = [guard for guard, _ in measured]
    print(f"\nKL (guard, this test): {[(f'{a:.3g}', f'{b:.3g}') for a, b in measured]}")
    print(f"{kind} budget {budget} nats: {len(summaries)} requests, {len(measured)} measured, first-token KL "
          f"{', '.join(f'{k:.3g}' for k in kls)}; gamma {gamma}, tightenings {tightenings}, disabled {disabled}")

    assert len(measured) >= 3, "the traffic must estimate KV in at least min_samples requests"
    for guard, ours in measured:  # the twins measured what the client was served
        assert guard == pytest.approx(ours, rel=0.05, abs=1e-4)
    planned = metrics(server).get('kvcomm_requests_total{outcome="planned"}', 0.0)
    assert planned == len(summaries)  # the reuse twins count nothing
    if kind == "strict":
        assert sum(kls[:3]) / 3 > budget, f"this traffic must cost more than the strict budget, measured {kls[:3]}"
        acted = [slot for slot in gamma if gamma[slot] < 1.0 or disabled.get(slot)]
        assert acted, f"the strict guard did not act: gamma {gamma}, disabled {disabled}"
        if any(disabled.values()):
            assert any("quality guard" in note for note in notes)
    else:
        assert max(kls) < budget, f"this traffic must cost less than the loose budget, measured {max(kls)}"
        assert all(g == 1.0 for g in gamma.values()) and not any(disabled.values()) and not any(tightenings.values())
        assert not any("quality guard" in note for note in notes)
