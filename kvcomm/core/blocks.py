"""Working on KV layer block by layer block, so that each block stays in cache."""

from __future__ import annotations

BLOCK_BYTES = 1 << 21
"""Difference block size: small enough (2 MiB) to stay in cache between the passes over it."""


def block_layers(layers: int, per_layer_bytes: int) -> int:
    """Layers per block: cache-sized (``BLOCK_BYTES``), at least one layer.

    ``layers``: layers of the KV; ``per_layer_bytes``: bytes one layer of the block's working
    tensor takes. Returns an int in ``[1, layers]``. Blocked ops join their intra-op threads
    after every block: give torch no more intra-op threads than free cores (timings:
    docs/measurements/2026-11-history.md)."""
    return max(1, min(layers, BLOCK_BYTES // max(1, per_layer_bytes)))
