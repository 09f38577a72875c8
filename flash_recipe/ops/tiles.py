"""Triton helpers shared by the forward and backward kernels: tile loads/stores and loop bounds.

Conventions used by every kernel in ``flash_recipe.ops``:

- tensors are ``(batch, seqlen, nheads, head_dim)`` with arbitrary strides except a contiguous last
  dim; a kernel receives the batch, sequence and head strides;
- a tile is ``[BLOCK_ROWS, BLOCK_D]`` rows of one head; ``BLOCK_D`` is the head dim rounded up to a
  power of two and the padded columns are masked (loaded as 0, never stored);
- the first row of a tile is addressed with a 64-bit scalar offset, so tensors of more than 2**31
  elements address correctly while the per-element offsets inside a tile stay 32-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def output_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output; every element is written by the kernel (tests fill it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def load_tile(base, row0, stride_row, n_rows, head_dim, o_r, o_d, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    """Load rows ``row0 + o_r`` of one head as a ``[len(o_r), len(o_d)]`` tile, 0 outside."""
    p_x = base + row0.to(tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
    if MASK_ROWS:
        if MASK_D:
            return tl.load(p_x, mask=((row0 + o_r)[:, None] < n_rows) & (o_d[None, :] < head_dim), other=0.0)
        else:
            return tl.load(p_x, mask=(row0 + o_r)[:, None] < n_rows, other=0.0)
    else:
        if MASK_D:
            return tl.load(p_x, mask=o_d[None, :] < head_dim, other=0.0)
        else:
            return tl.load(p_x)


@triton.jit
def store_tile(base, row0, stride_row, n_rows, head_dim, o_r, o_d, b_x, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    """Store the tile ``b_x`` into rows ``row0 + o_r`` of one head, skipping padding."""
    p_x = base + row0.to(tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
    b_x = b_x.to(p_x.dtype.element_ty)
    if MASK_ROWS:
        if MASK_D:
            tl.store(p_x, b_x, mask=((row0 + o_r)[:, None] < n_rows) & (o_d[None, :] < head_dim))
        else:
            tl.store(p_x, b_x, mask=(row0 + o_r)[:, None] < n_rows)
    else:
        if MASK_D:
            tl.store(p_x, b_x, mask=o_d[None, :] < head_dim)
        else:
            tl.store(p_x, b_x)


@triton.jit
def key_range(q_start, seqlen_k, diag_offset, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks that query rows ``[q_start, q_start + BLOCK_M)`` must visit.

    Returns ``(full_end, end)``: keys ``[0, full_end)`` are visible to every row of the block and
    lie in whole ``BLOCK_N`` blocks, so they need no mask; keys ``[full_end, end)`` need the
    sequence-length and causal masks. With ``IS_CAUSAL``, query ``i`` sees key ``j`` iff
    ``j <= i + diag_offset`` (``diag_offset = seqlen_k - seqlen_q`` aligns the diagonal
    bottom-right as flash-attn does, ``0`` aligns it top-left as torch SDPA does).
    """
    if IS_CAUSAL:
        end = tl.minimum(q_start + BLOCK_M + diag_offset, seqlen_k)
        end = tl.maximum(end, 0)
        full_end = tl.minimum(tl.maximum(q_start + diag_offset + 1, 0), end)
    else:
        end = seqlen_k
        full_end = seqlen_k
    full_end = (full_end // BLOCK_N) * BLOCK_N
    return full_end, end
