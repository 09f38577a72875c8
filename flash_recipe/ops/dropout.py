"""The dropout mask as the attention kernels draw it, materialised (for ``return_attn_probs``).

Shapes: ``keep (B, H, Sq, Sk)`` bool, entry ``(b, h, i, j)`` drawn from ``seed`` at offset
``((b * H + h) * Sq + i) * Sk + j``, the offset the dense kernels use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_once
from .tiles import dropout_keep, grid_id


@triton.jit
def dropout_mask_kernel(KEEP, SEED, seqlen_q, seqlen_k, dropout_p, fold_batch, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, GRID_FOLD: tl.constexpr):
    """Grid ``(cdiv(Sq, BLOCK_M) * cdiv(Sk, BLOCK_N), 1, B * H)`` (folded: ``tiles.grid_id``), the
    query block major on axis 0; ``KEEP`` is ``(B * H, Sq, Sk)`` int8."""
    i_mn = grid_id(0, GRID_FOLD)
    i_bh = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_bh >= fold_batch:
            return
    n_n = tl.cdiv(seqlen_k, BLOCK_N)
    i_m = i_mn // n_n
    i_n = i_mn % n_n
    i_bh = i_bh.to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_keep = dropout_keep(tl.load(SEED), i_bh * seqlen_q * seqlen_k, o_m[:, None], o_n[None, :], seqlen_k, dropout_p)
    p_keep = KEEP + i_bh * seqlen_q * seqlen_k + o_m[:, None].to(tl.int64) * seqlen_k + o_n[None, :]
    tl.store(p_keep, m_keep.to(tl.int8), mask=(o_m[:, None] < seqlen_q) & (o_n[None, :] < seqlen_k))


def dropout_mask(
    seed: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float
) -> torch.Tensor:
    """The keep mask ``(B, H, Sq, Sk)`` bool that the dense kernels apply for ``seed``."""
    keep = torch.empty((batch * nheads, seqlen_q, seqlen_k), dtype=torch.int8, device=seed.device)
    if keep.numel():
        grid = (triton.cdiv(seqlen_q, 32) * triton.cdiv(seqlen_k, 32), 1, batch * nheads)
        launch_once(dropout_mask_kernel, grid, dict(KEEP=keep, SEED=seed, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                                    dropout_p=dropout_p, BLOCK_M=32, BLOCK_N=32), seed.device)
    return keep.view(batch, nheads, seqlen_q, seqlen_k).bool()
