"""The one-launch backward: dK/dV and dQ in one launch of two kinds of programs, without atomics
(its launcher: ``backward_launch``, the path ``"one_launch"``).

Shapes as in ``backward``. After ``attn_bwd_preprocess_kernel`` (``delta``), one launch whose
grid's axis 0 holds two kinds of programs, per kv head ``i_hk`` and sequence ``i_b``:

- programs ``[0, key_programs)``: key block ``i`` of ``BLOCK_N`` keys; dK and dV over the query
  blocks (``BLOCK_M`` rows a step) of every query head in the kv head's group, as
  ``attn_bwd_dkdv_kernel`` (``backward.dkdv_program``);
- programs from ``key_programs`` on: query block ``j // group_size`` of query head ``i_hk *
  group_size + j % group_size``, ``BLOCK_N`` rows; dQ over the key blocks (``BLOCK_M`` keys a
  step), as ``attn_bwd_dq_kernel`` (``backward.dq_program``), written once in q's dtype.

So the tile of both kinds is ``BLOCK_M x BLOCK_N`` (keys x queries for dK/dV, queries x keys for
dQ), as FlexAttention's backward pairs its blocks (M1 = N2, N1 = M2). Every pair of blocks is
computed twice, as in the three kernels (7 matrix products per pair), but in one launch: the dQ
programs fill the GPU while the long dK/dV programs run, and no program waits on another. No
program adds to memory another writes, so the gradients are bit-identical from run to run, dsink
included (the dQ programs store each row's sum of P dP once).

Not taken with ``FIX_LSE`` (fp32 with its own lse: dK/dV needs dQ's row sums first), where the
launcher runs the three kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward import _DQ_DKDV_FLAGS, dkdv_program, dq_program
from .tiles import grid_id, rows_see_one_key_at_most


@triton.heuristics(
    {
        **_DQ_DKDV_FLAGS,
        "EVEN_N": lambda a: not a["VARLEN"] and a["seqlen_k"] % a["BLOCK_N"] == 0,
        # The dQ programs' query tile is BLOCK_N rows.
        "EVEN_Q_TILE": lambda a: not a["VARLEN"] and a["seqlen_q"] % a["BLOCK_N"] == 0,
        # As attn_bwd_dkdv_kernel's (its comments).
        "EXACT_ONE_KEY": lambda a: a["OWN_LSE"] and (a["Q"].element_size() == 4 or rows_see_one_key_at_most(
            a["seqlen_q"], a["seqlen_k"], a["diag_offset"], a["window_left"], a["window_right"], a["MASK_LEFT"],
            a["MASK_RIGHT"], a["VARLEN"])),
        "FORWARD_QK_ORDER": lambda a: a["Q"].element_size() == 4,
        "GROUPED": lambda a: a["group_size"] > 1,
    }
)
@triton.jit
def attn_bwd_one_launch_kernel(
    Q, K, V, DO, LSE, DELTA, LSE_FIX, DQ, DK, DV, SINK_DELTA, SLOPES, CU_Q, CU_K, SEED,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_sb,
    nheads, group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset,
    window_left, window_right, dropout_p, rng_stride, key_programs, fold_batch,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    OWN_LSE: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_Q_TILE: tl.constexpr,
    MASK_D: tl.constexpr, EXACT_ONE_KEY: tl.constexpr, FORWARD_QK_ORDER: tl.constexpr, FIX_LSE: tl.constexpr,
    SINK_ROWS: tl.constexpr, GROUPED: tl.constexpr, GRID_FOLD: tl.constexpr, STAGES: tl.constexpr,
):
    """Grid ``(key_programs + group_size * cdiv(max Sq, BLOCK_N), Hk, B)`` (folded:
    ``tiles.grid_id``), ``key_programs = cdiv(max Sk, BLOCK_N)``: the module docstring's two kinds
    of programs, the key blocks first (key block 0, which a causal mask shows to every query
    block, the very first). ``LSE_FIX`` is None (no ``FIX_LSE``); ``STAGES`` is the launch's
    ``num_stages``, as ``attn_bwd_dkdv_kernel``'s."""
    tl.static_assert(not FIX_LSE, "FIX_LSE needs the dQ kernel's row sums before dK/dV: the three kernels")
    i_p = grid_id(0, GRID_FOLD)
    i_hk = grid_id(1, GRID_FOLD)
    i_b = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    if i_p < key_programs:
        dkdv_program(
            i_p, i_hk, i_b, Q, K, V, DO, LSE, DELTA, LSE_FIX, DK, DV, None, None, SLOPES, CU_Q, CU_K, SEED,
            stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_dkb, stride_dkn, stride_dkh,
            stride_dvb, stride_dvn, stride_dvh, 0, 0, 0, stride_lb, stride_lh, stride_sb, nheads, group_size, seqlen_q,
            seqlen_k, total_q, total_k, head_dim, sm_scale, softcap, diag_offset, window_left, window_right, dropout_p,
            rng_stride,
            MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN, BLOCK_M, BLOCK_N, BLOCK_D, OWN_LSE, EVEN_M,
            EVEN_N, MASK_D, EXACT_ONE_KEY, FORWARD_QK_ORDER, False, False, False, GROUPED, False, STAGES,
        )
    else:
        j = i_p - key_programs
        i_h = i_hk * group_size + j % group_size
        dq_program(
            j // group_size, i_h, i_b, Q, K, V, DO, LSE, DELTA, LSE_FIX, DQ, SLOPES, CU_Q, CU_K, SEED, None,
            SINK_DELTA, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_dqb, stride_dqm,
            stride_dqh, stride_lb, stride_lh, stride_sb, nheads, group_size, seqlen_q, seqlen_k, total_q, total_k,
            head_dim, sm_scale, softcap, diag_offset, window_left, window_right, dropout_p, rng_stride,
            MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN, BLOCK_N, BLOCK_M, BLOCK_D, OWN_LSE,
            EVEN_Q_TILE, MASK_D, False, SINK_ROWS, False,
        )
