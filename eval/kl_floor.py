"""The model's first-token KL floor: what precision alone changes, the unit of the quality budget.

KL(dense in the reference dtype || dense in the other) of the first reply token's distribution
(top-k + "other" bucket, as the guard and the evaluation compute it), averaged over the first
agent's prompts of the bundled review pipeline (the documents `kvcomm demo` reads, ~1,000
tokens each). The pair is the serving dtype and its ``OTHER_DTYPE`` (fp32 against bf16, bf16
and fp16 against fp32): "no measurable change" from reuse is at most ``QUALITY_BUDGET`` times
this (R4). Measured once per model folder and dtype on the transformers backend (both dtypes
loaded, one after the other) and cached as JSON under the kvcomm cache folder, keyed by the
model's folder, its config.json, the dtype pair, the top-k and the prompts.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcomm.core.divergence import KL_TOP_K, kl_topk_other, topk_reference
from kvcomm.core.segments import Segment
from kvcomm.eval.precision_floor import OTHER_DTYPE

FLOOR_PIPELINE = "review"
"""The bundled pipeline whose first agent's prompts the floor is measured on."""


@dataclass(frozen=True)
class KlFloor:
    """kl_mean: the floor, nats; kl_values: per prompt; dtype / reference_dtype: the two dense
    runs (KL(reference || dtype)); model: the model folder; measured_at: UTC, ISO 8601."""

    model: str
    dtype: str
    reference_dtype: str
    top_k: int
    kl_mean: float
    kl_values: tuple[float, ...]
    measured_at: str

    def words(self) -> str:
        return (f"first-token KL floor {self.kl_mean:.3g} nats (dense {self.dtype} vs dense {self.reference_dtype}, "
                f"{len(self.kl_values)} prompts)")


def floor_prompts(executor) -> list[tuple[int, ...]]:
    """The first agent's prompt on each input row of ``FLOOR_PIPELINE``, as ``executor`` renders them."""
    from kvcomm.reuse.pipeline import load_bundled_pipeline
    from kvcomm.reuse.runner import build_prompt

    spec = load_bundled_pipeline(FLOOR_PIPELINE)
    agent = spec.agents[0]
    prompts = []
    for row in spec.inputs:
        shared = {}
        for name in spec.input_slots:
            ids = executor.encode(row[name])
            shared[name] = Segment(tuple(ids), slot="_") if ids else None
        prompts.append(build_prompt(executor, agent, shared).token_ids)
    return prompts


def first_token_kls(reference, other, prompts, top_k: int = KL_TOP_K) -> list[float]:
    """KL(reference || other) of the first reply token after each prompt, nats (two executors' dense prefills)."""
    values = []
    for prompt in prompts:
        ref = reference.generate(list(prompt), None, 0, None, keep_logprobs=True).prompt_logprobs[-1:]
        got = other.generate(list(prompt), None, 0, None, keep_logprobs=True).prompt_logprobs[-1:]
        values.append(float(kl_topk_other(topk_reference(ref.float(), top_k), got.float())[0]))
    return values


def cache_path(model_dir: str, dtype: str, top_k: int) -> Path:
    """Where the floor of ``model_dir`` in ``dtype`` is cached (the key is in the file name)."""
    from kvcomm.integrations.transformers.embedded import cache_root

    folder = Path(model_dir).resolve()
    config = folder / "config.json"
    key = json.dumps([str(folder), config.read_text() if config.exists() else "", dtype, OTHER_DTYPE[dtype], top_k,
                      FLOOR_PIPELINE])
    return cache_root() / "kl-floor" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def kl_floor(model: str | None = None, dtype: str = "float32", top_k: int = KL_TOP_K, device: str | None = None) -> KlFloor:
    """The floor of ``model`` (None: the embedded model) served in ``dtype``: read from the cache,
    else measured (loads the model in both dtypes on transformers) and cached. A cache file
    that does not read back as a floor is measured again and replaced."""
    from kvcomm.integrations.runtimes import close_executor, load_executor
    from kvcomm.integrations.transformers.embedded import resolve_model_dir

    if dtype not in OTHER_DTYPE:
        raise ValueError(f"no precision floor for dtype {dtype!r}; choose one of {', '.join(OTHER_DTYPE)}")
    path = cache_path(str(resolve_model_dir(model)), dtype, top_k)
    if path.exists():
        try:
            data = json.loads(path.read_text())
            return KlFloor(**{**data, "kl_values": tuple(data["kl_values"])})
        except (ValueError, TypeError, KeyError):
            pass  # unreadable: measured again below
    other = OTHER_DTYPE[dtype]
    reference_dtype, measured_dtype = ("float32", other) if dtype == "float32" else (other, dtype)
    first, folder = load_executor(model, "transformers", reference_dtype, device)
    try:
        prompts = floor_prompts(first)
        second, _ = load_executor(model, "transformers", measured_dtype, device)
        try:
            with torch.inference_mode():
                values = first_token_kls(first, second, prompts, top_k)
        finally:
            close_executor(second)
    finally:
        close_executor(first)
    floor = KlFloor(str(Path(folder).resolve()), measured_dtype, reference_dtype, top_k, sum(values) / len(values),
                    tuple(values), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(floor), indent=1))
    temporary.replace(path)
    return floor
