"""The `kvcomm` command end to end on the embedded model."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from kvcomm.cli import main

CALL_FIELDS = {
    "agent", "input_index", "prompt_tokens", "exact_tokens", "estimated_tokens", "computed_tokens", "recomputed_tokens",
    "reused", "fallback", "ttft_dense_s", "ttft_reuse_s", "reply_equal", "note", "reason", "dense_reply", "reuse_reply",
}
SUMMARY_FIELDS = {
    "calls", "prompt_tokens", "exact_tokens", "estimated_tokens", "computed_tokens", "token_reuse_rate",
    "estimated_token_rate", "agent_reuse_rate", "fallback_rate", "reply_agreement_rate", "mean_ttft_speedup",
    "ttft_speedup_ceiling", "ttft_dense_p50_s", "ttft_dense_p95_s", "ttft_reuse_p50_s", "ttft_reuse_p95_s",
    "recomputed_tokens", "total_ttft_dense_s", "total_ttft_reuse_s", "total_ttft_speedup",
}


@pytest.mark.slow
def test_run_on_the_short_pipeline_reuses_tokens_and_reports_every_field(capsys):
    # standalone bases: every later row's task is reused from its base (realigned: no slot has
    # earned an estimate in three rows); the first row computes it and its slot keeps an anchor.
    short = str(importlib.resources.files("kvcomm") / "data" / "demo_pipeline.json")
    assert main(["run", short, "--limit", "3", "--gamma", "1.0", "--base-source", "standalone", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "agent calls" in captured.err and "precision floor (bfloat16)" in captured.err  # progress under --json
    floor = report["summary"]["precision_floor"]
    assert (floor["dtype"], floor["reference_dtype"], floor["calls"]) == ("bfloat16", "float32", 12)
    assert 0 <= floor["equal"] <= 12
    assert SUMMARY_FIELDS <= set(report["summary"])
    summary = report["summary"]
    assert summary["calls"] == 3 * 4
    assert summary["token_reuse_rate"] > 0 and summary["estimated_tokens"] > 0
    assert summary["exact_tokens"] + summary["estimated_tokens"] + summary["computed_tokens"] == summary["prompt_tokens"]
    assert len(report["calls"]) == 12 and all(CALL_FIELDS <= set(c) for c in report["calls"])
    assert [a["agent"] for a in report["agents"]] == ["analyst", "planner", "critic", "answerer"]
    first_row = [c for c in report["calls"] if c["input_index"] == 0]
    assert all(c["fallback"] and c["reply_equal"] for c in first_row)  # nothing to reuse yet: dense, same replies
    assert all(c["reason"].startswith(f"reused {c['exact_tokens'] + c['estimated_tokens']:,} of ") for c in report["calls"])
    assert report["anchors"]["task"] >= 1
    assert any("realigned" in c["reason"] for c in report["calls"] if c["input_index"] > 0)
    assert report["base_source"] == "standalone"


@pytest.mark.slow
def test_selfcheck_passes_on_the_embedded_model(capsys):
    assert main(["selfcheck", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["max_abs_error"] < 1e-3 and result["pairing"] == "half-split"


def test_bad_pipeline_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text('{"agents": [], "inputs": [{"task": "x"}]}')
    assert main(["run", str(path)]) == 2
    assert "agents" in capsys.readouterr().err


def test_missing_model_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["selfcheck", "--model", str(tmp_path / "nope")]) == 2
    assert "local transformers folder" in capsys.readouterr().err
