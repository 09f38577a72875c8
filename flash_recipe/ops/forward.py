"""FlashAttention-2 forward: tiled over keys with an online softmax.

Shapes (legend: B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim)::

    q (B, Sq, H, D)   k, v (B, Sk, Hk, D)   ->   out (B, Sq, H, D), lse (B, H, Sq) float32

Query head ``h`` reads key/value head ``h // (H // Hk)`` (contiguous groups, as flash-attn).

Each program owns ``BLOCK_M`` query rows of one head and walks the key blocks it can see, keeping
per row a running maximum ``m``, a running sum ``l`` and an accumulator rescaled whenever ``m``
grows. Scores live in the base-2 domain: ``log2(e)`` is folded into the softmax scale once so
the kernel uses ``exp2``; the log-sum-exp is converted back to natural log when stored. Every
dot runs with ``input_precision="ieee"``: fp16/bf16 still use the tensor cores, and fp32 is
multiplied in full fp32, never TF32.

A row that sees no key (causal with Sq > Sk, or Sk == 0) outputs 0 and stores lse = +inf, which
makes every probability the backward recomputes from it exactly 0.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from flash_recipe.ops import configs
from flash_recipe.ops import tiles
from flash_recipe.ops.tiles import key_range, load_tile, store_tile

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _fwd_inner(
    b_acc, b_m, b_l, b_q, k_base, v_base, stride_kn, stride_vn, seqlen_k, head_dim, diag_offset,
    o_m, o_n, o_d, qk_scale, start, end,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One stage of the key loop over ``[start, end)``; ``MASKED`` applies the seqlen and causal masks."""
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        b_k = load_tile(k_base, start_n, stride_kn, seqlen_k, head_dim, o_n, o_d, MASKED, MASK_D)  # [BLOCK_N, BLOCK_D]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            m_valid = (start_n + o_n)[None, :] < seqlen_k
            if IS_CAUSAL:
                m_valid = m_valid & ((start_n + o_n)[None, :] <= o_m[:, None] + diag_offset)
            b_s = tl.where(m_valid, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        if MASKED:
            # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid inf - inf.
            b_m_new = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_m_new[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.math.exp2(b_m - b_m_new)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = load_tile(v_base, start_n, stride_vn, seqlen_k, head_dim, o_n, o_d, MASKED, MASK_D)  # [BLOCK_N, BLOCK_D]
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision="ieee")
        b_m = b_m_new
    return b_acc, b_m, b_l


@triton.heuristics(
    {
        "EVEN_M": lambda a: a["seqlen_q"] % a["BLOCK_M"] == 0,
        "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
    }
)
@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, qk_scale, diag_offset,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr, MASK_D: tl.constexpr,
):
    """Grid ``(cdiv(Sq, BLOCK_M), H, B)``. ``qk_scale`` is ``softmax_scale * log2(e)``."""
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // group_size
    q_start = i_m * BLOCK_M

    o_m = q_start + tl.arange(0, BLOCK_M)  # query rows [BLOCK_M]
    o_r = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)

    q_base = Q + i_b * stride_qb + i_h.to(tl.int64) * stride_qh
    k_base = K + i_b * stride_kb + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b * stride_vb + i_hk.to(tl.int64) * stride_vh
    b_q = load_tile(q_base, q_start, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, MASK_D)  # [BLOCK_M, BLOCK_D]

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_end, end = key_range(q_start, seqlen_k, diag_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    # Stage 1: key blocks every row sees in full, no masks.
    b_acc, b_m, b_l = _fwd_inner(
        b_acc, b_m, b_l, b_q, k_base, v_base, stride_kn, stride_vn, seqlen_k, head_dim, diag_offset,
        o_m, o_n, o_d, qk_scale, 0, full_end,
        False, IS_CAUSAL, MASK_D, BLOCK_N,
    )
    # Stage 2: the diagonal and the ragged last block, masked.
    b_acc, b_m, b_l = _fwd_inner(
        b_acc, b_m, b_l, b_q, k_base, v_base, stride_kn, stride_vn, seqlen_k, head_dim, diag_offset,
        o_m, o_n, o_d, qk_scale, full_end, end,
        True, IS_CAUSAL, MASK_D, BLOCK_N,
    )

    m_empty = b_l == 0.0  # rows that saw no key
    b_l_safe = tl.where(m_empty, 1.0, b_l)
    b_out = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    b_lse = tl.where(m_empty, float("inf"), (b_m + tl.math.log2(b_l_safe)) * 0.6931471805599453)  # [BLOCK_M]

    o_base = O + i_b * stride_ob + i_h.to(tl.int64) * stride_oh
    store_tile(o_base, q_start, stride_om, seqlen_q, head_dim, o_r, o_d, b_out, not EVEN_M, MASK_D)
    p_lse = LSE + (i_b * nheads + i_h) * seqlen_q + o_m
    if EVEN_M:
        tl.store(p_lse, b_lse)
    else:
        tl.store(p_lse, b_lse, mask=o_m < seqlen_q)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, diag_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Inputs are validated by the caller (see ``flash_recipe.api``).

    Args:
        q: ``(B, Sq, H, D)``; k, v: ``(B, Sk, Hk, D)``; last dim contiguous, ``H % Hk == 0``.
        softmax_scale: multiplies ``q @ k^T`` before the softmax.
        causal: apply the causal mask ``j <= i + diag_offset``.
        diag_offset: ``Sk - Sq`` for flash-attn's bottom-right alignment, ``0`` for top-left.

    Returns:
        ``out (B, Sq, H, D)`` in q's dtype and ``lse (B, H, Sq)`` float32 (natural log).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    out = tiles.output_buffer((batch, seqlen_q, nheads, head_dim), q.dtype, q.device)
    lse = tiles.output_buffer((batch, nheads, seqlen_q), torch.float32, q.device)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out, lse
    cfg = configs.get_config(configs.target_of(q.device), "fwd", head_dim, q.element_size())
    grid = (triton.cdiv(seqlen_q, cfg.block_m), nheads, batch)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        attn_fwd_kernel[grid](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            nheads, nheads // nheads_k, seqlen_q, seqlen_k, head_dim, softmax_scale * LOG2E, diag_offset,
            IS_CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_D=configs.head_dim_bucket(head_dim),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out, lse
