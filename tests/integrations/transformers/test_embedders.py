"""Both anchor embedders: unit vectors, and nearby content lands nearby."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcomm.anchors.index import EmbeddingIndex, kv_embedding
from kvcomm.core.kv import KV
from kvcomm.core.segments import Segment


def test_kv_embedding_is_unit_and_order_free():
    kv = KV(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    vector = kv_embedding([1, 2, 3, 4, 5], kv)
    assert vector.shape == (8,) and vector.dtype == np.float32
    assert np.isclose(np.linalg.norm(vector), 1.0)
    flipped = KV(kv.keys.flip(2), kv.values.flip(2))
    assert np.allclose(kv_embedding([5, 4, 3, 2, 1], flipped), vector, atol=1e-6)


def test_index_returns_nearest_first_and_forgets_removed():
    index = EmbeddingIndex(3)
    for key, vector in enumerate([[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0]]):
        index.add(key, np.array(vector, dtype=np.float32))
    assert index.nearest(np.array([1, 0, 0], dtype=np.float32), 2) == [0, 2]
    index.remove(0)
    assert index.nearest(np.array([1, 0, 0], dtype=np.float32), 2) == [2, 1]
    with pytest.raises(ValueError, match="dims"):
        index.add(7, np.ones(4, dtype=np.float32))


@pytest.mark.slow
def test_sentence_embedder_puts_paraphrases_together(smol_executor):
    from kvcomm.integrations.transformers.sentence_embedder import SentenceEmbedder

    embed = SentenceEmbedder(smol_executor.decode)
    texts = ["The cat sat on the warm mat.", "A cat was sitting on the mat.", "Stock markets fell sharply today."]
    vectors = []
    for text in texts:
        segment = Segment(tuple(smol_executor.encode(text)), slot="x")
        vectors.append(embed(segment.token_ids, smol_executor.base_kv(segment)))
    assert all(v.shape == (embed.dim,) and np.isclose(np.linalg.norm(v), 1.0, atol=1e-5) for v in vectors)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3
