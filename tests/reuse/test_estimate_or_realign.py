"""Mode kvcomm serves a slot's estimate only where it has been measured closer to dense than
realignment (kvcomm/reuse/strategies/estimate.py, anchors/evidence.py); elsewhere, and while a
slot is cold, it serves what realignment serves. Synthetic KV on a real engine, no model."""

from __future__ import annotations

import torch

from kvcomm.anchors.config import PoolConfig
from kvcomm.core.kv import KV, place
from kvcomm.core.rope import Rotary
from kvcomm.core.segments import Prompt, Segment
from kvcomm.reuse.config import ReuseConfig
from kvcomm.reuse.engine import ReuseEngine

LAYERS, HEADS, DIM, T = 3, 2, 8, 12
LEAD, TAIL = tuple(range(1, 6)), tuple(range(40, 44))


def _rand(gen: torch.Generator, n: int, scale: float = 1.0) -> KV:
    return KV(scale * torch.randn(LAYERS, HEADS, n, DIM, generator=gen), scale * torch.randn(LAYERS, HEADS, n, DIM, generator=gen))


def _prompt(i: int) -> Prompt:
    return Prompt("agent", (Segment(LEAD), Segment(tuple(range(100 + 20 * i, 100 + 20 * i + T)), slot="doc", shared_id=f"doc-{i}"),
                            Segment(TAIL), Segment((99,))))


def _run(predictable: bool, mode: str = "kvcomm") -> tuple[ReuseEngine, list]:
    """Four dense (calibration) calls, then the plan of a fifth document. The real KV of a
    document is its base plus a deviation: the same one for every document when
    ``predictable`` (anchors estimate it exactly), else a fresh random one."""
    gen = torch.Generator().manual_seed(5)
    rotary = Rotary(1.0 / (1e4 ** (torch.arange(0, DIM, 2).float() / DIM)), head_dim=DIM)
    engine = ReuseEngine(rotary, ReuseConfig(mode=mode, pool=PoolConfig(gamma=1.0), prefix_store_bytes=0))
    provide = lambda s: _rand(gen, len(s))  # noqa: E731
    lead, tail, shared = _rand(gen, len(LEAD)), _rand(gen, len(TAIL)), _rand(gen, T, 0.3)
    for i in range(4):
        prompt = _prompt(i)
        plan = engine.calibration_plan(prompt, provide)
        base = engine.stored_base(f"doc-{i}")
        deviation = shared if predictable else _rand(gen, T, 0.3)
        deviation.keys[0], deviation.values[0] = 0, 0  # layer 0 depends on the token alone
        doc = KV(base.keys + deviation.keys, base.values + deviation.values)
        engine.learn(plan, place(KV.cat([lead, doc, tail, _rand(gen, 1)]), rotary, 0))
    plan = engine.plan(_prompt(4), provide)
    return engine, plan


def test_a_slot_whose_anchors_predict_its_deviations_earns_its_estimate():
    engine, plan = _run(predictable=True)
    evidence = engine.pool("doc").evidence[(("agent", "doc"), "shared")]
    assert evidence.earned and evidence.pairs == 2  # the third and fourth calls each observed
    doc = next(p for p in plan.pieces if p.segment_index == 1)
    assert doc.match is not None and plan.learn == []


def test_a_slot_whose_estimate_is_worse_than_realignment_serves_what_realign_serves():
    engine, plan = _run(predictable=False)
    assert not engine.pool("doc").earned(("agent", "doc")) and plan.decisions[1].match is not None
    _, realigned = _run(predictable=False, mode="realign")
    assert [(p.segment_index, p.start, p.end, p.match) for p in plan.pieces] == \
        [(p.segment_index, p.start, p.end, p.match) for p in realigned.pieces]
    assert all(p.match is None for p in plan.pieces) and plan.reuse_end == len(plan.prompt) - 1
