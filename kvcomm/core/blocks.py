"""Working on KV layer block by layer block, so that each block stays in cache."""

from __future__ import annotations

import torch

BLOCK_BYTES = 1 << 21
"""Difference block size on a CPU: small enough (2 MiB) to stay in cache between the passes over it."""

DEVICE_BLOCK_BYTES = 1 << 30
"""Block size on an accelerator (1 GiB of scratch): there every op is a kernel launch, and a
launch costs more than the passes over device memory a small block would save."""


def block_layers(layers: int, per_layer_bytes: int, device: torch.device | str = "cpu") -> int:
    """Layers per block: cache-sized (``BLOCK_BYTES``) on a CPU, ``DEVICE_BLOCK_BYTES`` on any
    other ``device``; at least one layer.

    ``layers``: layers of the KV; ``per_layer_bytes``: bytes one layer of the block's working
    tensor takes. Returns an int in ``[1, layers]``. Blocked ops join their intra-op threads
    after every block: give torch no more intra-op threads than free cores (timings:
    docs/measurements/2026-11-history.md)."""
    budget = BLOCK_BYTES if torch.device(device).type == "cpu" else DEVICE_BLOCK_BYTES
    return max(1, min(layers, budget // max(1, per_layer_bytes)))
