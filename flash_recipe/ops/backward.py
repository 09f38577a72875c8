"""FlashAttention-2 backward by recomputation: the kernels (their launcher: ``backward_launch``).

Shapes (legend as in ``forward``)::

    dout, q, out (B, Sq, H, D)   k, v (B, Sk, Hk, D)   lse (B, H, Sq) float32
        ->   dq (B, Sq, H, D)   dk, dv (B, Sk, Hk, D)

The dQ and dK/dV kernels read dout through q's strides and v through k's (one set of addresses
per pair, whose registers Hopper's 64 x 128 tiles need): ``backward_launch.shared_layout``.

The deterministic path: three kernels, none of which uses atomics, so gradients are bit-identical
from run to run:

1. ``attn_bwd_preprocess_kernel``: ``delta = rowsum(dout * out)``, ``(B, H, Sq)`` float32.
2. ``attn_bwd_dq_kernel``: one program per ``BLOCK_M`` queries of one head, recomputing
   ``P = exp(S - lse)``; ``dQ += dS K`` with ``dS = P * (dO V^T - delta)``.
3. ``attn_bwd_dkdv_kernel``: one program per ``BLOCK_N`` keys of one kv head; it walks the query
   blocks of every query head in that head's group, recomputing P, and accumulates
   ``dV += P^T dO`` and ``dK += dS^T Q``.

That is 7 matrix products per (query block, key block) pair: ``Q K^T`` and ``dO V^T`` in both
kernels, then ``dS K``, ``P^T dO`` and ``dS^T Q``. The one-pass path skips kernel 2: kernel 3
(``ATOMIC_DQ``) also computes ``dS K`` for its pair (as ``(K^T dS^T)^T`` with ``DQ_TRANSPOSED``)
and adds it to an fp32 workspace with atomic adds, 5 products per pair, and the workspace becomes
dQ in q's dtype. Which path a call takes is its family's default per head dim
(``configs.BACKWARD_PATHS``) or what ``flash-recipe tune`` measured (``choose.backward_path``). The order in which the
adds land varies, so dQ's last bits vary from run to run (``deterministic=True`` takes the
three-kernel path, as flash-attn's own flag does); fp32 with its own lse keeps the three kernels
(``FIX_LSE`` below needs dQ's row sums before dK/dV).

fp32 with its own lse (``FIX_LSE``): the lse is stored rounded to fp32, an ulp of a few 1e-5 at
logits in the hundreds, which scales a whole row of P and shows in dV beyond the accuracy rule.
So the dQ kernel also sums each row's P and stores the log of that sum, and the dK/dV kernel
divides it out: its P is the exact softmax of the recomputed logits, as torch's is.

Attention sinks: with an lse that includes each head's sink (``forward``), ``P = exp(S - lse)`` is
already the sink-diminished softmax, and dQ, dK, dV follow unchanged. The sink's own gradient is
``dsink[h] = -sum over (b, i) of exp(sink[h] - lse[b, h, i]) * pdp[b, h, i]``, a reduction in torch
(a fixed order) over the lse and each row's ``pdp = sum_j P dP``: ``rowsum(dO * O)`` without O's
rounding to its dtype (``delta`` from the rounded O puts fp16's dsink past the accuracy rule). The
three kernels' dQ kernel, which walks all of a row's keys, stores each row's ``pdp`` once (no
atomics: dsink is bit-identical from run to run too); in one pass the dK/dV kernel adds each key
block's share with atomic adds, so dsink's last bits vary as dQ's do. Two shortcuts of this
attention's own lse do not hold with a sink: a row that sees one key has ``dS != 0`` (its P is
below 1), so the one-key rules are off, and ``FIX_LSE``'s row sums count the sink's share too.

Probabilities are recomputed as ``exp2((S * scale - lse) * log2(e))``: the difference is taken in
natural units, so fp32 keeps its precision at large logits; a row whose lse is +inf (it saw no key) gets P = 0 and so
zero gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .schedule import launch_order
from .tiles import (
    LOG2E,
    dropout_keep,
    grid_id,
    key_blocks,
    load_tile,
    loop_bound,
    query_blocks,
    rows_see_one_key_at_most,
    scores,
    sees_one_key,
    sequence,
    sequences,
    stage_bounds,
    store_tile,
)


# VARLEN is an argument here, with DELTA standing in for CU_Q when there is no varlen:
# deriving it from a None CU_Q, as the other kernels do, costs this kernel registers on sm80.
@triton.heuristics({"EVEN_M": lambda a: not a["VARLEN"] and a["seqlen_q"] % a["BLOCK_M"] == 0,
                    "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"]})
@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, DELTA, CU_Q,
    stride_ob, stride_om, stride_oh,
    stride_dob, stride_dom, stride_doh,
    stride_lb, stride_lh,
    seqlen_q, total_q, head_dim, fold_batch,
    VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, MASK_D: tl.constexpr,
    GRID_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(max Sq, BLOCK_M), H, B)`` (folded: ``tiles.grid_id``):
    ``DELTA[b, h, i] = sum_d O[b, i, h, d] * DO[b, i, h, d]``."""
    i_m = grid_id(0, GRID_FOLD)
    i_h = grid_id(1, GRID_FOLD)
    i_b = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    bos_q, seqlen_q = sequence(CU_Q, i_b, seqlen_q, total_q, VARLEN)
    q_start = i_m * BLOCK_M
    if VARLEN:
        if q_start >= seqlen_q:
            return
    i_b = i_b.to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_base = O + i_b * stride_ob + bos_q * stride_om + i_h.to(tl.int64) * stride_oh
    do_base = DO + i_b * stride_dob + bos_q * stride_dom + i_h.to(tl.int64) * stride_doh
    b_o = load_tile(o_base, q_start, stride_om, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D).to(tl.float32)
    b_do = load_tile(do_base, q_start, stride_dom, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D).to(tl.float32)
    b_delta = tl.sum(b_o * b_do, 1)  # [BLOCK_M]
    p_delta = DELTA + i_b * stride_lb + i_h.to(tl.int64) * stride_lh + bos_q + q_start + o_r
    if EVEN_M:
        tl.store(p_delta, b_delta)
    else:
        tl.store(p_delta, b_delta, mask=q_start + o_r < seqlen_q)


