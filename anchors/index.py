"""Narrowing a large anchor pool by embedding similarity (faiss), and the default embedder.

faiss is imported when the first index is built; where it is not installed (the GPU check's
torch/Triton/transformers-only machine, ``benchmarks/gpu_core_check.py``) the index is an exact
numpy search over the same vectors: the same scores up to BLAS rounding, the same order."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kvcomm.core.heads import ALL_HEADS, HeadShards
from kvcomm.core.kv import KV


class Embedder(Protocol):
    """Maps a shared segment to a ``[dim]`` float32 vector; similar content, nearby vectors."""

    def __call__(self, token_ids: Sequence[int], base: KV) -> np.ndarray: ...


def kv_embedding(token_ids: Sequence[int], base: KV) -> np.ndarray:
    """Default embedder: the segment's base values averaged over its tokens, ``[layers*heads*head_dim]``.

    Needs no extra model and sees exactly what KV distances later compare.
    """
    return KVEmbedding()(token_ids, base)


class KVEmbedding:
    """``kv_embedding`` of a base that holds this rank's heads (``kvcomm.core.heads``): the
    per-head means of every rank are gathered first, so each rank gets the vector of all heads."""

    def __init__(self, head_shards: HeadShards = ALL_HEADS):
        self.head_shards = head_shards

    def __call__(self, token_ids: Sequence[int], base: KV) -> np.ndarray:
        (pooled,) = self.head_shards.gather([base.values.float().mean(dim=2)], [1])
        return normalize(pooled.flatten().cpu().numpy())


def normalize(vector: np.ndarray) -> np.ndarray:
    vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


class EmbeddingIndex:
    """Inner-product index over L2-normalized vectors, keyed by int64 ids (cosine similarity)."""

    def __init__(self, dim: int):
        self.dim = dim
        try:
            import faiss
        except ImportError:
            self._index = ExactInnerProduct(dim)
        else:
            self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def __len__(self) -> int:
        return self._index.ntotal

    def _check(self, vector: np.ndarray) -> np.ndarray:
        vector = normalize(vector)
        if vector.shape[0] != self.dim:
            raise ValueError(f"embedding has {vector.shape[0]} dims, the index holds {self.dim}-dim vectors")
        return vector[None, :]

    def add(self, key: int, vector: np.ndarray) -> None:
        self._index.add_with_ids(self._check(vector), np.array([key], dtype=np.int64))

    def remove(self, key: int) -> None:
        self._index.remove_ids(np.array([key], dtype=np.int64))

    def nearest(self, vector: np.ndarray, k: int) -> list[int]:
        """Ids of the ``k`` most similar vectors, most similar first."""
        if len(self) == 0 or k <= 0:
            return []
        _, ids = self._index.search(self._check(vector), min(k, len(self)))
        return [int(i) for i in ids[0] if i >= 0]


class ExactInnerProduct:
    """The part of faiss' ``IndexIDMap2(IndexFlatIP(dim))`` that :class:`EmbeddingIndex` uses, in
    numpy: exact inner products, ``[n, dim]`` float32 queries and vectors, int64 ids; ``search``
    returns ``(scores, ids)`` of shape ``[n, k]``, best first, ties in insertion order."""

    def __init__(self, dim: int):
        self.dim = dim
        self._rows: dict[int, np.ndarray] = {}
        self._stacked: tuple[np.ndarray, np.ndarray] | None = None  # (ids [n], vectors [n, dim]), rebuilt after a change

    @property
    def ntotal(self) -> int:
        return len(self._rows)

    def add_with_ids(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        for key, vector in zip(ids.tolist(), vectors):
            self._rows[int(key)] = np.array(vector, dtype=np.float32)
        self._stacked = None

    def remove_ids(self, ids: np.ndarray) -> None:
        for key in ids.tolist():
            self._rows.pop(int(key), None)
        self._stacked = None

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._stacked is None:
            self._stacked = (np.fromiter(self._rows, dtype=np.int64, count=len(self._rows)),
                             np.stack(list(self._rows.values())).reshape(-1, self.dim))
        ids, vectors = self._stacked
        scores = queries.astype(np.float32) @ vectors.T
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, order, axis=1), ids[order]
