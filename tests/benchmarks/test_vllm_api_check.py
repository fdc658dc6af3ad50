"""``benchmarks/vllm_api_check.py`` reads a vLLM source tree without importing it: the installed
(tested) vLLM fits the connector; a tree whose hook signature or scheduler-output field kvcomm
relies on changed does not, and the check names both; with a baseline it lists what differs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "vllm_api_check.py"
INSTALLED = Path(importlib.util.find_spec("vllm").origin).parent


def _check(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def _summary(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[len("SUMMARY "):])


def test_the_installed_vllm_fits_the_connector():
    done = _check("--installed")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(done.stdout)
    assert summary["ok"] and summary["failed"] == [] and summary["hooks_checked"] >= 12
    assert {"SchedulerOutput.scheduled_new_reqs", "SchedulerOutput.scheduled_cached_reqs", "CachedRequestData.req_ids",
            "Request.prompt_token_ids", "Request.kv_transfer_params", "KVConnectorOutput.kv_connector_worker_meta",
            "KVCacheGroupSpec.kv_cache_spec"} <= set(summary["fields_read"])
    assert "PASS  hooks   KvcommConnector (facade.py).wait_for_layer_load fits" in done.stdout
    # The connector declares SupportsHMA (docs/decisions.md, 2026-12-07): its abstract hook is checked like the others.
    assert summary["layout"]["SupportsHMA"]["in_vllm"] and summary["layout"]["SupportsHMA"]["declared_by_kvcomm"]
    assert ("PASS  hooks   KvcommConnector (facade.py).request_finished_all_groups fits "
            "SupportsHMA.request_finished_all_groups(request, block_ids)") in done.stdout
    assert not summary["layout"]["get_required_kvcache_layout"]["declared_by_kvcomm"]


def _tree_with(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """The installed vllm package as links to its sources, with ``edits`` (relative path ->
    (old, new)) applied to copies of those files."""
    package = tmp_path / "vllm"
    shutil.copytree(INSTALLED, package, copy_function=os.symlink, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for relative, (old, new) in edits.items():
        path = package / relative
        text = path.read_text()
        assert old in text, (relative, old)
        path.unlink()
        path.write_text(text.replace(old, new))
    return tmp_path


def test_a_changed_hook_signature_and_a_renamed_field_are_named(tmp_path):
    tree = _tree_with(tmp_path, {
        "distributed/kv_transfer/kv_connector/v1/base.py": ("def wait_for_layer_load(self, layer_name: str)",
                                                            "def wait_for_layer_load(self, name: str)"),
        "v1/core/sched/output.py": ("scheduled_cached_reqs: CachedRequestData", "cached_reqs: CachedRequestData"),
    })
    done = _check(tree, "--baseline", "installed")
    assert done.returncode == 1 and "CONNECTOR DOES NOT FIT" in done.stdout, done.stdout + done.stderr
    failed = _summary(done.stdout)["failed"]
    assert any("wait_for_layer_load" in f and "'layer_name'" in f and "'name'" in f for f in failed), failed
    assert any("SchedulerOutput" in f and "'scheduled_cached_reqs'" in f for f in failed), failed
    assert "KVConnectorBase_V1.wait_for_layer_load: abstract self, layer_name: str -> None  ->  abstract self, name: str" in done.stdout


def test_a_changed_supportshma_hook_is_named(tmp_path):
    """The connector declares ``SupportsHMA``: a release that changes its abstract hook fails the check."""
    tree = _tree_with(tmp_path, {
        "distributed/kv_transfer/kv_connector/v1/base.py": (
            'def request_finished_all_groups(\n        self,\n        request: "Request",\n        block_ids:',
            'def request_finished_all_groups(\n        self,\n        request: "Request",\n        group_block_ids:'),
    })
    done = _check(tree, "--baseline", "installed")
    assert done.returncode == 1 and "CONNECTOR DOES NOT FIT" in done.stdout, done.stdout + done.stderr
    failed = _summary(done.stdout)["failed"]
    assert any("request_finished_all_groups" in f and "'block_ids'" in f and "'group_block_ids'" in f for f in failed), failed


def test_the_same_tree_as_baseline_differs_in_nothing():
    done = _check(INSTALLED.parent, "--baseline", "installed")
    assert done.returncode == 0 and _summary(done.stdout)["baseline"]["changed"] == []


def test_a_folder_without_vllm_is_refused_with_exit_status_2(tmp_path):
    done = _check(tmp_path)
    assert done.returncode == 2 and "no vllm package" in done.stderr