@triton.jit
def _dkdv_inner(
    b_dk, b_dv, b_k, b_v, q_base, do_base, lse_base, delta_base, fix_base, dq_base, sink_base, slope_base, stride_qm,
    stride_dqm, stride_qh, stride_lh, stride_dqh, group_size, seqlen_q, seqlen_k, head_dim, lo_offset, hi_offset,
    diag_offset, sm_scale, softcap, o_n, o_r, o_d, start, end, seed, rng_base, rng_stride, dropout_p,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN_M: tl.constexpr, MASK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    EXACT_ONE_KEY: tl.constexpr, FORWARD_QK_ORDER: tl.constexpr, FIX_LSE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    RAGGED_N: tl.constexpr, SINK_ROWS: tl.constexpr, GROUPED: tl.constexpr, DQ_TRANSPOSED: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Accumulate the contribution of query rows ``[start, end)`` of each of the ``group_size`` query
    heads that share this kv head; tiles are ``[keys, queries]``.

    The ``*_base`` pointers are the group's first head's (``slope_base``: its ALiBi slope,
    ``rng_base``: its dropout offset); head ``g`` adds ``g`` times the head's stride; dO shares Q's
    strides. One loop walks every (head, query block) pair (``GROUPED``: more than one head): a loop
    over the heads around this one spills at head dims 64 and 128 where the single loop does not.
    Where the launch pipelines three stages or more (``STAGES``, its ``num_stages``), a masked
    stage's loop (a few diagonal or edge blocks) is not pipelined: its mask's registers beside the
    pipeline spill Hopper's 64 x 128 tile; at two stages it is (its unmasked loop issues fewer: 294
    a step against 329 on sm90 at head dim 128). ``dV += P^T dO`` precedes ``dP^T = V dO^T``, so P in
    the input dtype is dead before dP is live (the other order spills that tile under Triton 3.6).
    The dQ kernel's masked loops stay pipelined (unpipelined, sm120's d64 dQ tile spills).

    With ``ATOMIC_DQ`` (the one-pass backward) it also adds each block pair's ``dS K * scale`` to the
    fp32 rows at ``dq_base`` with atomic adds: the fifth product, where the dQ kernel would recompute
    P and dP (two more). With ``RAGGED_N`` (a key block that may end past ``seqlen_k``) it zeroes
    those keys' dS first: their K rows load as 0, but their P, from a score of 0, may overflow.

    With ``SINK_ROWS`` (attention sinks, the one-pass backward only) it adds each query row's
    ``sum_j P dP`` over this key block to ``sink_base`` (fp32, atomic): ``rowsum(dO * O)`` from the
    probabilities themselves, not from the output rounded to its dtype, for the sinks' gradient
    (``_sink_grad``). The three kernels leave it to the dQ kernel, which sums whole rows.

    With ``EXACT_ONE_KEY`` (own lse: fp32, or any launch in which no row sees more than one key), a masked
    stage gives a row that sees exactly one key (``sees_one_key``) its exact softmax: P = 1 on that
    key, so dV gets exactly its dO, and dS = 0. Computed, P is ``exp(s - lse)`` with both near the
    logit (up to a softcap of 50), whose fp32 rounding leaves P off 1 by a few ulp of 50, and dS is
    the difference of two rounded sums. Such rows are in masked stages: a row of an unmasked stage
    sees the key block's BLOCK_N keys, and the launcher routes a single key there too
    (``attn_bwd_dkdv_kernel``).
    """
    # One step per (head, query block) pair; with a group (``GROUPED``) the head ``g`` and the block
    # ``start_m`` are carried from step to step (no division).
    n_blocks = tl.cdiv(end - start, BLOCK_M)
    g = 0
    start_m = start
    if GROUPED:
        g = tl.zeros([], dtype=tl.int64)
    for step in tl.range(0, loop_bound(n_blocks * group_size), num_stages=1 if MASKED and STAGES > 2 else STAGES):
        if not GROUPED:
            start_m = start + step * BLOCK_M
        start_m = tl.multiple_of(start_m, BLOCK_M)
        o_m = start_m + o_r  # query rows [BLOCK_M]
        # [BLOCK_M, BLOCK_D] each
        b_q = load_tile(q_base + g * stride_qh, start_m, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D)
        b_do = load_tile(do_base + g * stride_qh, start_m, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M,
                         MASK_D)
        row_base = g * stride_lh  # LSE, DELTA, LSE_FIX and SINK_DELTA share a layout
        # Rows past seqlen_q load q = dO = 0, lse = delta = 0: dV and dK get nothing from them.
        if EVEN_M:
            b_lse = tl.load(lse_base + row_base + o_m)  # [BLOCK_M]
            b_delta = tl.load(delta_base + row_base + o_m)  # [BLOCK_M]
        else:
            b_lse = tl.load(lse_base + row_base + o_m, mask=o_m < seqlen_q, other=0.0)
            b_delta = tl.load(delta_base + row_base + o_m, mask=o_m < seqlen_q, other=0.0)
        if FIX_LSE:  # each row's log of its recomputed probabilities' sum (``attn_bwd_dq_kernel``)
            if EVEN_M:
                b_lse_fix = tl.load(fix_base + row_base + o_m)  # [BLOCK_M]
            else:
                b_lse_fix = tl.load(fix_base + row_base + o_m, mask=o_m < seqlen_q, other=0.0)
        slope = 0.0
        if ALIBI:
            slope = tl.load(slope_base + g)
        if FORWARD_QK_ORDER:  # the forward's product, transposed: the same rounding as the logits its lse came from
            b_qk = tl.trans(tl.dot(b_q, tl.trans(b_k), input_precision="ieee"))  # [BLOCK_N, BLOCK_M]
        else:
            b_qk = tl.dot(b_k, tl.trans(b_q), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
        b_st, b_tt = scores(b_qk, o_m[None, :], o_n[:, None], seqlen_k, lo_offset, hi_offset, diag_offset,
                            sm_scale, softcap, slope, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI)
        if FIX_LSE:  # s - lse is exact where P matters (s near lse); the correction is small
            b_pt = tl.math.exp2(((b_st - b_lse[None, :]) - b_lse_fix[None, :]) * LOG2E)  # [BLOCK_N, BLOCK_M]
        else:
            b_pt = tl.math.exp2((b_st - b_lse[None, :]) * LOG2E)  # [BLOCK_N, BLOCK_M]
        if MASKED and EXACT_ONE_KEY:
            m_one = sees_one_key(o_m, seqlen_k, lo_offset, hi_offset, MASK_LEFT, MASK_RIGHT)[None, :]  # [1, BLOCK_M]
            b_pt = tl.where(m_one & (b_st > float("-inf")), 1.0, b_pt)
        if DROPOUT:
            # out uses P * keep / (1 - p): so do dV and, through dP, dS.
            m_keep = dropout_keep(seed, rng_base + row_base * rng_stride, o_m[None, :], o_n[:, None], rng_stride,
                                  dropout_p)
            b_pt_kept = tl.where(m_keep, b_pt / (1.0 - dropout_p), 0.0)
            b_dv = tl.dot(b_pt_kept.to(b_do.dtype), b_do, b_dv, input_precision="ieee")
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
            b_dpt = tl.where(m_keep, b_dpt / (1.0 - dropout_p), 0.0)
        else:
            b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv, input_precision="ieee")
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision="ieee")  # [BLOCK_N, BLOCK_M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED and EXACT_ONE_KEY:
            b_dst = tl.where(m_one, 0.0, b_dst)
        if SOFTCAP:
            b_dst = b_dst * (1.0 - b_tt * b_tt)
        if SINK_ROWS:  # sum_j P dP per query row, the keys past seqlen_k left out
            b_pdp = b_pt * b_dpt  # [BLOCK_N, BLOCK_M]
            if RAGGED_N:
                b_pdp = tl.where(o_n[:, None] < seqlen_k, b_pdp, 0.0)
            tl.atomic_add(sink_base + row_base + o_m, tl.sum(b_pdp, 0), mask=o_m < seqlen_q, sem="relaxed")
        if ATOMIC_DQ and RAGGED_N:
            b_dst = tl.where(o_n[:, None] < seqlen_k, b_dst, 0.0)
        b_dst = b_dst.to(b_q.dtype)
        b_dk = tl.dot(b_dst, b_q, b_dk, input_precision="ieee")
        if ATOMIC_DQ and DQ_TRANSPOSED:  # dQ^T = K^T dS^T: the head dim is the product's M
            b_dqt = tl.dot(tl.trans(b_k), b_dst, input_precision="ieee")  # [BLOCK_D, BLOCK_M]
            p_dqt = dq_base + g * stride_dqh + o_m[None, :].to(tl.int64) * stride_dqm + o_d[:, None]
            if EVEN_M and not MASK_D:
                tl.atomic_add(p_dqt, b_dqt * sm_scale, sem="relaxed")
            else:
                tl.atomic_add(p_dqt, b_dqt * sm_scale, mask=(o_m[None, :] < seqlen_q) & (o_d[:, None] < head_dim),
                              sem="relaxed")
        elif ATOMIC_DQ:
            b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision="ieee")  # [BLOCK_M, BLOCK_D]
            p_dq = dq_base + g * stride_dqh + o_m[:, None].to(tl.int64) * stride_dqm + o_d[None, :]
            if EVEN_M and not MASK_D:
                tl.atomic_add(p_dq, b_dq * sm_scale, sem="relaxed")
            else:
                tl.atomic_add(p_dq, b_dq * sm_scale, mask=(o_m[:, None] < seqlen_q) & (o_d[None, :] < head_dim),
                              sem="relaxed")
        if GROUPED:  # the next query block, or the next head's first
            start_m += BLOCK_M
            wrap = start_m >= end
            start_m = tl.where(wrap, start, start_m)
            g = tl.where(wrap, g + 1, g)
    return b_dk, b_dv


# The flags the dQ and dK/dV kernels derive alike (in order: later entries read earlier ones).
_DQ_DKDV_FLAGS = {
    # The variants a launch asks for by passing a tensor (absent tensors are None).
    "VARLEN": lambda a: a["CU_Q"] is not None,
    "ALIBI": lambda a: a["SLOPES"] is not None,
    "DROPOUT": lambda a: a["SEED"] is not None,
    "FIX_LSE": lambda a: a["LSE_FIX"] is not None,
    # Attention sinks: each row's sum of P dP, for their gradient (the dQ kernel's on the three
    # kernels' path, the dK/dV kernel's with atomics in one pass; the other gets None).
    "SINK_ROWS": lambda a: a["SINK_DELTA"] is not None,
    "EVEN_M": lambda a: not a["VARLEN"] and a["seqlen_q"] % a["BLOCK_M"] == 0,
    "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
}


@triton.jit
def dkdv_program(
    i_n, i_hk, i_b,
    Q, K, V, DO, LSE, DELTA, LSE_FIX, DK, DV, DQ_ACC, SINK_DELTA, SLOPES, CU_Q, CU_K, SEED,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqab, stride_dqam, stride_dqah,
    stride_lb, stride_lh, stride_sb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
    window_left, window_right, dropout_p, rng_stride,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    OWN_LSE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, MASK_D: tl.constexpr,
    EXACT_ONE_KEY: tl.constexpr, FORWARD_QK_ORDER: tl.constexpr, FIX_LSE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SINK_ROWS: tl.constexpr, GROUPED: tl.constexpr, DQ_TRANSPOSED: tl.constexpr, STAGES: tl.constexpr,
):
    """dK and dV of key block ``i_n`` of kv head ``i_hk`` in sequence ``i_b``: the body of
    ``attn_bwd_dkdv_kernel`` (its docstring), and of the one-launch backward's key-block programs."""
    tl.static_assert(not (ATOMIC_DQ and FIX_LSE), "FIX_LSE needs the dQ kernel's row sums first")
    bos_q, seqlen_q, bos_k, seqlen_k, diag_offset = sequences(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, total_q, total_k, diag_offset, VARLEN)
    k_start = i_n * BLOCK_N
    if VARLEN:
        if k_start >= seqlen_k:
            return
    lo_offset = diag_offset - window_left
    hi_offset = diag_offset + window_right
    i_b = i_b.to(tl.int64)
    o_n = k_start + tl.arange(0, BLOCK_N)  # key rows [BLOCK_N]
    o_c = tl.arange(0, BLOCK_N)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)

    k_base = K + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
    b_k = load_tile(k_base, k_start, stride_kn, seqlen_k, head_dim, o_c, o_d, not EVEN_N, MASK_D)  # [BLOCK_N, BLOCK_D]
    b_v = load_tile(v_base, k_start, stride_kn, seqlen_k, head_dim, o_c, o_d, not EVEN_N, MASK_D)  # [BLOCK_N, BLOCK_D]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    begin, full_begin, full_end, end = query_blocks(k_start, seqlen_q, lo_offset, hi_offset, MASK_LEFT, MASK_RIGHT,
                                                    BLOCK_M, BLOCK_N)
    if EXACT_ONE_KEY:  # a single key: every row sees only it, so every row goes to a masked stage (``_dkdv_inner``)
        full_begin = tl.where(seqlen_k == 1, end, full_begin)
        full_end = tl.where(seqlen_k == 1, end, full_end)

    # The group's first query head; ``_dkdv_inner`` walks its heads and their query blocks in one loop.
    i_h = (i_hk * group_size).to(tl.int64)
    q_base = Q + i_b * stride_qb + bos_q * stride_qm + i_h * stride_qh
    do_base = DO + i_b * stride_qb + bos_q * stride_qm + i_h * stride_qh
    lse_base = LSE + i_b * stride_lb + i_h * stride_lh + bos_q
    delta_base = DELTA + i_b * stride_lb + i_h * stride_lh + bos_q
    fix_base = LSE_FIX  # None unless FIX_LSE
    if FIX_LSE:
        fix_base = LSE_FIX + i_b * stride_lb + i_h * stride_lh + bos_q
    sink_base = SINK_DELTA  # None unless SINK_ROWS: laid out as LSE
    if SINK_ROWS:
        sink_base = SINK_DELTA + i_b * stride_lb + i_h * stride_lh + bos_q
    dq_base = DQ_ACC  # None unless ATOMIC_DQ
    if ATOMIC_DQ:
        dq_base = DQ_ACC + i_b * stride_dqab + bos_q * stride_dqam + i_h * stride_dqah
    slope_base = SLOPES  # None unless ALIBI
    if ALIBI:
        slope_base = SLOPES + i_b * stride_sb + i_h
    seed = 0
    rng_base = 0
    if DROPOUT:
        seed = tl.load(SEED)
        rng_base = (i_b * stride_lb + i_h * stride_lh + bos_q) * rng_stride
    # Rows that see part of the block (masked), all of it (unmasked), part of it again (masked).
    for stage in tl.static_range(3):
        lo, hi = stage_bounds(stage, begin, full_begin, full_end, end)
        b_dk, b_dv = _dkdv_inner(
            b_dk, b_dv, b_k, b_v, q_base, do_base, lse_base, delta_base, fix_base, dq_base, sink_base, slope_base,
            stride_qm, stride_dqam, stride_qh, stride_lh, stride_dqah, group_size, seqlen_q, seqlen_k, head_dim,
            lo_offset, hi_offset, diag_offset, sm_scale, softcap, o_n, o_r, o_d, lo, hi, seed, rng_base,
            rng_stride, dropout_p, stage != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, EVEN_M, MASK_D,
            BLOCK_M, EXACT_ONE_KEY, FORWARD_QK_ORDER, FIX_LSE, ATOMIC_DQ, not EVEN_N, SINK_ROWS, GROUPED,
            DQ_TRANSPOSED, STAGES,
        )

    dk_base = DK + i_b * stride_dkb + bos_k * stride_dkn + i_hk.to(tl.int64) * stride_dkh
    dv_base = DV + i_b * stride_dvb + bos_k * stride_dvn + i_hk.to(tl.int64) * stride_dvh
    store_tile(dk_base, k_start, stride_dkn, seqlen_k, head_dim, o_c, o_d, b_dk * sm_scale, not EVEN_N, MASK_D)
    store_tile(dv_base, k_start, stride_dvn, seqlen_k, head_dim, o_c, o_d, b_dv, not EVEN_N, MASK_D)


