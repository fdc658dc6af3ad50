"""``EmbeddingIndex`` without faiss (``ExactInnerProduct``) answers as with faiss: the same
nearest ids, best first, after adds and removals, and the same refusal of a wrong width."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from kvcomm.anchors.index import EmbeddingIndex, ExactInnerProduct


def _without_faiss(monkeypatch):
    real_import = builtins.__import__

    def refuse_faiss(name, *args, **kwargs):
        if name == "faiss" or name.startswith("faiss."):
            raise ImportError("faiss hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse_faiss)


def test_the_numpy_index_finds_what_faiss_finds(monkeypatch):
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((60, 24)).astype(np.float32)
    queries = rng.standard_normal((20, 24)).astype(np.float32)
    with_faiss = EmbeddingIndex(24)
    _without_faiss(monkeypatch)
    exact = EmbeddingIndex(24)
    assert isinstance(exact._index, ExactInnerProduct) and not isinstance(with_faiss._index, ExactInnerProduct)
    for key, vector in enumerate(vectors):
        with_faiss.add(key * 7, vector)
        exact.add(key * 7, vector)
    for key in (0, 7 * 13, 7 * 59):
        with_faiss.remove(key)
        exact.remove(key)
    assert len(exact) == len(with_faiss) == 57
    for query in queries:
        for k in (1, 5, 57, 80):
            assert exact.nearest(query, k) == with_faiss.nearest(query, k)
    with pytest.raises(ValueError, match="24-dim"):
        exact.add(1000, vectors[0][:10])


def test_an_empty_numpy_index_finds_nothing(monkeypatch):
    _without_faiss(monkeypatch)
    index = EmbeddingIndex(4)
    assert index.nearest(np.ones(4, dtype=np.float32), 3) == []
    index.add(5, np.array([1, 0, 0, 0], dtype=np.float32))
    index.add(6, np.array([0, 1, 0, 0], dtype=np.float32))
    assert index.nearest(np.array([0.1, 1, 0, 0], dtype=np.float32), 3) == [6, 5]
