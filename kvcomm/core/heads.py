"""Which KV heads a process holds, and how statistics over all heads are completed.

Under tensor parallelism each process (rank) holds the KV of an equal, contiguous share of a
model's KV heads (rank ``r`` of ``size`` holds heads ``[r * h, (r + 1) * h)`` with ``h`` heads
per rank), so every KV the reuse state keeps is ``[layers, h, T, head_dim]`` there.

Element-wise work (realignment, deviations, estimates) needs nothing from the other ranks.
Every decision that reads KV (admission distances, anchor weights, shrinkage factors,
embeddings) is computed from per-head partials: a tensor with a heads axis, reduced over
that axis only after ``gather`` has put the ranks' partials side by side in head order. The
partials are exactly the head slices of what one process holding all heads computes, so
every rank reaches the decisions of the single-process run, bit for bit, and the ranks stay
consistent without exchanging any KV.

Invariant for ``ProcessGroupHeads``: every rank calls ``gather`` the same number of times, in
the same order, with tensors of the same shapes and dtypes (planning and learning run the
same code on the same requests in lockstep). A failure on one rank only (out of memory, a
bug) leaves the others waiting in their next ``gather`` until the group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HeadShards:
    """All KV heads in this process (one rank of one): ``gather`` returns its input."""

    size: int = 1
    """Number of ranks the heads are split over."""
    rank: int = 0
    """This process's rank (its share of the heads in head order)."""

    def gather(self, parts: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
        """Per-head partials of every rank, concatenated in rank (= head) order.

        parts[i]: this rank's partial, its heads along axis ``dims[i]``; the result's
        ``i``-th tensor has ``size`` times as many heads there, on ``parts[i]``'s device and
        in its dtype, bit for bit what the ranks computed.
        """
        if len(parts) != len(dims):
            raise ValueError(f"{len(parts)} partials but {len(dims)} head axes")
        return list(parts)

    def agree(self, value: object) -> bool:
        """Whether every rank passed an equal ``value`` (picklable); one process always agrees."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


ALL_HEADS = HeadShards()
"""The default: one process holds every head."""


class ProcessGroupHeads(HeadShards):
    """Heads split over the ranks of a ``torch.distributed`` process group (e.g. vLLM's
    tensor-parallel group). One ``all_gather`` per ``gather`` call, of all its parts at once as
    raw bytes (any dtype, no rounding).

    ``group`` carries host tensors (gloo). ``device_group`` (optional; vLLM's NCCL group on a
    GPU) carries the parts where they live when its backend serves their device (``CARRIES``):
    no copy through the host, so no host sync; parts on a device it does not serve, or on
    several devices, go through the host and ``group``."""

    CARRIES = {"gloo": "cpu", "nccl": "cuda"}
    """Backend -> the device type whose tensors it gathers in place."""

    def __init__(self, group: "torch.distributed.ProcessGroup", device_group: "torch.distributed.ProcessGroup | None" = None):
        import torch.distributed as dist

        self.group = group
        self.device_group = device_group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def agree(self, value: object) -> bool:
        import torch.distributed as dist

        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return all(v == values[0] for v in values)

    def carrier(self, parts: Sequence[torch.Tensor]) -> "torch.distributed.ProcessGroup":
        """The group that gathers ``parts``: ``device_group`` where it serves their one device, else ``group``."""
        import torch.distributed as dist

        devices = {p.device for p in parts}
        if self.device_group is not None and len(devices) == 1:
            if self.CARRIES.get(str(dist.get_backend(self.device_group))) == next(iter(devices)).type:
                return self.device_group
        return self.group

    def gather(self, parts: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
        import torch.distributed as dist

        super().gather(parts, dims)
        if not parts:
            return []
        group = self.carrier(parts)
        local = [p.detach().contiguous() if group is self.device_group else p.detach().to("cpu").contiguous()
                 for p in parts]
        raw = torch.cat([p.reshape(-1).view(torch.uint8) for p in local])
        received = [torch.empty_like(raw) for _ in range(self.size)]
        dist.all_gather(received, raw, group=group)
        out, offset = [], 0
        for part, mine, dim in zip(parts, local, dims):
            width = mine.numel() * mine.element_size()
            pieces = [r[offset : offset + width].clone().view(mine.dtype).view(mine.shape) for r in received]
            out.append(torch.cat(pieces, dim).to(part.device))
            offset += width
        return out