@triton.heuristics(
    {
        **_DQ_DKDV_FLAGS,
        "EVEN_N": lambda a: not a["VARLEN"] and a["seqlen_k"] % a["BLOCK_N"] == 0,
        # Exact one-key rows (``_dkdv_inner``) in fp32, whose accuracy rule the rounding exceeds, and
        # in any dtype where no row sees more than one key (a single key, a window of width one, one
        # causal query row aligned top-left), where torch's own dQ and dK are exactly 0 and so is the
        # bound's factor term. Otherwise fp16/bf16 bounds absorb the rounding, and their registers
        # are kept for the main loop (sm100 spills otherwise).
        "EXACT_ONE_KEY": lambda a: a["OWN_LSE"] and (a["Q"].element_size() == 4 or rows_see_one_key_at_most(
            a["seqlen_q"], a["seqlen_k"], a["diag_offset"], a["window_left"], a["window_right"], a["MASK_LEFT"],
            a["MASK_RIGHT"], a["VARLEN"])),
        # fp32 logits recomputed as the forward computed them (q . k, then transposed): P = exp(S -
        # lse) is exact only where S rounds as the forward's did; k . q rounds otherwise, which leaves
        # fp32 dV several times torch's error at large logits. fp16/bf16 keep the direct product.
        "FORWARD_QK_ORDER": lambda a: a["Q"].element_size() == 4,
        # The one-pass backward: dQ added to the fp32 workspace DQ_ACC (None: the dQ kernel computes it).
        "ATOMIC_DQ": lambda a: a["DQ_ACC"] is not None,
        # GQA/MQA: more than one query head per kv head, walked in ``_dkdv_inner``'s loop.
        "GROUPED": lambda a: a["group_size"] > 1,
    }
)
@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, LSE_FIX, DK, DV, DQ_ACC, SINK_DELTA, SLOPES, CU_Q, CU_K, SEED,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqab, stride_dqam, stride_dqah,
    stride_lb, stride_lh, stride_sb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
    window_left, window_right, dropout_p, rng_stride, fold_batch,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    OWN_LSE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, MASK_D: tl.constexpr,
    EXACT_ONE_KEY: tl.constexpr, FORWARD_QK_ORDER: tl.constexpr, FIX_LSE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    SINK_ROWS: tl.constexpr, GROUPED: tl.constexpr, DQ_TRANSPOSED: tl.constexpr, GRID_FOLD: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Grid ``(cdiv(max Sk, BLOCK_N), Hk, B)`` (folded: ``tiles.grid_id``); sums over the
    ``group_size`` query heads of each kv head. Key block 0, which a causal mask shows to every
    query block, launches first: heaviest first without reordering.

    With ``FIX_LSE`` it runs after ``attn_bwd_dq_kernel``, which stored in ``LSE_FIX`` (laid out as
    ``LSE``) the log of each row's recomputed probability sum, and takes ``P = exp((S - lse) - fix)``.
    With ``ATOMIC_DQ`` (the one-pass backward, no ``FIX_LSE``) it also adds every query row's dQ share
    from this key block into ``DQ_ACC``, fp32 laid out as ``Q`` (zeroed by the launcher); with
    ``DQ_TRANSPOSED`` as ``dQ^T = K^T dS^T``, whose M is the head dim rather than the query tile
    (the launcher's choice: ``configs.MMA_MIN_ROWS``). ``STAGES``: the launch's ``num_stages``.
    """
    i_n = grid_id(0, GRID_FOLD)
    i_hk = grid_id(1, GRID_FOLD)
    i_b = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    dkdv_program(
        i_n, i_hk, i_b, Q, K, V, DO, LSE, DELTA, LSE_FIX, DK, DV, DQ_ACC, SINK_DELTA, SLOPES, CU_Q, CU_K, SEED,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_dkb, stride_dkn, stride_dkh,
        stride_dvb, stride_dvn, stride_dvh, stride_dqab, stride_dqam, stride_dqah, stride_lb, stride_lh, stride_sb,
        nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
        window_left, window_right, dropout_p, rng_stride, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN,
        BLOCK_M, BLOCK_N, BLOCK_D, OWN_LSE, EVEN_M, EVEN_N, MASK_D, EXACT_ONE_KEY, FORWARD_QK_ORDER, FIX_LSE, ATOMIC_DQ,
        SINK_ROWS, GROUPED, DQ_TRANSPOSED, STAGES,
    )


@triton.jit
def _dq_inner(
    b_dq, b_psum, b_pdp, b_q, b_do, b_lse, b_delta, k_base, v_base, stride_kn, seqlen_k, head_dim,
    lo_offset, hi_offset, diag_offset, sm_scale, softcap, slope, o_m, o_n, o_d, start, end,
    seed, rng_base, rng_stride, dropout_p,
    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, MASK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FIX_LSE: tl.constexpr, SINK_ROWS: tl.constexpr,
):
    """Accumulate ``dQ`` over keys ``[start, end)``; ``MASKED`` applies the sequence and window masks.
    With ``FIX_LSE`` also each row's sum of the recomputed probabilities, ``b_psum [BLOCK_M]``; with
    ``SINK_ROWS`` each row's sum of P dP, ``b_pdp [BLOCK_M]`` (masked keys have P = 0)."""
    for start_n in range(loop_bound(start), loop_bound(end), BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        b_k = load_tile(k_base, start_n, stride_kn, seqlen_k, head_dim, o_n, o_d, MASKED, MASK_D)  # [BLOCK_N, BLOCK_D]
        b_v = load_tile(v_base, start_n, stride_kn, seqlen_k, head_dim, o_n, o_d, MASKED, MASK_D)  # [BLOCK_N, BLOCK_D]
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        b_s, b_t = scores(b_qk, o_m[:, None], (start_n + o_n)[None, :], seqlen_k, lo_offset, hi_offset, diag_offset,
                          sm_scale, softcap, slope, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI)
        b_p = tl.math.exp2((b_s - b_lse[:, None]) * LOG2E)  # [BLOCK_M, BLOCK_N]
        if FIX_LSE:
            b_psum += tl.sum(b_p, 1)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        if DROPOUT:
            m_keep = dropout_keep(seed, rng_base, o_m[:, None], (start_n + o_n)[None, :], rng_stride, dropout_p)
            b_dp = tl.where(m_keep, b_dp / (1.0 - dropout_p), 0.0)
        if SINK_ROWS:
            b_pdp += tl.sum(b_p * b_dp, 1)
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            b_ds = b_ds * (1.0 - b_t * b_t)
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision="ieee")
    return b_dq, b_psum, b_pdp


@triton.jit
def dq_program(
    i_m, i_h, i_b,
    Q, K, V, DO, LSE, DELTA, LSE_FIX, DQ, SLOPES, CU_Q, CU_K, SEED, SINKS, SINK_DELTA,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_sb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
    window_left, window_right, dropout_p, rng_stride,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    OWN_LSE: tl.constexpr, EVEN_M: tl.constexpr, MASK_D: tl.constexpr, FIX_LSE: tl.constexpr,
    SINK_ROWS: tl.constexpr, SINK_LOGITS: tl.constexpr,
):
    """dQ of query block ``i_m`` of head ``i_h`` in sequence ``i_b``: the body of
    ``attn_bwd_dq_kernel`` (its docstring), and of the one-launch backward's query-block programs."""
    bos_q, seqlen_q, bos_k, seqlen_k, diag_offset = sequences(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, total_q, total_k, diag_offset, VARLEN)
    q_start = i_m * BLOCK_M
    if VARLEN:
        if q_start >= seqlen_q:
            return
    lo_offset = diag_offset - window_left
    hi_offset = diag_offset + window_right
    i_b = i_b.to(tl.int64)
    i_hk = i_h // group_size
    o_m = q_start + tl.arange(0, BLOCK_M)  # query rows [BLOCK_M]
    o_r = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)

    q_base = Q + i_b * stride_qb + bos_q * stride_qm + i_h.to(tl.int64) * stride_qh
    do_base = DO + i_b * stride_qb + bos_q * stride_qm + i_h.to(tl.int64) * stride_qh
    k_base = K + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
    b_q = load_tile(q_base, q_start, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D)  # [BLOCK_M, BLOCK_D]
    b_do = load_tile(do_base, q_start, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D)  # like b_q
    row_base = i_b * stride_lb + i_h.to(tl.int64) * stride_lh + bos_q
    if EVEN_M:
        b_lse = tl.load(LSE + row_base + o_m)  # [BLOCK_M]
        b_delta = tl.load(DELTA + row_base + o_m)  # [BLOCK_M]
    else:
        b_lse = tl.load(LSE + row_base + o_m, mask=o_m < seqlen_q, other=0.0)
        b_delta = tl.load(DELTA + row_base + o_m, mask=o_m < seqlen_q, other=0.0)
    if OWN_LSE:
        # A row that sees one key has dS = 0 exactly (see ``sees_one_key``): with lse = +inf its P,
        # which here feeds dS only, is 0.
        b_lse = tl.where(sees_one_key(o_m, seqlen_k, lo_offset, hi_offset, MASK_LEFT, MASK_RIGHT), float("inf"),
                         b_lse)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + i_b * stride_sb + i_h)
    seed = 0
    rng_base = 0
    if DROPOUT:
        seed = tl.load(SEED)
        rng_base = row_base * rng_stride
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_psum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_pdp = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FIX_LSE and SINK_LOGITS:
        b_psum = tl.math.exp2((tl.load(SINKS + i_h).to(tl.float32) - b_lse) * LOG2E)  # [BLOCK_M]

    begin, full_begin, full_end, end = key_blocks(q_start, q_start + BLOCK_M - 1, seqlen_k, lo_offset, hi_offset,
                                                  MASK_LEFT, MASK_RIGHT, BLOCK_N)
    for stage in tl.static_range(3):
        lo, hi = stage_bounds(stage, begin, full_begin, full_end, end)
        b_dq, b_psum, b_pdp = _dq_inner(
            b_dq, b_psum, b_pdp, b_q, b_do, b_lse, b_delta, k_base, v_base, stride_kn, seqlen_k, head_dim,
            lo_offset, hi_offset, diag_offset, sm_scale, softcap, slope, o_m, o_n, o_d, lo, hi,
            seed, rng_base, rng_stride, dropout_p,
            stage != 1, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, MASK_D, BLOCK_N, FIX_LSE, SINK_ROWS,
        )
    dq_base = DQ + i_b * stride_dqb + bos_q * stride_dqm + i_h.to(tl.int64) * stride_dqh
    store_tile(dq_base, q_start, stride_dqm, seqlen_q, head_dim, o_r, o_d, b_dq * sm_scale, not EVEN_M, MASK_D)
    if FIX_LSE:
        b_fix = tl.where(b_psum > 0.0, tl.log(tl.where(b_psum > 0.0, b_psum, 1.0)), 0.0)  # [BLOCK_M]
        if EVEN_M:
            tl.store(LSE_FIX + row_base + o_m, b_fix)
        else:
            tl.store(LSE_FIX + row_base + o_m, b_fix, mask=o_m < seqlen_q)
    if SINK_ROWS:  # [BLOCK_M]
        if FIX_LSE:
            b_pdp = b_pdp / tl.where(b_psum > 0.0, b_psum, 1.0)
        if EVEN_M:
            tl.store(SINK_DELTA + row_base + o_m, b_pdp)
        else:
            tl.store(SINK_DELTA + row_base + o_m, b_pdp, mask=o_m < seqlen_q)


