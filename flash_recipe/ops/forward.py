"""FlashAttention-2 forward: tiled over keys with an online softmax.

Shapes (legend: B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim)::

    q (B, Sq, H, D)   k, v (B, Sk, Hk, D)   ->   out (B, Sq, H, D), lse (B, H, Sq) float32

Query head ``h`` reads key/value head ``h // (H // Hk)`` (contiguous groups, as flash-attn).

Each program owns ``BLOCK_M`` query rows of one head and walks the key blocks it can see, keeping
per row a running maximum ``m``, a running sum ``l`` and an accumulator rescaled whenever ``m``
grows. Scores live in the base-2 domain, so the kernel uses ``exp2``. In fp16/bf16 ``log2(e)`` is
folded into the softmax scale, the running maximum is taken on the raw scores and scaled, and each
probability costs one multiply-add and one ``exp2``; fp32 computes each logit in natural units and
multiplies it by ``log2(e)`` (see ``_fwd_inner``). The log-sum-exp is converted back to natural log
when stored. (Subtracting in natural units first, as the backward does, spills far more of the
fp32 forward's registers on sm90/sm100.)
Every dot runs with ``input_precision="ieee"``: fp16/bf16 still use the tensor cores, and fp32 is
multiplied in full fp32, never TF32.

A row that sees no key (causal with Sq > Sk, or Sk == 0) outputs 0 and stores lse = +inf, which
makes every probability the backward recomputes from it exactly 0.

Attention sinks (``SINKS (H,)``): query head ``h``'s softmax gains the logit ``sinks[h]`` in its
denominator only, ``p_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``. The running max and
sum start from it (``m = sinks[h] * log2(e)``, ``l = 1``) instead of ``-inf`` and 0, so the stored
lse includes it; a row that sees no key then outputs 0 with lse = ``sinks[h]``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..memo_keys import Memo, signature
from . import choose, configs, features, limits, targets, tiles
from .launch import Plan, launch, layout, lse_buffer, packed_rows, plan, score_args
from .options import KEY_RANGE_FIELDS, SCORE_FIELDS, VARLEN_FIELDS, KeyRanges, ScoreOptions, Varlen
from .packing import gqa_packing
from .schedule import launch_order, launch_section
from .split_merge import launch_split_merge, plan_split_merge
from .tiles import (
    LN2,
    LOG2E,
    dropout_keep,
    key_blocks,
    load_keys,
    load_rows,
    load_tile,
    loop_bound,
    sequence,
    stage_bounds,
    store_rows,
    store_tile,
    tanh,
    visible,
)


@triton.jit
def _fwd_step(
    b_acc, b_m, b_l, b_bad, b_q, k_base, v_base, stride_kp, stride_kn, stride_vp, stride_vn, seqlen_k, head_dim,
    lo_offset, hi_offset, diag_offset, nat_scale, qk_scale, tanh_scale, slope, o_m, o_n, o_d, start_n,
    k_first, seed, rng_base, rng_stride, dropout_p, table, bos_k, page_size, num_pages,
    k_tiles, v_tiles, tile_row, tile_col, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_D: tl.constexpr, PAGED: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The key block at ``start_n`` of ``_fwd_inner``'s loop: the running ``(acc, m, l, bad)`` after it."""
    start_n = tl.multiple_of(start_n, BLOCK_N)
    o_k = start_n + o_n
    if TMA and not MASKED:
        b_k = k_tiles.load([tile_row + start_n, tile_col])
    else:
        b_k, m_bad = load_keys(k_base, table, bos_k, start_n, stride_kp, stride_kn, k_first, seqlen_k, head_dim,
                               page_size, num_pages, o_n, o_d, MASKED, MASK_LEFT, MASK_D, PAGED)  # [BN, BD]
        if PAGED:
            b_bad = b_bad | m_bad.to(tl.int32)  # [BLOCK_N]: rows whose page index was out of range
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        b_s = tanh(b_s * tanh_scale)
    if not SCALE_IN_EXP2:
        b_s = b_s * nat_scale
        if ALIBI:
            b_s = b_s - slope * tl.abs((o_m[:, None] + diag_offset - o_k[None, :]).to(tl.float32))
        b_s = b_s * LOG2E
    if MASKED:
        b_s = tl.where(visible(o_m[:, None], o_k[None, :], seqlen_k, lo_offset, hi_offset, MASK_LEFT, MASK_RIGHT),
                       b_s, float("-inf"))
    if SCALE_IN_EXP2:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)  # [BLOCK_M], the running max
    else:
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_m_use = b_m_new
    if MASKED:
        # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid inf - inf
        # (only here: the running max itself stays -inf until the row sees a key).
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    if SCALE_IN_EXP2:
        b_p = tl.math.exp2(b_s * qk_scale - b_m_use[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        b_p = tl.math.exp2(b_s - b_m_use[:, None])
    b_alpha = tl.math.exp2(b_m - b_m_use)  # [BLOCK_M]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    if TMA and not MASKED:
        b_v = v_tiles.load([tile_row + start_n, tile_col])
    else:
        b_v, _ = load_keys(v_base, table, bos_k, start_n, stride_vp, stride_vn, k_first, seqlen_k, head_dim,
                           page_size, num_pages, o_n, o_d, MASKED, MASK_LEFT, MASK_D, PAGED)  # [BLOCK_N, BLOCK_D]
    if DROPOUT:
        m_keep = dropout_keep(seed, rng_base, o_m[:, None], o_k[None, :], rng_stride, dropout_p)
        b_p = tl.where(m_keep, b_p / (1.0 - dropout_p), 0.0)
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision="ieee")
    b_m = b_m_new
    return b_acc, b_m, b_l, b_bad


@triton.jit
def _fwd_inner(
    b_acc, b_m, b_l, b_bad, b_q, k_base, v_base, stride_kp, stride_kn, stride_vp, stride_vn, seqlen_k, head_dim,
    lo_offset, hi_offset, diag_offset, nat_scale, qk_scale, tanh_scale, slope, o_m, o_n, o_d, start, end,
    k_first, seed, rng_base, rng_stride, dropout_p, table, bos_k, page_size, num_pages,
    k_tiles, v_tiles, tile_row, tile_col, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_D: tl.constexpr, PAGED: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """One stage of the key loop over ``[start, end)``; ``MASKED`` applies the sequence and window masks.

    ``o_m`` holds each query row's position (``[BLOCK_M]``) and ``slope`` its ALiBi slope (a scalar,
    or ``[BLOCK_M, 1]`` when the rows are several heads). A masked stage with a window's left edge
    reads only key rows from ``k_first`` (the first key any row of the tile sees) and loads the
    rows before it as 0. (Bounding the reads by the last key a row sees too keeps one more scalar
    alive through the loop, and sm120's forward spills.)

    The logit of a score is ``r * nat_scale`` (minus ``slope * |i + diag_offset - j|`` with ALiBi),
    where ``r`` is the raw ``q . k``, or with softcap ``tanh(q . k * tanh_scale)``; ``qk_scale`` is
    ``nat_scale * log2(e)`` rounded to fp32. With ``SCALE_IN_EXP2`` (fp16/bf16, no ALiBi, ``qk_scale > 0``)
    the row maximum is taken on ``r`` and scaled once, and each probability costs one multiply-add
    and one ``exp2``: ``exp2(r * qk_scale - m)`` (scaling by a positive number preserves the
    maximum exactly). Otherwise the logit is computed in natural units and then multiplied by ``log2(e)``,
    which fp32 keeps: the scale's own rounding to fp32 would shift logits in the hundreds by an
    ulp, more than the fp32 accuracy rule leaves for the gradients the backward recomputes.

    With ``TMA`` an unmasked stage loads its key and value tiles through the descriptors
    ``k_tiles`` and ``v_tiles`` (``(B * Sk, Hk * D)`` row views, see ``tma_views``) at rows
    ``tile_row + start_n`` and column ``tile_col``: every row it reads lies inside the sequence.
    Masked stages, whose last block may end past ``Sk``, keep the masked pointer loads.

    With ``DROPOUT`` the normaliser ``l`` sums the kept and the dropped probabilities alike, and
    only the kept ones, scaled by ``1 / (1 - p)``, reach the accumulator.

    With ``WARP_SPEC`` the loop is warp-specialised (``tl.range(..., warp_specialize=True)``):
    Triton splits it into partitions of warps that load, multiply and take the softmax side by
    side (``features.warp_specialization``). The loop's step is ``_fwd_step`` either way.
    """
    # Two loop statements around one step: ``tl.range`` takes ``warp_specialize`` only in Triton
    # releases that have it (3.2's refuses the keyword), and only the taken branch is compiled.
    if WARP_SPEC:
        for start_n in tl.range(loop_bound(start), loop_bound(end), BLOCK_N, warp_specialize=True):
            b_acc, b_m, b_l, b_bad = _fwd_step(
                b_acc, b_m, b_l, b_bad, b_q, k_base, v_base, stride_kp, stride_kn, stride_vp, stride_vn, seqlen_k,
                head_dim, lo_offset, hi_offset, diag_offset, nat_scale, qk_scale, tanh_scale, slope, o_m, o_n, o_d,
                start_n, k_first, seed, rng_base, rng_stride, dropout_p, table, bos_k, page_size, num_pages,
                k_tiles, v_tiles, tile_row, tile_col, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_D,
                PAGED, SCALE_IN_EXP2, TMA, BLOCK_N, BLOCK_D,
            )
    else:
        for start_n in range(loop_bound(start), loop_bound(end), BLOCK_N):
            b_acc, b_m, b_l, b_bad = _fwd_step(
                b_acc, b_m, b_l, b_bad, b_q, k_base, v_base, stride_kp, stride_kn, stride_vp, stride_vn, seqlen_k,
                head_dim, lo_offset, hi_offset, diag_offset, nat_scale, qk_scale, tanh_scale, slope, o_m, o_n, o_d,
                start_n, k_first, seed, rng_base, rng_stride, dropout_p, table, bos_k, page_size, num_pages,
                k_tiles, v_tiles, tile_row, tile_col, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_D,
                PAGED, SCALE_IN_EXP2, TMA, BLOCK_N, BLOCK_D,
            )
    return b_acc, b_m, b_l, b_bad


@triton.heuristics(
    {
        # The variants a launch asks for by passing a tensor (absent tensors are None).
        "VARLEN": lambda a: a["CU_Q"] is not None,
        "KV_RANGES": lambda a: a["K_START"] is not None,
        "PAGED": lambda a: a["PAGE_TABLE"] is not None,
        "TMA": lambda a: a["K_TILES"] is not None,
        "ALIBI": lambda a: a["SLOPES"] is not None,
        "DROPOUT": lambda a: a["SEED"] is not None,
        "SINK_LOGITS": lambda a: a["SINKS"] is not None,
        "HEAD_SECTIONS": lambda a: a["head_section"] > 1,  # schedule.launch_order
        # With PACK_GQA the tile's rows are the group's query heads at each position: Sq * group rows.
        "EVEN_M": lambda a: not a["VARLEN"]
        and a["seqlen_q"] * (a["group_size"] if a["PACK_GQA"] else 1) % a["BLOCK_M"] == 0,
        "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
        # A page table one entry wide (a dense cache, its own pages): one page per sequence.
        "ONE_PAGE": lambda a: a["PAGED"] and a["table_width"] == 1,
        # One multiply-add per score (``_fwd_inner``): fp16/bf16, a positive scale, no ALiBi.
        "SCALE_IN_EXP2": lambda a: a["Q"].element_size() == 2 and not a["ALIBI"] and a["qk_scale"] > 0.0,
    }
)
@triton.jit(do_not_specialize=["head_section"])  # a runtime count: no variant per value
def attn_fwd_kernel(
    Q, K, V, O, K_TILES, V_TILES, LSE, SLOPES, CU_Q, K_START, K_END, PAGE_TABLE, SEED, SINKS,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls, stride_sb, stride_tb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, qk_scale, diag_offset,
    window_left, window_right, dropout_p, rng_stride, page_size, num_pages, table_width, num_splits, head_section,
    fold_batch,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, KV_RANGES: tl.constexpr, PAGED: tl.constexpr,
    TMA: tl.constexpr, PACK_GQA: tl.constexpr, ONE_PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, MASK_D: tl.constexpr,
    SCALE_IN_EXP2: tl.constexpr, SINK_LOGITS: tl.constexpr, HEAD_SECTIONS: tl.constexpr, WARP_SPEC: tl.constexpr,
    GRID_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(max Sq, BLOCK_M) * num_splits, H, B)``, or with ``PACK_GQA``
    ``(cdiv(max Sq * group_size, BLOCK_M) * num_splits, Hk, B)``. Programs take their query block,
    share and head in ``schedule.launch_order``'s order: heaviest blocks first, ``head_section``
    heads at a time. ``GRID_FOLD`` and ``fold_batch``: the grid as folded for CUDA's limits
    (``launch.fold_grid``).

    ``PACK_GQA`` (GQA with a short query: decoding): one program serves all ``group_size`` query
    heads of kv head ``i_hk``, so each key and value block is loaded once for the whole group. Row
    ``r`` of the packed query is position ``r // group_size`` of query head
    ``i_hk * group_size + r % group_size``; masks, ALiBi slopes and the bottom-right alignment use
    each row's own position and head.

    Queries: dense ``Q (B, Sq, H, D)``, or with ``VARLEN`` packed ``(total_q, H, D)`` with
    sequence ``b`` in rows ``CU_Q[b]:CU_Q[b+1]`` (batch strides are 0).

    Keys: dense ``K (B, Sk, Hk, D)``, or with ``KV_RANGES`` the rows ``K_START[b]:K_END[b]`` of
    batch ``b`` (packed varlen keys: ``CU_K[:-1]`` and ``CU_K[1:]``; a KV cache: the left padding and
    the filled length). With ``PAGED``, ``K`` is ``(num_pages, page_size, Hk, D)`` and row ``r`` of
    batch ``b`` lives in page ``PAGE_TABLE[b * stride_tb + r // page_size]``, row ``r % page_size``;
    with ``ONE_PAGE`` (a table one entry wide: a dense cache) the page is looked up once per program.
    ``PAGE_ROWS`` is ``page_size`` as a compile-time constant where rows are addressed through the
    table (so the row-to-page arithmetic is shifts and masks, not integer division), else 1.
    With key ranges each batch aligns its diagonal bottom-right with its own lengths.

    Split-KV (``num_splits > 1``): program ``(i_m * num_splits + i_s)`` takes the ``i_s``-th of
    ``num_splits`` equal shares of the key blocks and writes its partial (normalised) output and
    log-sum-exp at split offset ``i_s * stride_os`` / ``i_s * stride_ls``; ``split_merge.split_combine_kernel``
    merges them. A row with no key in a share stores lse = +inf and output 0.

    With ``TMA`` (dense calls only: no varlen, key ranges or splits), ``K_TILES`` and ``V_TILES``
    are tensor descriptors of ``K`` and ``V`` as ``(B * Sk, Hk * D)`` rows with ``[BLOCK_N, D]``
    tiles (``tma_views``), which the unmasked key blocks load from; otherwise they are None.
    ``WARP_SPEC`` (with ``TMA``, plain scores, no left window: ``features.warp_specialization``)
    warp-specialises every stage's loop and runs the masked stages first, the unmasked one last:
    in the plain order the specialised loops fail to compile on sm100.

    An absent tensor is passed as None, and the flag it implies follows from that (the
    heuristics above): ``CU_Q`` (``VARLEN``), ``K_START``/``K_END`` (``KV_RANGES``),
    ``PAGE_TABLE`` (``PAGED``), ``K_TILES``/``V_TILES`` (``TMA``), ``SLOPES`` (``ALIBI``), ``SEED``
    (``DROPOUT``), ``SINKS`` (``SINK_LOGITS``: ``SINKS[h]``, any float dtype; with split-KV only the
    first share counts it, so the merge counts it once).

    Bad cache metadata (a negative start, an end past the page table, a page index outside
    ``[0, num_pages)``) never reads or writes outside the tensors: the affected batch's output
    and lse become NaN. ``LSE[b * stride_lb + h * stride_lh + first row + i]``;
    ``SLOPES[b * stride_sb + h]``. Dropout draws entry ``(i, j)`` from ``SEED[0]`` at offset
    ``(LSE index of row i) * rng_stride + j``.
    """
    tl.static_assert(KV_RANGES or not PAGED, "PAGED addresses key ranges through the page table: it needs KV_RANGES")
    tl.static_assert(not TMA or not (VARLEN or KV_RANGES), "TMA tiles address dense tensors only")
    tl.static_assert(not (PACK_GQA and DROPOUT), "PACK_GQA serves the forward-only short queries: no dropout")
    # i_h: with PACK_GQA the kv head
    i_m, i_s, i_h, i_b = launch_order(num_splits, head_section, HEAD_SECTIONS, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding (``tiles.grid_id``)
        if i_b >= fold_batch:
            return
    bos_q, seqlen_q = sequence(CU_Q, i_b, seqlen_q, total_q, VARLEN)
    if PACK_GQA:
        n_rows = seqlen_q * group_size
    else:
        n_rows = seqlen_q
    q_start = i_m * BLOCK_M  # the tile's first row
    if VARLEN:
        if q_start >= n_rows:
            return
    bos_k = tl.zeros([], dtype=tl.int64)
    if KV_RANGES:
        if PAGED:
            bos_k = tl.load(K_START + i_b).to(tl.int64)
            seqlen_k = (tl.load(K_END + i_b) - bos_k).to(tl.int32)
            bad = (bos_k < 0) | (seqlen_k < 0) | (bos_k + seqlen_k > tl.cast(table_width, tl.int64) * page_size)
            if ONE_PAGE:  # a dense cache: sequence b is page PAGE_TABLE[b] (its cache_batch_idx entry)
                page = tl.load(PAGE_TABLE + i_b.to(tl.int64) * stride_tb)
                bad = bad | (page < 0) | (page >= num_pages)
                i_page = tl.where(bad, 0, page).to(tl.int64)
            seqlen_k = tl.where(bad, 0, seqlen_k)
        else:  # packed keys: rows K_START[b]:K_END[b], clamped to the total_k rows as ``sequence`` clamps
            bos_k, seqlen_k = sequence(K_START, i_b, seqlen_k, total_k, True, K_END)
        diag_offset = seqlen_k - seqlen_q
    lo_offset = diag_offset - window_left
    hi_offset = diag_offset + window_right
    if PACK_GQA:
        i_hk = i_h
        i_h = i_hk * group_size  # the group's first query head
    else:
        i_hk = i_h // group_size
    tile_row = i_b * seqlen_k  # the descriptors' coordinates (int32: ``tma_views`` checks the bound)
    tile_col = i_hk * BLOCK_D
    i_b = i_b.to(tl.int64)

    o_r = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    if PACK_GQA:
        o_m = (q_start + o_r) // group_size  # each row's query position [BLOCK_M]
        o_g = (q_start + o_r) % group_size  # each row's head within the group [BLOCK_M]
        pos_start = q_start // group_size
        pos_last = tl.minimum((q_start + BLOCK_M - 1) // group_size, seqlen_q - 1)
        m_rows = q_start + o_r < n_rows
    else:
        o_m = q_start + o_r  # query rows [BLOCK_M]
        pos_start = q_start
        pos_last = q_start + BLOCK_M - 1

    q_base = Q + i_b * stride_qb + bos_q * stride_qm + i_h.to(tl.int64) * stride_qh
    if ONE_PAGE:  # rows are the page's rows; the batch stride is the page stride
        k_base = K + i_page * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
        v_base = V + i_page * stride_vb + bos_k * stride_vn + i_hk.to(tl.int64) * stride_vh
    elif PAGED:  # rows are addressed through the page table; the batch stride is the page stride
        k_base = K + i_hk.to(tl.int64) * stride_kh
        v_base = V + i_hk.to(tl.int64) * stride_vh
    else:
        k_base = K + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
        v_base = V + i_b * stride_vb + bos_k * stride_vn + i_hk.to(tl.int64) * stride_vh
    if PACK_GQA:  # row offsets from the group's first head at position 0, 64-bit (``tiles``' rule)
        o_qrow = o_m.to(tl.int64) * stride_qm + o_g.to(tl.int64) * stride_qh  # [BLOCK_M]
        b_q = load_rows(q_base, o_qrow, m_rows, head_dim, o_d, not EVEN_M, MASK_D)  # [BLOCK_M, BLOCK_D]
    else:
        b_q = load_tile(q_base, q_start, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D)
    table = PAGE_TABLE  # None unless PAGED
    if PAGED:
        table = PAGE_TABLE + i_b * stride_tb
    # Logits: ``r * nat_scale`` with ``r = q . k`` or, with softcap, ``tanh(q . k * tanh_scale)``.
    if SOFTCAP:
        nat_scale = softcap
        tanh_scale = sm_scale / softcap
    else:
        nat_scale = sm_scale
        tanh_scale = 1.0
    slope = 0.0
    if ALIBI:
        if PACK_GQA:
            slope = tl.load(SLOPES + i_b * stride_sb + i_h + o_g)[:, None]  # [BLOCK_M, 1]
        else:
            slope = tl.load(SLOPES + i_b * stride_sb + i_h)
    seed = 0
    rng_base = 0
    if DROPOUT:
        seed = tl.load(SEED)
        rng_base = (i_b * stride_lb + i_h.to(tl.int64) * stride_lh + bos_q) * rng_stride

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINK_LOGITS:  # the sink's logit starts the running max and, as exp(0) = 1, the sum (split 0 only)
        if PACK_GQA:
            b_sink = tl.load(SINKS + i_h + o_g).to(tl.float32)  # [BLOCK_M], each row's head
        else:
            b_sink = tl.load(SINKS + i_h).to(tl.float32) + b_l  # [BLOCK_M]
        m_sink = (b_sink > float("-inf")) & (i_s == 0)  # a sink of -inf is no sink
        b_m = tl.where(m_sink, b_sink * LOG2E, b_m)
        b_l = tl.where(m_sink, 1.0, b_l)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # paged: key rows whose page index was out of range (int32: Triton 3.2's interpreter has no int1 zeros)
    b_bad = tl.zeros([BLOCK_N], dtype=tl.int32)

    begin, full_begin, full_end, end = key_blocks(pos_start, pos_last, seqlen_k, lo_offset, hi_offset, MASK_LEFT,
                                                  MASK_RIGHT, BLOCK_N)
    k_first = tl.maximum(pos_start + lo_offset, 0)  # the first key any row sees (with MASK_LEFT)
    if KV_RANGES:  # split-KV runs on per-batch key ranges only (a cache); dense calls keep their bounds
        share = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), num_splits) * BLOCK_N  # keys per split, whole blocks
        split_lo = i_s * share
        split_hi = split_lo + share
    # The left edge of a window (masked), the blocks every row sees in full (no masks), then the
    # diagonal / right edge and the ragged last block (masked); each cut to this split's share.
    # With WARP_SPEC the unmasked stage runs last (``stage_bounds``' UNMASKED_LAST).
    for stage in tl.static_range(3):
        lo, hi = stage_bounds(stage, begin, full_begin, full_end, end, WARP_SPEC)
        if KV_RANGES:
            lo = tl.maximum(lo, split_lo)
            hi = tl.minimum(hi, split_hi)
        b_acc, b_m, b_l, b_bad = _fwd_inner(
            b_acc, b_m, b_l, b_bad, b_q, k_base, v_base, stride_kb, stride_kn, stride_vb, stride_vn, seqlen_k, head_dim,
            lo_offset, hi_offset, diag_offset, nat_scale, qk_scale, tanh_scale, slope, o_m, o_n, o_d, lo, hi,
            k_first, seed, rng_base, rng_stride, dropout_p, table, bos_k, PAGE_ROWS, num_pages,
            K_TILES, V_TILES, tile_row, tile_col,
            stage != (2 if WARP_SPEC else 1), MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_D,
            PAGED and not ONE_PAGE, SCALE_IN_EXP2, TMA, BLOCK_N, BLOCK_D, WARP_SPEC,
        )

    m_empty = b_l == 0.0  # rows that saw no key
    b_l_safe = tl.where(m_empty, 1.0, b_l)
    b_out = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    b_lse = tl.where(m_empty, float("inf"), (b_m + tl.math.log2(b_l_safe)) * LN2)  # [BLOCK_M]
    if PAGED:
        if not ONE_PAGE:
            bad = bad | (tl.max(b_bad, 0) > 0)
        b_out = tl.where(bad, float("nan"), b_out)
        b_lse = tl.where(bad, float("nan"), b_lse)

    o_base = O + i_s.to(tl.int64) * stride_os + i_b * stride_ob + bos_q * stride_om + i_h.to(tl.int64) * stride_oh
    p_lse = LSE + i_s.to(tl.int64) * stride_ls + i_b * stride_lb + i_h.to(tl.int64) * stride_lh + bos_q + o_m
    if PACK_GQA:
        o_orow = o_m.to(tl.int64) * stride_om + o_g.to(tl.int64) * stride_oh  # [BLOCK_M], like o_qrow
        store_rows(o_base, o_orow, m_rows, head_dim, o_d, b_out, not EVEN_M, MASK_D)
        p_lse += o_g.to(tl.int64) * stride_lh
    else:
        store_tile(o_base, q_start, stride_om, seqlen_q, head_dim, o_r, o_d, b_out, not EVEN_M, MASK_D)
        m_rows = o_m < seqlen_q
    if EVEN_M:
        tl.store(p_lse, b_lse)
    else:
        tl.store(p_lse, b_lse, mask=m_rows)


@choose.tuned_fallback
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: ScoreOptions, varlen: Optional[Varlen] = None,
    keys: Optional[KeyRanges] = None, num_splits: int = 1, kernel: str = "fwd", pack_gqa: Optional[bool] = None,
    signed: Optional[Hashable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Inputs are validated by the caller (see ``flash_recipe.api``).

    Args:
        q: ``(B, Sq, H, D)``; k, v: ``(B, Sk, Hk, D)``; or with ``varlen``: ``(total_q, H, D)`` and
            ``(total_k, Hk, D)``; or with a paged ``keys``: ``(num_pages, page_size, Hk, D)``. Last
            dim contiguous, ``H % Hk == 0``.
        options: the scale, masks and score options (``ScoreOptions``).
        keys: per-batch key rows (a KV cache); each batch aligns its diagonal bottom-right.
        num_splits: > 1 (with ``keys``) splits every row's keys into that many shares run by separate
            programs, then merged (``split_merge.split_combine_kernel``): parallelism for few query rows.
        kernel: the launch configuration, ``"fwd"`` or ``"decode"`` (small query blocks); ``"fwd"`` is
            ``"fwd_general"`` with varlen, key ranges, softcap, ALiBi, dropout or a masked head dim.
        pack_gqa: whether one program serves a whole GQA group (``gqa_packing``); None decides by
            that rule, False never packs (for comparisons). ``signed``: the token of the public call
            whose fields alone gave every argument (``TritonBackend.run``), or None; it keys the plan.

    Returns:
        ``out`` shaped like q, in q's dtype, and ``lse`` float32 (natural log): ``(B, H, Sq)``, or
        ``(H, total_q)`` with varlen; with ``options.sinks`` it includes each head's sink.
    """
    if num_splits > 1 and keys is None:
        raise ValueError("num_splits > 1 needs per-batch key ranges (keys)")
    key = _plan_key(q, k, v, options, varlen, keys, num_splits, kernel, pack_gqa, signed)  # before keys from varlen
    if varlen is not None and keys is None:
        cu_k = varlen.cu_seqlens_k
        keys = KeyRanges(cu_k[:-1], cu_k[1:], varlen.max_seqlen_k)
    found = _PLANS.get(key) if key is not None else None
    if found is None:
        found = _PLANS.keep(key, plan_forward(q, k, v, options, varlen, keys, num_splits, kernel, pack_gqa))
    else:  # what a failed launch would reject (``choose.tuned_fallback``), recorded where there is any
        if found.tuned:
            choose.record_tuned(found.tuned)
        if found.warp_spec:
            features.took_warp_specialization(found.warp_spec)
    return run_forward(found, q, k, v, options, varlen, keys)


class ForwardPlan(NamedTuple):
    """What a forward launch of one signature does, decided once (``launch.plan``)."""

    out_shape: tuple
    lse_shape: tuple
    main: Optional[Plan]  # None: no query rows or no output elements, nothing to launch
    combine: Optional[Plan]  # the split-KV merge, with num_splits > 1
    num_splits: int
    tma: tuple  # K and V's tensor descriptors without their bases (``features.descriptor_form``), or ()
    tuned: tuple  # the tuned configurations it took (``choose.tuned_fallback``)
    warp_spec: tuple  # (target, head-dim bucket) where its main launch warp-specialises, else ()


# Signature of a forward launch (``_plan_key``) -> its ``ForwardPlan``.
_PLANS = Memo()


def _plan_key(q, k, v, options, varlen, keys, num_splits, kernel, pack_gqa, signed=None) -> Optional[tuple]:
    """The signature that decides a forward launch: tensors and options (a ``signed`` token stands for
    both without key ranges; a dropout seed is drawn anew, an int64 ``(1,)`` on q's device), and the
    run-time settings (tensor descriptors, tuned configurations); None: not memoized."""
    state = choose.plan_state()
    if state is None:
        return None
    if signed is not None and keys is None:
        found: Optional[tuple] = ("signed", signed, options.seed is None, num_splits, kernel, pack_gqa, varlen is None)
    else:  # every field of the records, none by hand, and which records the call has (keys as passed)
        tensors = (q, k, v) + SCORE_FIELDS.tensors_of(options)
        values = SCORE_FIELDS.values_of(options) + (num_splits, kernel, pack_gqa, varlen is None, keys is None)
        if varlen is not None:
            tensors += VARLEN_FIELDS.tensors_of(varlen)
            values += VARLEN_FIELDS.values_of(varlen)
        if keys is not None:
            tensors += KEY_RANGE_FIELDS.tensors_of(keys)
            values += KEY_RANGE_FIELDS.values_of(keys)
        found = signature(tensors, values)
        if found is None:
            return None
    if keys is not None or varlen is not None:  # packed or ranged keys: no tensor descriptors
        return found, state, targets.target_of(q.device)
    aligned = k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0  # tensor descriptors need 16-byte bases
    return found, state, targets.target_of(q.device), aligned, features.settings()


def plan_forward(q, k, v, options, varlen, keys, num_splits, kernel, pack_gqa) -> ForwardPlan:
    """Decide a forward launch (the first call of its signature): configuration, grid and arguments."""
    dims = layout(q, k, varlen, keys)
    lse_shape = (dims.batch, dims.nheads, dims.seqlen_q) if varlen is None else (dims.nheads, q.shape[0])
    used = choose.tuned_recorded()
    before = len(used) if used is not None else 0
    if q.numel() == 0 or dims.seqlen_q == 0:
        return ForwardPlan(tuple(q.shape), lse_shape, None, None, num_splits, (), (), ())
    # Outputs as meta tensors: their strides, without memory (a launch allocates its own).
    out = torch.empty(q.shape, dtype=q.dtype, device="meta")
    lse, stride_lb, stride_lh = lse_buffer(out, varlen, dims)
    plain = varlen is None and keys is None and options.softcap <= 0.0 and options.alibi_slopes is None
    if kernel == "fwd" and not (plain and options.dropout_p == 0.0 and dims.head_dim in limits.HEAD_DIM_BUCKETS):
        kernel = "fwd_general"
    group = dims.nheads // dims.nheads_k
    pack, cfg, block_m = gqa_packing(q.device, kernel, dims.seqlen_q, dims.head_dim, group, options.dropout_p,
                                     q.element_size(), pack_gqa)
    table = keys.table if keys is not None else None
    if table is not None:
        paging = dict(PAGE_TABLE=table, stride_tb=table.stride(0), page_size=k.shape[1], num_pages=k.shape[0],
                      table_width=table.shape[1], PAGE_ROWS=k.shape[1] if table.shape[1] > 1 else 1)
    else:
        paging = dict(PAGE_TABLE=None, stride_tb=0, page_size=1, num_pages=1, table_width=1, PAGE_ROWS=1)
    o_split, lse_split = out, lse
    if num_splits > 1:
        o_split = torch.empty((num_splits,) + tuple(q.shape), dtype=torch.float32, device="meta")
        lse_split = torch.empty((num_splits,) + tuple(lse.shape), dtype=torch.float32, device="meta")
    cu_q = varlen.cu_seqlens_q if varlen is not None else None
    rows = packed_rows(q, k, varlen, table is not None)
    block_d = configs.head_dim_bucket(dims.head_dim)
    views = features.tma_views(k, v, cfg.block_n) if keys is None and varlen is None else None
    # Warp specialisation where asked for and the call allows it (``features.warp_specialization``).
    ws = bool(views) and features.warp_specialization(
        targets.target_of(q.device), dims.head_dim,
        plain=kernel == "fwd" and not pack and options.window_left < 0 and options.sinks is None)
    heads = dims.nheads_k if pack else dims.nheads
    query_blocks = triton.cdiv(dims.seqlen_q * (group if pack else 1), block_m)
    grid = (query_blocks * num_splits, heads, dims.batch)
    section = launch_section(heads * dims.batch, query_blocks, dims.seqlen_k, dims.head_dim, k.element_size(), q.device,
                             options.window_left, options.window_right)
    main = plan(attn_fwd_kernel, grid, dict(
        Q=q, K=k, V=v, O=o_split, K_TILES=views[0] if views else None, V_TILES=views[1] if views else None,
        LSE=lse_split, CU_Q=cu_q, SINKS=options.sinks,
        K_START=keys.start if keys is not None else None, K_END=keys.end if keys is not None else None,
        **dims.stride_args(q, "q", "m"), **dims.stride_args(k, "k", "n"), **dims.stride_args(v, "v", "n"),
        **dims.stride_args(o_split[0] if num_splits > 1 else out, "o", "m"),
        stride_os=o_split.stride(0) if num_splits > 1 else 0,
        stride_lb=stride_lb, stride_lh=stride_lh, stride_ls=lse_split.stride(0) if num_splits > 1 else 0,
        nheads=dims.nheads, group_size=group, seqlen_q=dims.seqlen_q,
        seqlen_k=dims.seqlen_k, head_dim=dims.head_dim, num_splits=num_splits, head_section=section,
        **rows, **paging, **score_args(options, dims.seqlen_k, forward=True),
        PACK_GQA=pack, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, WARP_SPEC=ws,
        num_warps=cfg.num_warps, num_stages=min(cfg.num_stages, features.WARP_SPEC_STAGES) if ws else cfg.num_stages,
    ), q.device)
    combine = None
    if num_splits > 1:
        combine = plan_split_merge(o_split, lse_split, out, lse, cu_q, dims, stride_lb, stride_lh, rows["total_q"],
                                   block_d, q.device)
    taken = tuple(used[before:]) if used is not None else ()
    return ForwardPlan(tuple(q.shape), lse_shape, main, combine, num_splits,
                       features.descriptor_form(views) if views else (), taken,
                       (targets.target_of(q.device), block_d) if ws else ())


def run_forward(p: ForwardPlan, q, k, v, options: ScoreOptions, varlen, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and launch a planned forward with this call's tensors."""
    out = tiles.output_buffer(p.out_shape, dtype=q.dtype, device=q.device)
    lse = tiles.output_buffer(p.lse_shape, dtype=torch.float32, device=q.device)
    if p.main is None:
        lse.fill_(float("inf"))
        return out.zero_(), lse
    o_split, lse_split = out, lse
    if p.combine is not None:
        o_split = tiles.output_buffer((p.num_splits,) + p.out_shape, dtype=torch.float32, device=q.device)
        lse_split = tiles.output_buffer((p.num_splits,) + p.lse_shape, dtype=torch.float32, device=q.device)
    k_tiles = v_tiles = None
    if p.tma:
        k_tiles, v_tiles = features.rebased(p.tma, k, v)
    cu_q = varlen.cu_seqlens_q if varlen is not None else None
    given = dict(Q=q, K=k, V=v, O=o_split, LSE=lse_split, K_TILES=k_tiles, V_TILES=v_tiles, CU_Q=cu_q,
                 SLOPES=options.alibi_slopes, SEED=options.seed, SINKS=options.sinks)
    if keys is not None:
        given.update(K_START=keys.start, K_END=keys.end, PAGE_TABLE=keys.table)
    launch(p.main, {name: given[name] for name in p.main.tensors})
    if p.combine is not None:
        launch_split_merge(p.combine, o_split, lse_split, out, lse, cu_q)
    return out, lse
