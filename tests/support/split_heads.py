"""Record a reuse engine's life on a real model, then replay it on head shards in processes
joined by a gloo group (``ProcessGroupHeads``), the way tensor-parallel ranks hold KV.

``RecordingEngine`` logs every plan (its prompt, decisions and materialized prefix), every
``learn`` (the computed KV, the reply and its KV) and every base registered outside ``learn``,
with the whole heads. ``replay`` runs
in each rank: the same calls with that rank's heads of every KV, and reports per plan whether
its decisions equal the recorded ones and its materialized prefix equals the recorded
prefix's head slice bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import torch

from kvcomm.core.kv import KV
from kvcomm.reuse.engine import ReuseEngine


def decisions(plan) -> dict:
    """What a plan decided, comparable across processes (no KV)."""
    p = plan.provenance()
    pieces = [(piece.segment_index, piece.start, piece.end, None if piece.match is None else
               (piece.match.covered, piece.match.identical, tuple(a.serial for a in piece.match.anchors)))
              for piece in plan.pieces]
    return {"exact": p.exact_tokens, "estimated": p.estimated_tokens, "computed": p.computed_tokens,
            "fallback": p.fallback, "note": plan.note, "pieces": pieces, "learn": list(plan.learn),
            "new_bases": list(plan.new_bases),
            "recompute": None if plan.blend is None else (plan.blend.start, plan.blend.end, plan.blend.count)}


class RecordingEngine(ReuseEngine):
    """A ``ReuseEngine`` that logs its plans, learned KV and bases (``events``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []
        self._learning = False

    def plan(self, prompt, provide_base=None, computes_preambles=False):
        plan = super().plan(prompt, provide_base, computes_preambles)
        self.events.append(["plan", prompt, decisions(plan), None, computes_preambles])
        return plan

    def calibration_plan(self, prompt, provide_base=None):
        plan = super().calibration_plan(prompt, provide_base)
        self.events.append(["calibrate", prompt, decisions(plan), None, False])
        return plan

    @contextlib.contextmanager
    def materialized(self, plan):
        with super().materialized(plan) as prefix:
            self.events[-1][3] = None if prefix is None else prefix.clone()
            yield prefix

    def learn(self, plan, computed, reply_ids=(), reply_kv=None, preamble=None):
        self.events.append(["learn", computed.clone(), tuple(reply_ids), None if reply_kv is None else reply_kv.clone(),
                            None if preamble is None else preamble.clone()])
        self._learning = True  # a reply's base registered by learn is replayed by learn
        try:
            super().learn(plan, computed, reply_ids, reply_kv, preamble)
        finally:
            self._learning = False

    def register_base(self, segment, base):
        if not self._learning:
            self.events.append(["base", segment, base.clone()])
        return super().register_base(segment, base)


def _shard(kv: KV, rank: int, size: int) -> KV:
    heads = kv.keys.shape[1] // size
    return KV(kv.keys[:, rank * heads : (rank + 1) * heads].contiguous(), kv.values[:, rank * heads : (rank + 1) * heads].contiguous())


def replay(rank: int, size: int, log_path: str, init_file: str, out_dir: str) -> None:
    """One rank: replay the recorded events on its heads; writes ``rank{r}.pt`` to ``out_dir``."""
    import torch.distributed as dist

    from kvcomm.core.heads import ProcessGroupHeads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        log = torch.load(log_path, weights_only=False)
        heads = ProcessGroupHeads(dist.group.WORLD)
        engine = ReuseEngine(log["rotary"], log["config"], head_shards=heads)
        plan, results = None, []
        for event in log["events"]:
            if event[0] in ("plan", "calibrate"):
                kind, prompt, recorded, prefix, computes_preambles = event
                plan = engine.plan(prompt, computes_preambles=computes_preambles) if kind == "plan" else engine.calibration_plan(prompt)
                with engine.materialized(plan) as mine:
                    if mine is None or prefix is None:
                        same_kv = mine is None and prefix is None
                    else:
                        expected = _shard(prefix, rank, size)
                        # the preamble's positions hold nothing yet (the executor fills them)
                        kept = [(0, plan.exact_length), (plan.pieces_start, plan.reuse_end)]
                        same_kv = all(torch.equal(mine.span(a, b).keys, expected.span(a, b).keys)
                                      and torch.equal(mine.span(a, b).values, expected.span(a, b).values) for a, b in kept)
                results.append({"decisions": decisions(plan) == recorded, "kv": same_kv, "estimated": recorded["estimated"]})
            elif event[0] == "learn":
                _, computed, reply_ids, reply_kv, preamble = event
                engine.learn(plan, _shard(computed, rank, size), reply_ids,
                             None if reply_kv is None else _shard(reply_kv, rank, size),
                             None if preamble is None else _shard(preamble, rank, size))
            else:
                engine.register_base(event[1], _shard(event[2], rank, size))
        fits = {str(k): (f.cross.clone(), f.estimate_sq.clone(), f.real_sq.clone())
                for pool in engine.pools.values() for k, f in pool.fits.items()}
        torch.save({"results": results, "fits": fits, "anchors": {s: len(p) for s, p in engine.pools.items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def partials(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s per-head partials of three dtypes, heads on axes 1, 0 and 2."""
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 2, 5, dtype=torch.float64, generator=generator),
            torch.randn(2, 4, generator=generator).to(torch.bfloat16),
            torch.randint(-9, 9, (2, 3, 1), generator=generator)]


PARTIAL_DIMS = (1, 0, 2)


def gather_both_ways(rank: int, size: int, init_file: str, out_dir: str) -> None:
    """One rank: gathers ``partials`` through a ``ProcessGroupHeads`` with a device group (gloo
    serves CPU tensors: gathered in place) and through one without (staged through the host);
    records which group each ``all_gather`` used. Writes ``gather{r}.pt`` to ``out_dir``."""
    import torch.distributed as dist

    from kvcomm.core.heads import ProcessGroupHeads

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        device_group = dist.new_group(backend="gloo")
        used, all_gather = [], dist.all_gather
        dist.all_gather = lambda out, tensor, group=None, **kw: (used.append(group), all_gather(out, tensor, group=group, **kw))[1]
        through = {}
        for name, heads in (("device", ProcessGroupHeads(dist.group.WORLD, device_group)),
                            ("host", ProcessGroupHeads(dist.group.WORLD))):
            through[name] = heads.gather(partials(rank), PARTIAL_DIMS)
        groups = ["device" if g is device_group else "host" if g is dist.group.WORLD else repr(g) for g in used]
        torch.save({"gathered": through, "groups": groups}, os.path.join(out_dir, f"gather{rank}.pt"))
        dist.all_gather = all_gather
        dist.barrier()  # neither rank tears its groups down while the other still uses them
        dist.destroy_process_group(device_group)
    finally:
        dist.destroy_process_group()
