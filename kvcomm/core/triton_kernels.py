"""The reuse path's Triton kernels (imported only where ``device.uses_triton`` says so).

Every kernel reads objects that live in tensors of their own through pointer tables (int64
addresses), so one launch covers all layers and anchors. Sources are position-free KV views
``[layers, heads, tokens, head_dim]`` whose last axis is contiguous and whose layer, head and
token strides come with their pointers. Arithmetic is fp32; each output element is rounded
once, to the destination's dtype.

Destination addresses (``place``, ``gather``): element ``(l, h, t, d)`` of keys (values) is at
``layer_ptrs[l] + tok[t] + koff[off[t], h, d]`` (``voff``), in elements of the cache's dtype:
one formula for a contiguous buffer (``tok`` = token offsets, ``off`` = 0) and for any paged
layout (``tok`` = the first element of the slot's block, ``off`` = the slot's place in its
block, ``koff``/``voff`` learned from the backend's own write op:
``kvcomm.integrations.vllm.layout``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logit(logits, row, w_sa, w_sj, n_sum, w_offs, mask, scale, SQRT: tl.constexpr):
    """An anchor's weight logit at ``w_offs``: its distances' row ``row``, summed over ``n_sum``
    slices ``w_sj`` apart (heads), times ``scale``, square-rooted under ``SQRT``."""
    x = tl.load(logits + row * w_sa + w_offs, mask=mask, other=0.0)
    for j in range(1, n_sum):
        x += tl.load(logits + row * w_sa + j * w_sj + w_offs, mask=mask, other=0.0)
    x = x * scale
    if SQRT:
        x = tl.sqrt(x)
    return x


@triton.jit
def _weighted(src, s_sl, s_sh, s_st, kv, layer, head, t_idx, d_idx, mask,
              dev_table, dev_f64, n_dev, first, logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau,
              alpha, alpha_sr, HAS_DEV: tl.constexpr, SQRT: tl.constexpr):
    """``base + sum_a (w_a * alpha[kv, layer - first]) * dev_a`` at tokens ``t_idx`` and
    channels ``d_idx``, fp32 ``[BT, BD]``. ``src``: the base's keys or values; ``kv`` 0 (keys)
    or 1 (values) picks the deviation pointer and the shrinkage row. ``w_a`` = softmax over
    the anchors of ``-(x_a / div_a) / tau``, ``x_a`` from ``_logit``. ``dev_table`` rows (int64):
    keys address, values address, layer stride, head stride (of the deviation from model layer
    ``first`` on), distances row, and ``div_a`` (float64 bits, read through ``dev_f64``)."""
    acc = tl.load(src + layer * s_sl + head * s_sh + t_idx[:, None] * s_st + d_idx[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    if HAS_DEV:
        if layer >= first:
            lw = layer - first
            w_offs = lw * w_sl + head * w_sh + t_idx[:, None] * w_st + d_idx[None, :] * w_sd
            top = tl.full((acc.shape[0], acc.shape[1]), float("-inf"), tl.float32)
            for a in range(n_dev):
                x = _logit(logits, tl.load(dev_table + a * 6 + 4), w_sa, w_sj, n_sum, w_offs, mask, scale, SQRT)
                top = tl.maximum(top, -(x / tl.load(dev_f64 + a * 6 + 5).to(tl.float32)) / tau)
            total = tl.zeros((acc.shape[0], acc.shape[1]), tl.float32)
            for a in range(n_dev):
                x = _logit(logits, tl.load(dev_table + a * 6 + 4), w_sa, w_sj, n_sum, w_offs, mask, scale, SQRT)
                total += tl.exp(-(x / tl.load(dev_f64 + a * 6 + 5).to(tl.float32)) / tau - top)
            shrink = tl.load(alpha + kv * alpha_sr + lw)
            for a in range(n_dev):
                x = _logit(logits, tl.load(dev_table + a * 6 + 4), w_sa, w_sj, n_sum, w_offs, mask, scale, SQRT)
                w = (tl.exp(-(x / tl.load(dev_f64 + a * 6 + 5).to(tl.float32)) / tau - top) / total) * shrink
                ptr = tl.load(dev_table + a * 6 + kv).to(tl.pointer_type(src.dtype.element_ty))
                d_sl = tl.load(dev_table + a * 6 + 2)
                d_sh = tl.load(dev_table + a * 6 + 3)
                dev = tl.load(ptr + lw * d_sl + head * d_sh + t_idx[:, None] * s_st + d_idx[None, :], mask=mask, other=0.0)
                acc += dev.to(tl.float32) * w
    return acc


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
    BT: tl.constexpr, BD: tl.constexpr, HAS_DEV: tl.constexpr, SQRT: tl.constexpr, ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Write position-free KV ``base`` (+ the anchors' weighted deviations) for ``n`` tokens,
    keys rotated to positions ``pos0 + t`` (``cos``/``sin`` ``[positions, R2]``, attention
    scaling included), into the destination. Grid: (layers, heads, cdiv(n, BT))."""
    layer, head, t_idx, d_idx, t_ok, mask = _tile(n, D, BT, BD)
    values = _weighted(base_v, s_sl, s_sh, s_st, 1, layer, head, t_idx, d_idx, mask, dev_table, dev_f64, n_dev, first,
                       logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr, HAS_DEV, SQRT)
    keys = _weighted(base_k, s_sl, s_sh, s_st, 0, layer, head, t_idx, d_idx, mask, dev_table, dev_f64, n_dev, first,
                     logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr, HAS_DEV, SQRT)
    if ROTATE:
        rotated = d_idx < 2 * R2
        if INTERLEAVED:
            pair = d_idx // 2
            partner = d_idx ^ 1
            second = (d_idx % 2) == 1
        else:
            second = d_idx >= R2
            pair = tl.where(second, d_idx - R2, d_idx)
            partner = tl.where(second, d_idx - R2, d_idx + R2)
        partner = tl.where(rotated, partner, d_idx)
        other = _weighted(base_k, s_sl, s_sh, s_st, 0, layer, head, t_idx, partner, mask, dev_table, dev_f64, n_dev, first,
                          logits, w_sa, w_sl, w_sh, w_st, w_sd, w_sj, n_sum, scale, tau, alpha, alpha_sr, HAS_DEV, SQRT)
        cs_mask = t_ok[:, None] & rotated[None, :]
        cs_offs = (pos0 + t_idx)[:, None] * cs_st + pair[None, :]
        c = tl.load(cos + cs_offs, mask=cs_mask, other=1.0)
        s = tl.load(sin + cs_offs, mask=cs_mask, other=0.0)
        sign = tl.where(second, 1.0, -1.0)
        keys = tl.where(rotated[None, :], keys * c + sign[None, :] * (other * s), keys)
    out = tl.load(layer_ptrs + layer).to(tl.pointer_type(out_like.dtype.element_ty))
    slot = tl.load(tok + t_idx, mask=t_ok, other=0)
    place = tl.load(off + t_idx, mask=t_ok, other=0)
    inner = place[:, None] * o_sb + head * o_sh + d_idx[None, :]
    k_at = tl.load(koff + inner, mask=mask, other=0)
    v_at = tl.load(voff + inner, mask=mask, other=0)
    tl.store(out + slot[:, None] + k_at, keys.to(out_like.dtype.element_ty), mask=mask)
    tl.store(out + slot[:, None] + v_at, values.to(out_like.dtype.element_ty), mask=mask)


