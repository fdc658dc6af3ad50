"""The anchor pool: which shared segments to estimate from which earlier ones (``pool``, set up
by ``config``), the anchors and their deviations (``anchor``, ``deviations``), KV distances
(``distance``, ``distance_cache``), per-layer shrinkage (``shrinkage``) and the embedding index
(``index``). Depends on ``kvcomm.core`` only."""

from kvcomm.core.exports import lazy_exports, names

_EXPORTS = {
    "kvcomm.anchors.pool": ("AnchorPool", "Match"),
    "kvcomm.anchors.config": ("PoolConfig",),
    "kvcomm.anchors.anchor": ("Anchor", "Deviation"),
    "kvcomm.anchors.index": ("Embedder", "EmbeddingIndex", "KVEmbedding", "kv_embedding"),
}
__all__ = names(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
