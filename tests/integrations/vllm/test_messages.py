"""What the connector's scheduler and worker sides tell each other (``vllm.wire.messages``): the
worker metadata of several workers (tensor-parallel ranks) aggregates into one answer per
request."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvcomm.integrations.vllm.wire.messages import KvcommWorkerMetadata, PlanAnswer, PlanAsk  # noqa: E402


def test_worker_metadata_aggregates_the_answers_of_several_workers():
    one, two = KvcommWorkerMetadata({"a": PlanAnswer(1)}), KvcommWorkerMetadata({"b": PlanAnswer(error="e")})
    assert one.aggregate(two).answers == {"a": PlanAnswer(1), "b": PlanAnswer(error="e")}
    released = KvcommWorkerMetadata({}, ("x", "y")).aggregate(KvcommWorkerMetadata({}, ("y", "z"))).released
    assert sorted(released) == ["x", "y", "z"]  # captures let go, by any rank
    with pytest.raises(TypeError, match="cannot aggregate"):
        one.aggregate(object())
    assert isinstance(PlanAsk("a", (1,), None, True, 1), PlanAsk)


def test_tensor_parallel_ranks_that_plan_a_request_differently_give_it_no_reuse():
    """Every rank answers every request; equal answers are one answer, different ones an error."""
    rank0 = KvcommWorkerMetadata({"same": PlanAnswer(5, 5, {}), "split": PlanAnswer(5, 5, {})})
    rank1 = KvcommWorkerMetadata({"same": PlanAnswer(5, 5, {}), "split": PlanAnswer(3, 3, {})})
    answers = rank0.aggregate(rank1).answers
    assert answers["same"] == PlanAnswer(5, 5, {})
    assert "ranks planned this request differently" in answers["split"].error
