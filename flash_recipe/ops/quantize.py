"""INT8 quantization of Q and K per block of rows, with K smoothing: step 2 of 8-bit attention
(``flash_recipe.reference_int8`` defines the method; this kernel does the same arithmetic).

Shapes (legend: B batch, S length, H heads, D head dim, nb = cdiv(S, BLOCK) blocks)::

    x (B, S, H, D) or packed (total, H, D)   ->   x8 (..., BD) int8, scales (B, H, nb) float32

``x8``'s last dim is ``BD``, the head dim padded to the kernels' tile (``block_d_of``), its padding
stored as 0: the attention kernel then loads whole rows, with no column mask in its loop.

Each program owns ``BLOCK`` rows of one head of one sequence: it subtracts ``MEAN[b, h]``
(smoothing, K only), multiplies by ``multiplier`` (Q: ``softmax_scale * log2(e)``), takes the
block's largest magnitude, stores ``scale = absmax / 127`` and ``round(x / scale)`` with halves
rounded away from zero. Rows past the sequence (the last block's padding) count as 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import launch_once
from .tiles import grid_id, sequence


@triton.heuristics(
    {
        "VARLEN": lambda a: a["CU"] is not None,
        "SMOOTH": lambda a: a["MEAN"] is not None,
        "EVEN": lambda a: a["CU"] is None and a["seqlen"] % a["BLOCK"] == 0,
        "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
    }
)
@triton.jit
def quantize_kernel(
    X, X8, SCALE, MEAN, CU,
    stride_xb, stride_xs, stride_xh, stride_yb, stride_ys, stride_yh, stride_cb, stride_ch, stride_mb, stride_mh,
    seqlen, total, head_dim, multiplier, fold_batch,
    VARLEN: tl.constexpr, SMOOTH: tl.constexpr, EVEN: tl.constexpr, MASK_D: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, GRID_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(max S, BLOCK), H, B)`` (folded: ``tiles.grid_id``). ``X``/``X8`` dense ``(B, S, H, D)`` or, with
    ``VARLEN``, packed with sequence ``b`` in rows ``CU[b]:CU[b+1]`` (batch strides 0);
    ``SCALE[b * stride_cb + h * stride_ch + block]``; ``MEAN[b * stride_mb + h * stride_mh + d]``
    (fp32) or None."""
    i_blk = grid_id(0, GRID_FOLD)
    i_h = grid_id(1, GRID_FOLD).to(tl.int64)
    i_b = grid_id(2, GRID_FOLD).to(tl.int64)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    bos, seqlen = sequence(CU, i_b, seqlen, total, VARLEN)
    row0 = i_blk * BLOCK
    if VARLEN:
        if row0 >= seqlen:
            return
    o_r = row0 + tl.arange(0, BLOCK)
    o_d = tl.arange(0, BLOCK_D)
    m_x = (o_r[:, None] < seqlen) & (o_d[None, :] < head_dim)  # [BLOCK, BLOCK_D]
    p_x = X + i_b * stride_xb + i_h * stride_xh + (bos + o_r.to(tl.int64))[:, None] * stride_xs + o_d[None, :]
    if EVEN and not MASK_D:
        b_x = tl.load(p_x).to(tl.float32)
    else:
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    if SMOOTH:
        b_mean = tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + o_d, mask=o_d < head_dim, other=0.0)
        b_x = tl.where(m_x, b_x - b_mean[None, :], 0.0)
    b_x = b_x * multiplier
    absmax = tl.max(tl.max(tl.abs(b_x), 1), 0)
    # Both divisions round to nearest (``div_rn``), as torch's fp32 division does: a plain ``/``
    # compiles to a faster division that is not correctly rounded (``div.full.f32`` on NVIDIA).
    scale = tl.where(absmax > 0.0, tl.math.div_rn(absmax, 127.0), 1.0)
    b_y = tl.math.div_rn(b_x, scale)
    b_y = b_y + tl.where(b_y >= 0.0, 0.5, -0.5)
    b_q = b_y.to(tl.int8)  # truncation toward zero: with the half added, round half away from zero
    p_y = X8 + i_b * stride_yb + i_h * stride_yh + (bos + o_r.to(tl.int64))[:, None] * stride_ys + o_d[None, :]
    if EVEN:  # the padded columns get their zeros too
        tl.store(p_y, b_q)
    else:
        tl.store(p_y, b_q, mask=(o_r < seqlen)[:, None])
    tl.store(SCALE + i_b * stride_cb + i_h * stride_ch + i_blk, scale)


# The smallest padded head dim of an INT8 tile: the integer mma's K is 32 bytes.
MIN_BLOCK_D = 32


def block_d_of(head_dim: int) -> int:
    """The padded head dim the INT8 kernels are compiled for: a power of two, at least 32."""
    return max(MIN_BLOCK_D, triton.next_power_of_2(head_dim))


def quantize_args(
    x: torch.Tensor, x8: torch.Tensor, scales: torch.Tensor, block: int, multiplier: float,
    mean: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
) -> tuple[tuple, dict]:
    """The grid and keyword arguments of ``quantize_kernel`` for ``x`` into ``x8`` and ``scales``."""
    packed = cu_seqlens is not None
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else x.shape[0]

    def strides(t):
        return (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))

    (sxb, sxs, sxh), (syb, sys_, syh) = strides(x), strides(x8)
    grid = (triton.cdiv(max_seqlen, block), x.shape[-2], batch)
    args = dict(
        X=x, X8=x8, SCALE=scales, MEAN=mean, CU=cu_seqlens,
        stride_xb=sxb, stride_xs=sxs, stride_xh=sxh, stride_yb=syb, stride_ys=sys_, stride_yh=syh,
        stride_cb=scales.stride(0), stride_ch=scales.stride(1),
        stride_mb=mean.stride(0) if mean is not None else 0, stride_mh=mean.stride(1) if mean is not None else 0,
        seqlen=x.shape[1] if not packed else max_seqlen, total=x.shape[0] if packed else 0,
        head_dim=x.shape[-1], multiplier=multiplier, BLOCK=block, BLOCK_D=block_d_of(x.shape[-1]),
        num_warps=4,
    )
    return grid, args


def quantize_blocks(
    x: torch.Tensor, block: int, multiplier: float = 1.0, mean: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_int8.quantize_blocks`` on the kernel: ``(x8 (..., BD), scales (B, H, nb))``, x8's
    columns past the head dim 0."""
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError("quantize_blocks: packed sequences (cu_seqlens) need max_seqlen")
    length = int(max_seqlen) if cu_seqlens is not None and max_seqlen is not None else x.shape[1]
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else x.shape[0]
    x8 = torch.zeros(x.shape[:-1] + (block_d_of(x.shape[-1]),), dtype=torch.int8, device=x.device)
    scales = torch.ones((batch, x.shape[-2], max(triton.cdiv(length, block), 1)), dtype=torch.float32,
                        device=x.device)
    if x.numel() == 0 or length == 0:
        return x8, scales
    grid, args = quantize_args(x, x8, scales, block, multiplier, mean, cu_seqlens, length)
    launch_once(quantize_kernel, grid, dict(**args), x.device)  # keywords: quantize_args' dict(...)
    return x8, scales
