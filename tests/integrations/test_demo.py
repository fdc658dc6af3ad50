"""`kvcomm demo`: its figures recomputed from the per-call records, its chart, and the whole
command end to end (one input row through the vLLM plugin and stock vLLM)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kvcomm.eval.demo_report import DemoCall, demo_agents, demo_json, demo_summary, format_demo, write_chart
from kvcomm.eval.demo import DenseTransformers, run_demo
from kvcomm.reuse.pipeline import load_bundled_pipeline, parse_pipeline


def _call(agent, row, dense, reuse, exact, estimated, computed, equal=True, cached=0, reuse_cached=0):
    prompt = exact + estimated + computed
    return DemoCall(
        agent=agent, input_index=row, prompt_tokens=prompt, exact_tokens=exact, estimated_tokens=estimated,
        computed_tokens=computed, recomputed_tokens=0, reused=exact + estimated > 0, fallback=estimated == 0,
        ttft_dense_s=dense, ttft_reuse_s=reuse, reply_equal=equal, note="", reason=f"reused {exact + estimated} of {prompt}",
        dense_reply="d", reuse_reply="d" if equal else "r",
        dense_prompt_tokens=prompt, dense_cached_tokens=cached, reuse_cached_tokens=reuse_cached,
    )


# Two agents, three rows. The reuse run's first row misses (slower than dense: a base prefill),
# later rows reuse; the mean of per-call ratios over reusing calls (2.29x) differs from the
# ratio of totals (1.50x), so a summary that used the flattering mean would fail below.
CALLS = [
    _call("reader", 0, 1.0, 1.5, 0, 0, 100, cached=0),
    _call("writer", 0, 2.0, 2.0, 10, 0, 110),
    _call("reader", 1, 1.0, 0.8, 5, 0, 95, cached=5, reuse_cached=4),
    _call("writer", 1, 2.0, 0.5, 10, 90, 20, equal=False),
    _call("reader", 2, 1.2, 1.0, 5, 0, 95, cached=5),
    _call("writer", 2, 2.4, 0.6, 10, 95, 15, cached=3),
]


def test_summary_is_computed_from_the_calls():
    s = demo_summary(CALLS)
    assert s["calls"] == 6 and s["rows"] == 3
    assert s["total_ttft_dense_s"] == pytest.approx(9.6)
    assert s["total_ttft_reuse_s"] == pytest.approx(6.4)
    assert s["total_ttft_speedup"] == pytest.approx(9.6 / 6.4)
    reusing = [c for c in CALLS if c.exact_tokens + c.estimated_tokens > 0]
    mean_of_ratios = np.mean([c.ttft_dense_s / c.ttft_reuse_s for c in reusing])
    assert s["mean_ttft_speedup"] == pytest.approx(mean_of_ratios)
    assert abs(s["total_ttft_speedup"] - mean_of_ratios) > 0.1  # the two are not the same figure here
    assert (s["exact_tokens"], s["estimated_tokens"], s["computed_tokens"], s["prompt_tokens"]) == (40, 185, 435, 660)
    assert s["token_reuse_rate"] == pytest.approx(225 / 660)
    assert s["ttft_speedup_ceiling"] == pytest.approx(1 / (1 - 225 / 660))
    assert s["reply_agreement_rate"] == pytest.approx(5 / 6)
    assert (s["dense_cached_tokens"], s["dense_prompt_tokens"], s["reuse_cached_tokens"]) == (13, 660, 4)
    assert s["ttft_dense_p95_s"] == pytest.approx(np.percentile([c.ttft_dense_s for c in CALLS], 95))


def test_per_agent_figures_are_percentiles_and_totals_of_that_agent():
    rows = demo_agents(CALLS)
    assert [r["agent"] for r in rows] == ["reader", "writer"]
    for row in rows:
        mine = [c for c in CALLS if c.agent == row["agent"]]
        for system in ("dense", "reuse"):
            values = [getattr(c, f"ttft_{system}_s") for c in mine]
            assert row[f"ttft_{system}_p50_s"] == pytest.approx(np.percentile(values, 50))
            assert row[f"ttft_{system}_p95_s"] == pytest.approx(np.percentile(values, 95))
            assert row[f"total_ttft_{system}_s"] == pytest.approx(sum(values))
        assert row["calls"] == 3
        assert row["exact_tokens"] + row["estimated_tokens"] + row["computed_tokens"] == row["prompt_tokens"]
    writer = rows[1]
    assert writer["total_ttft_speedup"] == pytest.approx(6.4 / 3.1)
    assert writer["estimated_tokens"] == 185 and writer["reply_agreement_rate"] == pytest.approx(2 / 3)


def test_no_calls_is_a_clear_error():
    with pytest.raises(ValueError, match="at least one input row"):
        demo_summary([])


def test_text_output_states_the_headline_figures():
    text = format_demo(demo_json(CALLS, {}), "stock vLLM")
    assert "stock vLLM 9.6 s, kvcomm 6.4 s  ->  1.50x" in text
    assert "40 exact + 185 estimated + 435 computed = 660" in text
    assert "ceiling 1/(1-rho) = 1.52x" in text
    assert "5/6 calls" in text and "stock vLLM 13 of its 660 prompt tokens, kvcomm 4 of its 660" in text


def test_text_output_gives_each_calls_reason_and_the_precision_floor_beside_agreement():
    from kvcomm.eval.precision_floor import PrecisionFloor

    text = format_demo(demo_json(CALLS, {}, PrecisionFloor("bfloat16", "float32", 4, 6)), "stock vLLM")
    assert ("replies equal to stock vLLM's, token for token: 5/6 calls; precision floor, dense bfloat16 vs dense "
            "float32 on the same calls: 4/6") in text
    lines = text.splitlines()
    assert any(line.split()[:4] == ["1", "writer", "no", "reused"] and line.endswith("reused 100 of 120") for line in lines)
    assert "precision floor" not in format_demo(demo_json(CALLS, {}), "stock vLLM")


def test_chart_is_written_as_a_png(tmp_path):
    path = write_chart(demo_json(CALLS, {}), tmp_path / "demo.png", "stock vLLM")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR: 12 x 4.8 inches at 110 dpi
    assert (width, height) == (1320, 528)


def test_chart_into_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        write_chart(demo_json(CALLS, {}), tmp_path / "nope" / "demo.png", "stock vLLM")


def test_review_pipeline_has_long_documents_behind_different_prefixes():
    spec = load_bundled_pipeline("review")
    assert len(spec.agents) == 4 and len(spec.inputs) >= 4
    assert all("document" in agent.slots for agent in spec.agents)
    heads = {agent.template.split("{document}")[0] for agent in spec.agents}
    assert len(heads) == len(spec.agents)  # every agent reads the document behind its own text
    assert all(len(row["document"].split()) >= 600 for row in spec.inputs)


@pytest.mark.slow
def test_run_demo_records_match_the_prompts_each_system_ran(tiny_executor):
    spec = parse_pipeline({
        "agents": [{"name": "a", "system": "One.", "template": "Text: {text}\nSay it."},
                   {"name": "b", "system": "Two.", "template": "A said: {a}\nText: {text}\nAgree?"}],
        "inputs": [{"text": "the sky is blue " * 8}, {"text": "grass is green " * 8}],
        "max_new_tokens": 4,
    })
    calls, engine = run_demo(spec, tiny_executor, DenseTransformers(tiny_executor), progress=False)
    assert [(c.agent, c.input_index) for c in calls] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    first = calls[0]
    # Nothing to reuse on the first call: both systems ran the same prompt, greedily.
    assert first.reply_equal and first.dense_reply == first.reuse_reply
    assert first.prompt_tokens == first.dense_prompt_tokens
    for c in calls:
        assert c.exact_tokens + c.estimated_tokens + c.computed_tokens == c.prompt_tokens
        assert c.ttft_dense_s > 0 and c.ttft_reuse_s > 0
        assert c.dense_cached_tokens == 0  # the transformers baseline has no prefix cache
    assert "text" in engine.pools


@pytest.mark.slow
def test_demo_end_to_end_through_vllm(tmp_path, capsys):
    pytest.importorskip("vllm")
    from kvcomm.cli import main

    chart = tmp_path / "demo.png"
    assert main(["demo", "--limit", "1", "--json", "--chart", str(chart)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "vllm" and report["baseline"] == "stock vLLM"
    assert report["chart"] == str(chart.resolve()) and chart.read_bytes()[:4] == b"\x89PNG"
    calls = report["calls"]
    assert [c["agent"] for c in calls] == ["summarizer", "reviewer", "checker", "editor"]
    s = report["summary"]
    dense, reuse = sum(c["ttft_dense_s"] for c in calls), sum(c["ttft_reuse_s"] for c in calls)
    assert s["total_ttft_dense_s"] == pytest.approx(dense) and s["total_ttft_reuse_s"] == pytest.approx(reuse)
    assert s["total_ttft_speedup"] == pytest.approx(dense / reuse)
    assert s["exact_tokens"] + s["estimated_tokens"] + s["computed_tokens"] == s["prompt_tokens"]
    assert s["prompt_tokens"] == sum(c["prompt_tokens"] for c in calls) > 4 * 900  # a ~1K-token document each
    assert s["dense_cached_tokens"] == sum(c["dense_cached_tokens"] for c in calls)
    assert s["reuse_cached_tokens"] == sum(c["reuse_cached_tokens"] for c in calls)
    assert calls[0]["reuse_cached_tokens"] == 0  # never served the blocks its baseline twin computed
    # The first call is the same prompt on both systems with nothing cached yet: same greedy reply.
    assert calls[0]["reply_equal"] and calls[0]["dense_prompt_tokens"] == calls[0]["prompt_tokens"]
    assert [a["agent"] for a in report["agents"]] == ["summarizer", "reviewer", "checker", "editor"]
