"""Copying token KV between two ``KVTarget``s, every layer at once: how a paged cache's KV is
captured into a buffer (the vLLM worker's capture, one copy per request and step).

On a GPU (and under ``KVCOMM_TRITON=1``) one launch of ``kvcomm::copy_tokens``
(``triton_kernels.copy_kernel``), both sides' tables uploaded in one copy; elsewhere the torch
composite reads and writes layer by layer. Bit-exact either way (no arithmetic)."""

from __future__ import annotations

import torch

from kvcomm.core.device import OP_BYTES, upload_tables, uses_triton
from kvcomm.core.kv_target import KVTarget

_NAMES = ("layer_ptrs", "tok", "off", "koff", "voff")


def copy_tokens(source: KVTarget, dest: KVTarget) -> None:
    """``dest``'s tokens get ``source``'s, token for token (equal counts, layers and dtypes)."""
    if source.n != dest.n or source.layers != dest.layers or source.dtype != dest.dtype:
        raise ValueError(f"copying {source.n} tokens of {source.layers} layers ({source.dtype}) into {dest.n} of "
                         f"{dest.layers} ({dest.dtype})")
    if source.n == 0:
        return
    if not uses_triton(dest.device):
        for layer in range(source.layers):
            keys, values = source.read(layer)
            dest.write(layer, 0, keys, values)
        return
    _, views = upload_tables([t[name] for t in (source.tables(), dest.tables()) for name in _NAMES], dest.device)
    heads, dim = views[3].shape[1], views[3].shape[2]
    like = torch.empty(0, dtype=dest.dtype, device=dest.device)
    copy_op(*views, like, source.n, source.layers, heads, dim, source.contiguous_channels, dest.contiguous_channels)


@torch.library.custom_op("kvcomm::copy_tokens", mutates_args=())
def copy_op(src_layers: torch.Tensor, src_tok: torch.Tensor, src_off: torch.Tensor, src_koff: torch.Tensor,
            src_voff: torch.Tensor, dst_layers: torch.Tensor, dst_tok: torch.Tensor, dst_off: torch.Tensor,
            dst_koff: torch.Tensor, dst_voff: torch.Tensor, like: torch.Tensor, n: int, layers: int, heads: int,
            dim: int, src_contig: bool, dst_contig: bool) -> None:
    """One ``copy_kernel`` launch; reads and writes through the layer pointer tables."""
    import triton

    from kvcomm.core.triton_kernels import copy_kernel

    block_t = 32
    copy_kernel[(layers, heads, triton.cdiv(n, block_t))](
        src_layers, src_tok, src_off, src_koff, src_voff, src_koff.stride(0), src_koff.stride(1),
        dst_layers, dst_tok, dst_off, dst_koff, dst_voff, dst_koff.stride(0), dst_koff.stride(1), like,
        n, dim, BT=block_t, BD=triton.next_power_of_2(dim), SRC_CONTIG=src_contig, DST_CONTIG=dst_contig,
    )


def _copy_bytes(*args) -> int:
    like, n, layers, heads, dim = args[10:15]
    return 2 * 2 * layers * heads * n * dim * like.element_size()


OP_BYTES["kvcomm::copy_tokens"] = _copy_bytes
