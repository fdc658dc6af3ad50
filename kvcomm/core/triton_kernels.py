"""The reuse path's Triton kernels (imported only where ``device.uses_triton`` says so).

Every kernel reads objects that live in tensors of their own through pointer tables (int64
addresses), so one launch covers all layers and anchors. Sources are position-free KV views
``[layers, heads, tokens, head_dim]`` whose last axis is contiguous and whose layer, head and
token strides come with their pointers. Arithmetic is fp32; each output element is rounded
once, to the destination's dtype.

Destination addresses (``place``, ``copy``): element ``(l, h, t, d)`` of keys (values) is at
``layer_ptrs[l] + tok[t] + koff[off[t], h, d]`` (``voff``), in elements of the cache's dtype:
one formula for a contiguous buffer (``tok`` = token offsets, ``off`` = 0) and for any paged
layout (``tok`` = the first element of the slot's block, ``off`` = the slot's place in its
block, ``koff``/``voff`` learned from the backend's own write op:
``kvcomm.integrations.vllm.connector.layout``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _estimate(base_k, base_v, s_sl, s_sh, s_st, layer, head, t_idx, t_ok, d_idx, d_ok,
              dev_table, dev_f64, n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau,
              alpha, alpha_sr, HAS_DEV: tl.constexpr, SQRT: tl.constexpr, W_TOKEN: tl.constexpr):
    """Keys and values ``base + sum_a (w_a * alpha[kv, layer - first]) * dev_a`` at tokens
    ``t_idx`` and channels ``d_idx``, fp32 ``[BT, BC]`` each; every base and deviation element
    is loaded once. ``w_a`` = softmax over the anchors of ``-(x_a / div_a) / tau``, computed
    online (a running maximum; the sums so far rescaled when it grows): ``x_a`` is the
    anchor's distances row ``row`` at (layer - first, head, token or channel), summed over
    ``n_sum`` slices ``w_sj`` apart (heads), times ``scale``, square-rooted under ``SQRT``;
    ``W_TOKEN``: one per token (loaded ``[BT]``), else one per channel (loaded ``[BC]``).
    ``dev_table`` rows (int64): keys address, values address, layer stride, head stride (of
    the deviation from model layer ``first`` on), distances row, and ``div_a`` (float64 bits,
    read through ``dev_f64``)."""
    mask = t_ok[:, None] & d_ok[None, :]
    inner = t_idx[:, None] * s_st + d_idx[None, :]
    at = layer * s_sl + head * s_sh + inner
    keys = tl.load(base_k + at, mask=mask, other=0.0).to(tl.float32)
    values = tl.load(base_v + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_DEV:
        if layer >= first:
            lw = layer - first
            top = tl.full(keys.shape, float("-inf"), tl.float32)
            total = tl.zeros(keys.shape, tl.float32)
            dk = tl.zeros(keys.shape, tl.float32)
            dv = tl.zeros(keys.shape, tl.float32)
            for a in range(n_dev):
                row = tl.load(dev_table + a * 6 + 4)
                w_at = row * w_sa + lw * w_sl + head * w_sh
                if W_TOKEN:
                    x = tl.load(logits + w_at + t_idx * w_st, mask=t_ok, other=0.0)
                    for j in range(1, n_sum):
                        x += tl.load(logits + w_at + j * w_sj + t_idx * w_st, mask=t_ok, other=0.0)
                    x = x[:, None]
                else:
                    x = tl.load(logits + w_at + d_idx * w_sd, mask=d_ok, other=0.0)
                    for j in range(1, n_sum):
                        x += tl.load(logits + w_at + j * w_sj + d_idx * w_sd, mask=d_ok, other=0.0)
                    x = x[None, :]
                x = x * scale
                if SQRT:
                    x = tl.sqrt(x)
                z = -(x / tl.load(dev_f64 + a * 6 + 5).to(tl.float32)) / tau
                grown = tl.maximum(top, z)
                kept = tl.exp(top - grown)
                e = tl.exp(z - grown)
                ptr_k = tl.load(dev_table + a * 6).to(tl.pointer_type(base_k.dtype.element_ty))
                ptr_v = tl.load(dev_table + a * 6 + 1).to(tl.pointer_type(base_k.dtype.element_ty))
                dev_at = lw * tl.load(dev_table + a * 6 + 2) + head * tl.load(dev_table + a * 6 + 3) + inner
                dev_k = tl.load(ptr_k + dev_at, mask=mask, other=0.0).to(tl.float32)
                dev_v = tl.load(ptr_v + dev_at, mask=mask, other=0.0).to(tl.float32)
                total = total * kept + e
                dk = dk * kept + e * dev_k
                dv = dv * kept + e * dev_v
                top = grown
            keys += (dk / total) * tl.load(alpha + lw)
            values += (dv / total) * tl.load(alpha + alpha_sr + lw)
    return keys, values


@triton.jit
def _write(out, slot, place, k_base, v_base, koff, voff, o_sb, head, o_sh, d_idx, t_ok, d_ok, keys, values,
           CONTIG: tl.constexpr):
    """Store ``keys``/``values`` ``[BT, BC]`` (channels ``d_idx``) at their destination (see the
    module docstring). ``CONTIG``: channels are contiguous in the destination, so a token's
    element ``d`` is ``d`` past its channel 0 (``k_base``/``v_base`` ``[BT]``: ``koff``/``voff``
    at channel 0); else ``koff``/``voff`` are read per element."""
    mask = t_ok[:, None] & d_ok[None, :]
    if CONTIG:
        k_at = k_base[:, None] + d_idx[None, :]
        v_at = v_base[:, None] + d_idx[None, :]
    else:
        inner = place[:, None] * o_sb + head * o_sh + d_idx[None, :]
        k_at = tl.load(koff + inner, mask=mask, other=0)
        v_at = tl.load(voff + inner, mask=mask, other=0)
    tl.store(out + slot[:, None] + k_at, keys.to(out.dtype.element_ty), mask=mask)
    tl.store(out + slot[:, None] + v_at, values.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _tile(n, D, BT: tl.constexpr, BD: tl.constexpr):
    """This program's (layer, head, token indices ``[BT]``, channel indices ``[BD]``, token mask,
    element mask ``[BT, BD]``) on a (layers, heads, cdiv(n, BT)) grid."""
    t_idx = tl.program_id(2) * BT + tl.arange(0, BT)
    d_idx = tl.arange(0, BD)
    t_ok = t_idx < n
    return tl.program_id(0), tl.program_id(1), t_idx, d_idx, t_ok, t_ok[:, None] & (d_idx[None, :] < D)


@triton.jit
def place_kernel(
    base_k, base_v, s_sl, s_sh, s_st,
    dev_table, dev_f64, n_dev, first,
    logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr,
    cos, sin, cs_st, pos0,
    layer_ptrs, tok, off, koff, voff, o_sb, o_sh, out_like,
    n, D, R2,
    BT: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, HAS_DEV: tl.constexpr, SQRT: tl.constexpr,
    ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, W_TOKEN: tl.constexpr, CONTIG: tl.constexpr,
):
    """Write position-free KV ``base`` (+ the anchors' weighted deviations) for ``n`` tokens,
    keys rotated to positions ``pos0 + t`` (``cos``/``sin`` ``[positions, R2]``, attention
    scaling included), into the destination. Grid: (layers, heads, cdiv(n, BT)). Rotated
    channels are estimated as two halves (a pair's first and second channel, ``BR`` >= ``R2``
    wide), the rest apart, so each element of the base and the deviations is read once."""
    layer, head, t_idx, _, t_ok, _ = _tile(n, D, BT, BD)
    out = tl.load(layer_ptrs + layer).to(tl.pointer_type(out_like.dtype.element_ty))
    slot = tl.load(tok + t_idx, mask=t_ok, other=0)
    place = tl.load(off + t_idx, mask=t_ok, other=0)
    k_base = slot
    v_base = slot
    if CONTIG:
        k_base = tl.load(koff + place * o_sb + head * o_sh, mask=t_ok, other=0)
        v_base = tl.load(voff + place * o_sb + head * o_sh, mask=t_ok, other=0)
    if ROTATE:
        r_idx = tl.arange(0, BR)
        r_ok = r_idx < R2
        if INTERLEAVED:
            lo = 2 * r_idx
            hi = lo + 1
        else:
            lo = r_idx
            hi = r_idx + R2
        k_lo, v_lo = _estimate(base_k, base_v, s_sl, s_sh, s_st, layer, head, t_idx, t_ok, lo, r_ok, dev_table, dev_f64,
                               n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr,
                               HAS_DEV, SQRT, W_TOKEN)
        k_hi, v_hi = _estimate(base_k, base_v, s_sl, s_sh, s_st, layer, head, t_idx, t_ok, hi, r_ok, dev_table, dev_f64,
                               n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr,
                               HAS_DEV, SQRT, W_TOKEN)
        cs_mask = t_ok[:, None] & r_ok[None, :]
        cs_at = (pos0 + t_idx)[:, None] * cs_st + r_idx[None, :]
        c = tl.load(cos + cs_at, mask=cs_mask, other=1.0)
        s = tl.load(sin + cs_at, mask=cs_mask, other=0.0)
        _write(out, slot, place, k_base, v_base, koff, voff, o_sb, head, o_sh, lo, t_ok, r_ok, k_lo * c - k_hi * s, v_lo,
               CONTIG)
        _write(out, slot, place, k_base, v_base, koff, voff, o_sb, head, o_sh, hi, t_ok, r_ok, k_hi * c + k_lo * s, v_hi,
               CONTIG)
        if 2 * R2 < D:  # channels past the rotary ones: as they are
            rest = 2 * R2 + tl.arange(0, BD)
            rest_ok = rest < D
            k_r, v_r = _estimate(base_k, base_v, s_sl, s_sh, s_st, layer, head, t_idx, t_ok, rest, rest_ok, dev_table,
                                 dev_f64, n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha,
                                 alpha_sr, HAS_DEV, SQRT, W_TOKEN)
            _write(out, slot, place, k_base, v_base, koff, voff, o_sb, head, o_sh, rest, t_ok, rest_ok, k_r, v_r, CONTIG)
    else:
        d_idx = tl.arange(0, BD)
        d_ok = d_idx < D
        keys, values = _estimate(base_k, base_v, s_sl, s_sh, s_st, layer, head, t_idx, t_ok, d_idx, d_ok, dev_table,
                                 dev_f64, n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha,
                                 alpha_sr, HAS_DEV, SQRT, W_TOKEN)
        _write(out, slot, place, k_base, v_base, koff, voff, o_sb, head, o_sh, d_idx, t_ok, d_ok, keys, values, CONTIG)


@triton.jit
def distances_kernel(
    new_v, n_sl, n_sh, n_st, anchor_table, counts, token_out, t_sa, t_sh, channel_out, c_sa, c_sb, c_sl, c_sh,
    layers, D, BT: tl.constexpr, BD: tl.constexpr,
):
    """Per anchor ``a``, head ``h`` and block ``b`` of ``BT`` tokens (grid ``(A, H, blocks)``):
    the base-value difference to the new segment on the anchor's first ``counts[a]`` tokens,
    reduced two ways, fp32: ``token_out[a, h, t] = sum_{l, d} |diff|`` and the block's share of
    the per-channel sums, ``channel_out[a, b, l, h, d] = sum_{t in b} diff^2`` (the caller sums
    over ``b``). ``anchor_table`` rows: (values address, layer stride, head stride, token stride)."""
    a = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    n = tl.load(counts + a)
    ptr = tl.load(anchor_table + a * 4).to(tl.pointer_type(new_v.dtype.element_ty))
    a_sl = tl.load(anchor_table + a * 4 + 1)
    a_sh = tl.load(anchor_table + a * 4 + 2)
    a_st = tl.load(anchor_table + a * 4 + 3)
    d_idx = tl.arange(0, BD)
    t_idx = block * BT + tl.arange(0, BT)
    t_ok = t_idx < n
    mask = t_ok[:, None] & (d_idx < D)[None, :]
    token = tl.zeros((BT,), tl.float32)
    for layer in range(0, layers):
        mine = tl.load(ptr + layer * a_sl + head * a_sh + t_idx[:, None] * a_st + d_idx[None, :], mask=mask, other=0.0)
        theirs = tl.load(new_v + layer * n_sl + head * n_sh + t_idx[:, None] * n_st + d_idx[None, :], mask=mask, other=0.0)
        diff = mine.to(tl.float32) - theirs.to(tl.float32)
        token += tl.sum(tl.abs(diff), axis=1)
        tl.store(channel_out + a * c_sa + block * c_sb + layer * c_sl + head * c_sh + d_idx, tl.sum(diff * diff, axis=0),
                 mask=d_idx < D)
    tl.store(token_out + a * t_sa + head * t_sh + t_idx, token, mask=t_ok)


@triton.jit
def admission_kernel(channel, c_ss, c_sa, width, counts, anchors, limits, out, o_ss, temperature,
                     BA: tl.constexpr, BW: tl.constexpr):
    """Admission of segment ``s`` (grid ``(S,)``) over its ``anchors[s]`` candidates, fp64:
    ``l2_a = sqrt(sum channel[s, a, :])`` (the per-channel squared value differences, ``width``
    of them), ``r_a = l2_a / sqrt(counts[s, a])``, ``p = softmax_a(-(r_a / min r) / temperature)``,
    ``H = -sum p log p``. Writes ``out[s] = (H > limits[s], H, p_0, ..., p_{A-1})``."""
    s = tl.program_id(0)
    n = tl.load(anchors + s)
    a_idx = tl.arange(0, BA)
    a_ok = a_idx < n
    acc = tl.zeros((BA,), tl.float64)
    for w0 in range(0, width, BW):
        w_idx = w0 + tl.arange(0, BW)
        x = tl.load(channel + s * c_ss + a_idx[:, None] * c_sa + w_idx[None, :],
                    mask=a_ok[:, None] & (w_idx < width)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float64), axis=1)
    count = tl.load(counts + s * BA + a_idx, mask=a_ok, other=1.0)
    rms = tl.sqrt(acc) / tl.sqrt(count)
    nearest = tl.maximum(tl.min(tl.where(a_ok, rms, float("inf")), axis=0), 2.2250738585072014e-308)
    logits = tl.where(a_ok, -(rms / nearest) / temperature, float("-inf"))
    top = tl.max(logits, axis=0)
    e = tl.where(a_ok, tl.exp(logits - top), 0.0)
    p = e / tl.sum(e, axis=0)
    entropy = -tl.sum(tl.where(a_ok, p * tl.log(tl.maximum(p, 1e-300)), 0.0), axis=0)
    row = out + s * o_ss
    tl.store(row, tl.where(entropy > tl.load(limits + s), 1.0, 0.0).to(tl.float64))
    tl.store(row + 1, entropy)
    tl.store(row + 2 + a_idx, p, mask=a_ok)


@triton.jit
def copy_kernel(src_layers, src_tok, src_off, src_koff, src_voff, s_sb, s_sh,
                dst_layers, dst_tok, dst_off, dst_koff, dst_voff, d_sb, d_sh, like,
                n, D, BT: tl.constexpr, BD: tl.constexpr, SRC_CONTIG: tl.constexpr, DST_CONTIG: tl.constexpr):
    """Copy the keys and values of ``n`` tokens from one addressed KV to another (both in the
    addressing of the module docstring), every layer; grid (layers, heads, cdiv(n, BT)).
    ``*_CONTIG``: that side's channels are contiguous (its ``koff``/``voff`` read per token,
    at channel 0, not per element)."""
    layer, head, t_idx, d_idx, t_ok, mask = _tile(n, D, BT, BD)
    src = tl.load(src_layers + layer).to(tl.pointer_type(like.dtype.element_ty))
    dst = tl.load(dst_layers + layer).to(tl.pointer_type(like.dtype.element_ty))
    s_place = tl.load(src_off + t_idx, mask=t_ok, other=0)
    d_place = tl.load(dst_off + t_idx, mask=t_ok, other=0)
    s_tok = tl.load(src_tok + t_idx, mask=t_ok, other=0)[:, None]
    d_tok = tl.load(dst_tok + t_idx, mask=t_ok, other=0)[:, None]
    if SRC_CONTIG:
        s_k = tl.load(src_koff + s_place * s_sb + head * s_sh, mask=t_ok, other=0)[:, None] + d_idx[None, :]
        s_v = tl.load(src_voff + s_place * s_sb + head * s_sh, mask=t_ok, other=0)[:, None] + d_idx[None, :]
    else:
        s_inner = s_place[:, None] * s_sb + head * s_sh + d_idx[None, :]
        s_k = tl.load(src_koff + s_inner, mask=mask, other=0)
        s_v = tl.load(src_voff + s_inner, mask=mask, other=0)
    if DST_CONTIG:
        d_k = tl.load(dst_koff + d_place * d_sb + head * d_sh, mask=t_ok, other=0)[:, None] + d_idx[None, :]
        d_v = tl.load(dst_voff + d_place * d_sb + head * d_sh, mask=t_ok, other=0)[:, None] + d_idx[None, :]
    else:
        d_inner = d_place[:, None] * d_sb + head * d_sh + d_idx[None, :]
        d_k = tl.load(dst_koff + d_inner, mask=mask, other=0)
        d_v = tl.load(dst_voff + d_inner, mask=mask, other=0)
    tl.store(dst + d_tok + d_k, tl.load(src + s_tok + s_k, mask=mask, other=0.0), mask=mask)
    tl.store(dst + d_tok + d_v, tl.load(src + s_tok + s_v, mask=mask, other=0.0), mask=mask)
