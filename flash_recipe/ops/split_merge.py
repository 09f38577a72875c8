"""Split-KV's second kernel: the merge of the shares' partial outputs, and its launcher.

A decoding step over a long KV cache launches few programs, so the forward over the cache
(``forward.attn_fwd_kernel`` with ``num_splits > 1``) gives each row's keys to ``num_splits``
programs, each writing the normalised output and log-sum-exp of its share of the keys into float32
buffers one split deep. ``split_combine_kernel`` merges them into the call's ``out`` and ``lse``.
``plan_split_merge`` decides its launch when ``forward.plan_forward`` plans a split forward, and
``launch_split_merge`` runs it after the shares (``forward.run_forward``). How many splits a step
takes is the rule in ``flash_recipe.ops.splits``.

Shapes (B batch, Sq query rows, H query heads, D head dim, S the splits)::

    o_split (S, B, Sq, H, D) float32   lse_split (S, B, H, Sq) float32   ->   out (B, Sq, H, D), lse (B, H, Sq)

or with packed sequences ``(S, total_q, H, D)`` and ``(S, H, total_q)`` into ``(total_q, H, D)``
and ``(H, total_q)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import Layout, Plan, launch, plan
from .tiles import grid_id, load_tile, loop_bound, sequence, store_tile


@triton.heuristics({"VARLEN": lambda a: a["CU_Q"] is not None, "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"]})
@triton.jit
def split_combine_kernel(
    O_SPLIT, LSE_SPLIT, O, LSE, CU_Q,
    stride_ps, stride_pb, stride_pm, stride_ph, stride_qs, stride_lb, stride_lh,
    stride_ob, stride_om, stride_oh, seqlen_q, total_q, head_dim, num_splits, fold_batch,
    VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
    GRID_FOLD: tl.constexpr,
):
    """Merge the split-KV partials of ``attn_fwd_kernel``. Grid ``(cdiv(max Sq, BLOCK_M), H, B)``
    (folded: ``tiles.grid_id``).

    ``O_SPLIT (num_splits, *out.shape)`` float32 holds each share's normalised output and
    ``LSE_SPLIT (num_splits, *lse.shape)`` its log-sum-exp (+inf: the share saw no key). With
    ``M = max_s lse_s`` and ``w_s = exp(lse_s - M)``: ``out = sum_s w_s o_s / sum_s w_s`` and
    ``lse = M + log(sum_s w_s)``; a row no share saw gets out 0 and lse +inf, as unsplit.
    """
    i_m = grid_id(0, GRID_FOLD)
    i_h = grid_id(1, GRID_FOLD).to(tl.int64)
    i_b = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    bos_q, seqlen_q = sequence(CU_Q, i_b, seqlen_q, total_q, VARLEN)
    i_b = i_b.to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_m = i_m * BLOCK_M + o_r
    m_rows = o_m < seqlen_q
    p_lse = LSE_SPLIT + i_b * stride_lb + i_h * stride_lh + bos_q + o_m  # [BLOCK_M]
    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i_s in range(0, loop_bound(num_splits)):
        b_lse = tl.load(p_lse + tl.cast(i_s, tl.int64) * stride_qs, mask=m_rows, other=float("inf"))
        b_max = tl.maximum(b_max, tl.where(b_lse == float("inf"), float("-inf"), b_lse))
    b_ref = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_base = O_SPLIT + i_b * stride_pb + bos_q * stride_pm + i_h * stride_ph
    for i_s in range(0, loop_bound(num_splits)):
        b_lse = tl.load(p_lse + tl.cast(i_s, tl.int64) * stride_qs, mask=m_rows, other=float("inf"))
        b_w = tl.where(b_lse == float("inf"), 0.0, tl.exp(b_lse - b_ref))  # [BLOCK_M]
        p_share = o_base + tl.cast(i_s, tl.int64) * stride_ps  # the share's tile: a split term, 64-bit (``tiles``)
        b_o = load_tile(p_share, i_m * BLOCK_M, stride_pm, seqlen_q, head_dim, o_r, o_d, True, MASK_D)
        b_acc += b_w[:, None] * b_o
        b_sum += b_w
    m_empty = b_sum == 0.0
    b_sum_safe = tl.where(m_empty, 1.0, b_sum)
    b_out = b_acc / b_sum_safe[:, None]
    b_lse_out = tl.where(m_empty, float("inf"), b_ref + tl.log(b_sum_safe))
    store_tile(O + i_b * stride_ob + bos_q * stride_om + i_h * stride_oh, i_m * BLOCK_M, stride_om, seqlen_q, head_dim,
               o_r, o_d, b_out, True, MASK_D)
    tl.store(LSE + i_b * stride_lb + i_h * stride_lh + bos_q + o_m, b_lse_out, mask=m_rows)



# Query rows per program of the merge.
MERGE_BLOCK_M = 16


def plan_split_merge(
    o_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_q: Optional[torch.Tensor],
    dims: Layout, stride_lb: int, stride_lh: int, total_q: int, block_d: int, device: torch.device,
) -> Plan:
    """The launch of ``split_combine_kernel`` that merges ``o_split`` and ``lse_split`` (each one
    split deep: ``num_splits`` is their first dim) into ``out`` and ``lse``, whose lse strides per
    batch entry and head are ``stride_lb`` and ``stride_lh``; ``cu_q`` the packed sequences' offsets
    (None when dense), ``total_q`` their rows and ``block_d`` the head-dim bucket. The tensors may be
    meta tensors: the plan keeps their strides, and ``launch_split_merge`` passes the call's own."""
    block_m = MERGE_BLOCK_M
    return plan(split_combine_kernel, (triton.cdiv(dims.seqlen_q, block_m), dims.nheads, dims.batch), dict(
        O_SPLIT=o_split, LSE_SPLIT=lse_split, O=out, LSE=lse, CU_Q=cu_q,
        stride_ps=o_split.stride(0), **dims.stride_args(o_split[0], "p", "m"),
        stride_qs=lse_split.stride(0), stride_lb=stride_lb, stride_lh=stride_lh,
        **dims.stride_args(out, "o", "m"), seqlen_q=dims.seqlen_q, total_q=total_q,
        head_dim=dims.head_dim, num_splits=o_split.shape[0], BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
    ), device)


def launch_split_merge(p: Plan, o_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       cu_q: Optional[torch.Tensor]) -> None:
    """Run a planned merge (``plan_split_merge``) on this call's buffers."""
    given = dict(O_SPLIT=o_split, LSE_SPLIT=lse_split, O=out, LSE=lse, CU_Q=cu_q)
    launch(p, {name: given[name] for name in p.tensors})
