"""kvcomm.core.blocks: cache-sized layer blocks on a CPU, whole blocks on an accelerator."""

from __future__ import annotations

import torch

from kvcomm.core.blocks import BLOCK_BYTES, DEVICE_BLOCK_BYTES, block_layers


def test_cpu_blocks_fit_the_cache_and_hold_at_least_one_layer():
    assert block_layers(30, BLOCK_BYTES // 4) == 4
    assert block_layers(30, BLOCK_BYTES * 3) == 1
    assert block_layers(3, 1) == 3
    assert block_layers(30, BLOCK_BYTES // 4, torch.device("cpu")) == 4


def test_accelerator_blocks_take_every_layer_that_fits_the_device_budget():
    """On a GPU every op is a kernel launch: a 1K-token, 32-head layer (8 MiB of fp32 scratch)
    is one block per layer on a CPU but one block for all 24 layers on a GPU."""
    per_layer = 32 * 1024 * 64 * 4
    assert block_layers(24, per_layer) == 1
    assert block_layers(24, per_layer, "cuda") == block_layers(24, per_layer, torch.device("cuda", 0)) == 24
    assert block_layers(24, DEVICE_BLOCK_BYTES // 2, "cuda") == 2