@triton.jit
def distances_kernel(
    new_v, n_sl, n_sh, n_st, anchor_table, counts, token_out, t_sa, t_sh, channel_out, c_sa, c_sl, c_sh,
    layers, D, BT: tl.constexpr, BD: tl.constexpr,
):
    """Per anchor ``a`` and head ``h`` (grid ``(A, H)``): the base-value difference to the new
    segment on the anchor's first ``counts[a]`` tokens, reduced two ways, fp32:
    ``token_out[a, h, t] = sum_{l, d} |diff|`` and ``channel_out[a, l, h, d] = sum_t diff^2``.
    ``anchor_table`` rows: (values address, layer stride, head stride, token stride)."""
    a = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.load(counts + a)
    ptr = tl.load(anchor_table + a * 4).to(tl.pointer_type(new_v.dtype.element_ty))
    a_sl = tl.load(anchor_table + a * 4 + 1)
    a_sh = tl.load(anchor_table + a * 4 + 2)
    a_st = tl.load(anchor_table + a * 4 + 3)
    d_idx = tl.arange(0, BD)
    for layer in range(0, layers):
        channel = tl.zeros((BD,), tl.float32)
        for t0 in range(0, n, BT):
            t_idx = t0 + tl.arange(0, BT)
            mask = (t_idx < n)[:, None] & (d_idx < D)[None, :]
            mine = tl.load(ptr + layer * a_sl + head * a_sh + t_idx[:, None] * a_st + d_idx[None, :], mask=mask, other=0.0)
            theirs = tl.load(new_v + layer * n_sl + head * n_sh + t_idx[:, None] * n_st + d_idx[None, :], mask=mask, other=0.0)
            diff = mine.to(tl.float32) - theirs.to(tl.float32)
            channel += tl.sum(diff * diff, axis=0)
            row = token_out + a * t_sa + head * t_sh + t_idx
            before = tl.load(row, mask=(t_idx < n) & (layer > 0), other=0.0)
            tl.store(row, before + tl.sum(tl.abs(diff), axis=1), mask=t_idx < n)
        tl.store(channel_out + a * c_sa + layer * c_sl + head * c_sh + d_idx, channel, mask=d_idx < D)


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
                n, D, BT: tl.constexpr, BD: tl.constexpr):
    """Copy the keys and values of ``n`` tokens from one addressed KV to another (both in the
    addressing of the module docstring), every layer; grid (layers, heads, cdiv(n, BT))."""
    layer, head, t_idx, d_idx, t_ok, mask = _tile(n, D, BT, BD)
    src = tl.load(src_layers + layer).to(tl.pointer_type(like.dtype.element_ty))
    dst = tl.load(dst_layers + layer).to(tl.pointer_type(like.dtype.element_ty))
    s_inner = tl.load(src_off + t_idx, mask=t_ok, other=0)[:, None] * s_sb + head * s_sh + d_idx[None, :]
    d_inner = tl.load(dst_off + t_idx, mask=t_ok, other=0)[:, None] * d_sb + head * d_sh + d_idx[None, :]
    s_tok = tl.load(src_tok + t_idx, mask=t_ok, other=0)[:, None]
    d_tok = tl.load(dst_tok + t_idx, mask=t_ok, other=0)[:, None]
    keys = tl.load(src + s_tok + tl.load(src_koff + s_inner, mask=mask, other=0), mask=mask, other=0.0)
    values = tl.load(src + s_tok + tl.load(src_voff + s_inner, mask=mask, other=0), mask=mask, other=0.0)
    tl.store(dst + d_tok + tl.load(dst_koff + d_inner, mask=mask, other=0), keys, mask=mask)
    tl.store(dst + d_tok + tl.load(dst_voff + d_inner, mask=mask, other=0), values, mask=mask)
