"""A module-scoped fixture for tests that time or run many small forwards on the CPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a small shared CPU, torch's thread pool spinning against other
    processes makes small forwards ~10x slower and their timings noisier. Import it into a
    test module to apply it there; the previous thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