@triton.heuristics(
    {
        **_DQ_DKDV_FLAGS,
        "SINK_LOGITS": lambda a: a["SINKS"] is not None,
        "HEAD_SECTIONS": lambda a: a["head_section"] > 1,
    }
)
@triton.jit(do_not_specialize=["head_section"])  # a runtime count: no variant per value
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, LSE_FIX, DQ, SLOPES, CU_Q, CU_K, SEED, SINKS, SINK_DELTA,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh, stride_sb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
    window_left, window_right, dropout_p, rng_stride, head_section, fold_batch,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    OWN_LSE: tl.constexpr, EVEN_M: tl.constexpr, MASK_D: tl.constexpr, FIX_LSE: tl.constexpr,
    SINK_ROWS: tl.constexpr, SINK_LOGITS: tl.constexpr, HEAD_SECTIONS: tl.constexpr, GRID_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(max Sq, BLOCK_M), H, B)``, its programs in ``schedule.launch_order``'s order, as
    the forward's.

    With ``FIX_LSE`` (fp32, own lse) it also stores in ``LSE_FIX`` (laid out as ``LSE``) the log of
    each row's sum of ``exp(S - lse)``: 0 up to the rounding of the stored lse, which at logits in
    the hundreds is an ulp of a few 1e-5, a row-wide factor on P. ``attn_bwd_dkdv_kernel`` divides
    it out, so its P sums to 1 as the forward's softmax did and fp32 dV keeps torch's accuracy;
    rows with no probability (no key, or one key with ``OWN_LSE``) store 0. With ``SINK_LOGITS``
    (``SINKS (H,)``, passed with ``FIX_LSE`` only, the one use of it here) each row's sum starts at
    its sink's probability ``exp(sink - lse)``, so the fix makes P and the sink's share sum to 1.

    With ``SINK_ROWS`` (attention sinks, the three kernels' path) it stores in ``SINK_DELTA`` (laid
    out as ``LSE``) each row's ``sum_j P dP`` over all the row's keys, for the sinks' gradient
    (``backward_launch._sink_grad``): one store per row, no atomics. With ``FIX_LSE`` that sum is of
    the renormalised P, ``P / psum``, as ``attn_bwd_dkdv_kernel``'s.
    """
    i_m, _, i_h, i_b = launch_order(1, head_section, HEAD_SECTIONS, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding (``tiles.grid_id``)
        if i_b >= fold_batch:
            return
    dq_program(
        i_m, i_h, i_b, Q, K, V, DO, LSE, DELTA, LSE_FIX, DQ, SLOPES, CU_Q, CU_K, SEED, SINKS, SINK_DELTA,
        stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_dqb, stride_dqm, stride_dqh,
        stride_lb, stride_lh, stride_sb, nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim,
        sm_scale, softcap, diag_offset, window_left, window_right, dropout_p, rng_stride, MASK_LEFT, MASK_RIGHT,
        SOFTCAP, ALIBI, DROPOUT, VARLEN, BLOCK_M, BLOCK_N, BLOCK_D, OWN_LSE, EVEN_M, MASK_D, FIX_LSE, SINK_ROWS,
        SINK_LOGITS,
    )
