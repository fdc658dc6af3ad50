"""What a save of a tenant's reuse state writes, and how long saves and loads take.

Builds an engine's state through its own learning path: a random Llama (SmolLM2's tokenizer;
by default 32 layers of 8 KV heads of 32 channels, hidden size 256: 64 KiB of fp32 KV per
token for little compute, so gigabytes are learned in minutes) run by the transformers
executor, calibration calls (``run_agent(..., calibrate=True)``: dense forwards, everything
learned) over random contents in three templates, until the state holds ``--gb`` GB (bases,
anchors with their deviations, fixed bases). Then: save it to an empty folder, learn one new
anchor (one new content, seen by two templates: its base and one deviation), save again,
load the folder into a fresh engine. Printed (and written with ``--json``): bytes written by
each save (what the process handed to ``write(2)``, ``/proc/self/io`` ``wchar``, and the
bytes of the folder's files that are new or replaced), the save's size on disk, wall times
(save, load), and the second save's bytes as a share of the save.

Uses only ``save_engine`` and ``load_engine``, so the same script measures any kvcomm (run
it with another checkout's interpreter for "before" figures). Progress on stderr.

    python benchmarks/bench_persist.py [--gb 2.0] [--json PATH] [--dir DIR] [--threads N]
                                       [--layers 32] [--kv-heads 8] [--head-dim 32] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

TEMPLATES = ("writer", "critic", "editor")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def written_by_process() -> int:
    """Bytes this process has handed to write(2) so far (Linux ``/proc/self/io`` ``wchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """File name -> (inode, mtime_ns, size)."""
    out = {}
    for path in folder.iterdir():
        if path.is_file():
            st = path.stat()
            out[path.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def model_and_executor(layers: int, kv_heads: int, head_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcomm.integrations.transformers.embedded import load_tokenizer
    from kvcomm.integrations.transformers.executor import TransformersExecutor

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=kv_heads * head_dim, intermediate_size=2 * kv_heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
        max_position_embeddings=8192, eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return TransformersExecutor(LlamaForCausalLM(config).eval(), tokenizer)


def state_bytes(engine) -> int:
    """Bytes of the distinct KV tensors the engine holds (bases, anchors' bases and deviations, fixed bases)."""
    tensors = {}
    kvs = [kv for kv, _ in engine._bases.values()] + list(engine._fixed_bases.values())
    for pool in engine.pools.values():
        for anchor in pool.anchors:
            kvs.append(anchor.base)
            kvs += [kv for d in anchor.deviations.values() for kv in (d.shared, d.following) if kv is not None]
    for kv in kvs:
        for t in (kv.keys, kv.values):
            tensors[t.data_ptr()] = t.nbytes
    return sum(tensors.values())


class Learner:
    """Calibration calls of random contents in the three templates, through the engine's own learning path."""

    def __init__(self, executor, engine, tokens: int, seed: int = 0):
        from kvcomm.core.segments import Segment

        self.executor, self.engine, self.tokens, self.rng = executor, engine, tokens, random.Random(seed)
        self.fixed = {t: (Segment(tuple(executor.encode(f"You are the {t}. Read the document below.\n"))),
                          Segment(tuple(executor.encode(f"\nNow answer as the {t} would.\n"))))
                      for t in TEMPLATES}

    def content(self):
        from kvcomm.core.segments import Segment

        return Segment(tuple(self.rng.randrange(1000, 40000) for _ in range(self.tokens)), slot="doc")

    def call(self, template: str, content) -> None:
        from kvcomm.core.segments import Prompt
        from kvcomm.reuse.runner import run_agent

        head, tail = self.fixed[template]
        run_agent(self.executor, self.engine, Prompt(template, (head, content, tail)), 1, calibrate=True)

    def learn(self, content, templates=TEMPLATES) -> None:
        for template in templates:
            self.call(template, content)


def timed_save(engine, folder: Path, fingerprint) -> dict:
    from kvcomm.services.persist import save_engine

    before, wrote = files(folder) if folder.is_dir() else {}, written_by_process()
    started = time.perf_counter()
    save_engine(engine, folder, fingerprint)
    wall = time.perf_counter() - started
    wrote = written_by_process() - wrote
    after = files(folder)
    changed = sum(size for name, (ino, mtime, size) in after.items() if before.get(name, (None, None))[:2] != (ino, mtime))
    return {"wall_s": round(wall, 3), "write_syscall_bytes": wrote, "new_or_replaced_file_bytes": changed,
            "save_bytes": sum(size for _, _, size in after.values()), "files": len(after)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="state to build, GB (1e9 bytes)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dir", type=Path, help="save folder (default: a temp folder, removed after)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per content")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kvcomm
    from kvcomm.anchors.config import PoolConfig
    from kvcomm.core.fingerprint import model_fingerprint
    from kvcomm.reuse.config import ReuseConfig
    from kvcomm.reuse.engine import ReuseEngine
    from kvcomm.services import persist
    from kvcomm.services.persist import load_engine

    say(f"kvcomm from {Path(kvcomm.__file__).parent}, save format version {persist.VERSION}")
    executor = model_and_executor(args.layers, args.kv_heads, args.head_dim)
    fingerprint = model_fingerprint(executor.model, executor.tokenizer, executor.rotary)
    config = ReuseConfig(pool=PoolConfig(gamma=1.0, max_anchors=4096), prefix_store_bytes=0)
    engine = ReuseEngine(executor.rotary, config)
    learner = Learner(executor, engine, args.tokens)
    target = int(args.gb * 1e9)
    started = time.perf_counter()
    contents = 0
    while state_bytes(engine) < target:
        learner.learn(learner.content())
        contents += 1
        say(f"learning: {contents} contents, {state_bytes(engine) / 1e9:.3f} of {args.gb} GB")
    built = state_bytes(engine)
    anchors = sum(len(p) for p in engine.pools.values())
    say(f"built {built / 1e9:.3f} GB ({anchors} anchors, {len(engine._bases)} bases) in {time.perf_counter() - started:.0f} s")

    scratch = None
    if args.dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="bench-persist-")
        folder = Path(scratch.name) / "tenant"
    else:
        folder = args.dir
    try:
        say("save 1 (empty folder)")
        first = timed_save(engine, folder, fingerprint)
        say(f"  {first}")
        before = {id(a) for p in engine.pools.values() for a in p.anchors}
        content = learner.content()
        learner.learn(content, TEMPLATES[:2])  # its base, then an anchor with one deviation
        new = [a for p in engine.pools.values() for a in p.anchors if id(a) not in before]
        assert len(new) == 1 and len(new[0].deviations) == 1, f"expected one new anchor with one deviation, got {len(new)}"
        anchor_bytes = new[0].nbytes
        say(f"learned one anchor ({anchor_bytes} bytes: base and one deviation); save 2")
        second = timed_save(engine, folder, fingerprint)
        say(f"  {second}")
        say("load into a fresh engine")
        fresh = ReuseEngine(executor.rotary, config)
        started = time.perf_counter()
        summary = load_engine(folder, fresh, fingerprint)
        load_s = time.perf_counter() - started
        restored = sum(len(p) for p in fresh.pools.values())
        assert restored == anchors + 1, (restored, anchors)
    finally:
        if scratch is not None:
            scratch.cleanup()
    results = {
        "kvcomm": str(Path(kvcomm.__file__).parent), "format_version": persist.VERSION,
        "model": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float32",
                  "kv_bytes_per_token": args.layers * args.kv_heads * args.head_dim * 2 * 4},
        "threads": args.threads, "contents": contents, "tokens_per_content": args.tokens,
        "state_bytes": built, "anchors": anchors + 1, "new_anchor_bytes": anchor_bytes,
        "save_1": first, "save_2": second,
        "save_2_share_of_save": round(second["write_syscall_bytes"] / second["save_bytes"], 5),
        "load_wall_s": round(load_s, 3), "loaded_bytes": summary.bytes,
    }
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
