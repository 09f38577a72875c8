"""8-bit attention (SageAttention's method): INT8 Q.K^T, 16-bit or FP8 P.V, online softmax.

Shapes (legend: B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim)::

    q (B, Sq, H, D)   k, v (B, Sk, Hk, D)   ->   out (B, Sq, H, D), lse (B, H, Sq) float32
    packed: q (total_q, H, D), k, v (total_k, Hk, D), cu_seqlens_q/k (B + 1,) int32
                                            ->   out (total_q, H, D), lse (H, total_q)

Query head ``h`` reads key/value head ``h // (H // Hk)``. Causal masking is aligned bottom-right
(query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``, per sequence), as everywhere in flash_recipe;
a row that sees no key outputs 0 with lse = +inf.

The method is ``flash_recipe.reference_int8``'s: ``quantize_inputs`` smooths K, quantizes Q and K
per block (``ops.quantize``, the blocks being this kernel's tiles) and prepares V; the kernel
multiplies the INT8 tiles into int32 (integer tensor cores), dequantizes with the two block scales
into base-2 scores (Q's scale carries ``softmax_scale * log2(e)``), and runs the forward's online
softmax. P.V runs in fp16, or in FP8 e4m3 (``P * 448`` against ``V / v_scale``) where the GPU has
FP8 tensor cores, accumulated in fp32 either way; the per-channel V divisors and the 448 come
back out once, on the output tile. Forward only: the method is for inference.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .. import reference_int8
from . import configs, targets, tiles
from .launch import launch_once
from .quantize import block_d_of, quantize_blocks
from .tiles import (
    LN2,
    grid_id,
    grid_programs,
    key_blocks,
    load_tile,
    loop_bound,
    sequences,
    stage_bounds,
    store_tile,
    visible,
)


@triton.jit
def _int8_inner(
    b_acc, b_m, b_l, b_q, q_scale, k_base, v_base, ks_base, stride_kn, stride_vn, seqlen_k, head_dim, hi_offset,
    o_m, o_n, o_d, start, end, MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr,
    PV_FP8: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key blocks ``[start, end)``: ``MASKED`` applies the sequence end and the causal diagonal."""
    for start_n in range(loop_bound(start), loop_bound(end), BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        b_k = load_tile(k_base, start_n, stride_kn, seqlen_k, head_dim, o_n, o_d, MASKED, False)  # [BN, BD] int8
        k_scale = tl.load(ks_base + start_n // BLOCK_N)
        b_s = tl.dot(b_q, tl.trans(b_k), out_dtype=tl.int32)  # [BLOCK_M, BLOCK_N], exact
        b_s = b_s.to(tl.float32) * (q_scale * k_scale)  # base-2 logits
        if MASKED:
            o_k = start_n + o_n
            b_s = tl.where(visible(o_m[:, None], o_k[None, :], seqlen_k, 0, hi_offset, False, CAUSAL),
                           b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        b_m_use = b_m_new
        if MASKED:  # a row with no visible key so far keeps m = -inf: subtract 0, not -inf
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_m_use[:, None])  # [BLOCK_M, BLOCK_N], in [0, 1]
        b_alpha = tl.math.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = load_tile(v_base, start_n, stride_vn, seqlen_k, head_dim, o_n, o_d, MASKED, False)  # [BN, BD]
        if PV_FP8:
            b_p = (b_p * 448.0).to(tl.float8e4nv)  # P's full e4m3 range; the output divides it out
        else:
            b_p = b_p.to(tl.float16)
        b_acc = tl.dot(b_p, b_v, b_acc * b_alpha[:, None])
        b_m = b_m_new
    return b_acc, b_m, b_l


@triton.heuristics(
    {
        "VARLEN": lambda a: a["CU_Q"] is not None,
        "V_SCALED": lambda a: a["V_SCALE"] is not None,
        "PV_FP8": lambda a: a["V"].dtype == torch.float8_e4m3fn,
        "EVEN_M": lambda a: a["CU_Q"] is None and a["seqlen_q"] % a["BLOCK_M"] == 0,
        "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
    }
)
@triton.jit
def attn_int8_kernel(
    Q, K, V, O, LSE, Q_SCALE, K_SCALE, V_SCALE, CU_Q, CU_K,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    group_size, seqlen_q, seqlen_k, total_q, total_k, head_dim, fold_batch,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, V_SCALED: tl.constexpr, PV_FP8: tl.constexpr,
    EVEN_M: tl.constexpr, MASK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    GRID_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(max Sq, BLOCK_M), H, B)`` (folded: ``tiles.grid_id``); causal launches take the
    last (heaviest) query blocks first.

    ``Q``/``K`` int8 and ``V`` (fp16 or float8_e4m3fn) with ``BLOCK_D`` columns (the head dim
    padded with zeros: the loop loads whole rows), dense or, with ``VARLEN``, packed with
    sequence ``b`` in rows ``CU_Q[b]:CU_Q[b+1]`` and ``CU_K[b]:CU_K[b+1]`` (batch strides 0).
    ``Q_SCALE[b, h, i]`` scales query block ``i`` (``BLOCK_M`` rows) into base-2 logits and
    ``K_SCALE[b, hk, j]`` key block ``j`` (``BLOCK_N`` rows); ``V_SCALE[b, hk, d]`` (with
    ``V_SCALED``) multiplies output channel ``d``. ``O`` is q's layout in the input dtype, its
    ``head_dim`` columns stored (``MASK_D`` where that is fewer than ``BLOCK_D``);
    ``LSE[b * stride_lb + h * stride_lh + first row + i]`` the natural log-sum-exp of the smoothed
    scores (the launcher adds the smoothing back).
    """
    if CAUSAL:
        i_m = grid_programs(0, GRID_FOLD) - 1 - grid_id(0, GRID_FOLD)
    else:
        i_m = grid_id(0, GRID_FOLD)
    i_h = grid_id(1, GRID_FOLD)
    i_b = grid_id(2, GRID_FOLD)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    bos_q, seqlen_q, bos_k, seqlen_k, diag_offset = sequences(CU_Q, CU_K, i_b, seqlen_q, seqlen_k, total_q, total_k,
                                                               seqlen_k - seqlen_q, VARLEN)
    q_start = i_m * BLOCK_M
    if VARLEN:
        if q_start >= seqlen_q:
            return
    i_hk = i_h // group_size
    i_b = i_b.to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_m = q_start + o_r

    q_base = Q + i_b * stride_qb + bos_q * stride_qm + i_h.to(tl.int64) * stride_qh
    k_base = K + i_b * stride_kb + bos_k * stride_kn + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b * stride_vb + bos_k * stride_vn + i_hk.to(tl.int64) * stride_vh
    ks_base = K_SCALE + i_b * stride_ksb + i_hk.to(tl.int64) * stride_ksh
    b_q = load_tile(q_base, q_start, stride_qm, seqlen_q, head_dim, o_r, o_d, not EVEN_M, False)  # [BM, BD] int8
    q_scale = tl.load(Q_SCALE + i_b * stride_qsb + i_h.to(tl.int64) * stride_qsh + i_m)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    begin, full_begin, full_end, end = key_blocks(q_start, q_start + BLOCK_M - 1, seqlen_k, 0, diag_offset, False,
                                                  CAUSAL, BLOCK_N)
    # The blocks every row sees in full (no masks), then the diagonal and the ragged last block.
    for stage in tl.static_range(1, 3):
        lo, hi = stage_bounds(stage, begin, full_begin, full_end, end)
        b_acc, b_m, b_l = _int8_inner(
            b_acc, b_m, b_l, b_q, q_scale, k_base, v_base, ks_base, stride_kn, stride_vn, seqlen_k, head_dim,
            diag_offset, o_m, o_n, o_d, lo, hi, stage != 1, CAUSAL, MASK_D, PV_FP8, BLOCK_N,
        )

    m_empty = b_l == 0.0  # rows that saw no key
    b_l_safe = tl.where(m_empty, 1.0, b_l)
    b_out = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    if V_SCALED:
        b_vs = tl.load(V_SCALE + i_b * stride_vsb + i_hk.to(tl.int64) * stride_vsh + o_d, mask=o_d < head_dim,
                       other=1.0)
        if PV_FP8:
            b_vs = b_vs / 448.0
        b_out = b_out * b_vs[None, :]
    b_lse = tl.where(m_empty, float("inf"), (b_m + tl.math.log2(b_l_safe)) * LN2)  # [BLOCK_M]
    o_base = O + i_b * stride_ob + bos_q * stride_om + i_h.to(tl.int64) * stride_oh
    store_tile(o_base, q_start, stride_om, seqlen_q, head_dim, o_r, o_d, b_out, not EVEN_M, MASK_D)
    p_lse = LSE + i_b * stride_lb + i_h.to(tl.int64) * stride_lh + bos_q + o_m
    if EVEN_M:
        tl.store(p_lse, b_lse)
    else:
        tl.store(p_lse, b_lse, mask=o_m < seqlen_q)


# Tiles per family: (query block, key block, warps, stages) by head-dim bucket. The query and key
# blocks are also the quantization blocks of Q and K. Every entry is compiled for its targets by
# the compile check (``--call int8``), with 0 spills.
_INT8_TILES: dict[str, dict[int, configs.Config]] = {
    "sm80": {32: configs.Config(128, 64, 4, 2),  # 3 stages spill 8 B
             64: configs.Config(128, 64, 4, 3), 128: configs.Config(128, 64, 8, 3),
             256: configs.Config(64, 32, 8, 2)},  # 64x64 spills 56 B; 4 warps 8-16 B (ragged)
    "sm86": {64: configs.Config(128, 64, 4, 2), 128: configs.Config(128, 64, 8, 2),
             256: configs.Config(64, 32, 4, 1)},
    "sm90": {64: configs.Config(128, 128, 8, 3), 128: configs.Config(128, 128, 8, 2),
             256: configs.Config(64, 64, 8, 2)},  # 4 warps spill 24-32 B (ragged)
    "sm100": {64: configs.Config(128, 128, 8, 3),
              128: configs.Config(128, 128, 8, 1),  # 2 stages spill 56 B (ragged)
              256: configs.Config(64, 32, 4, 2)},  # 64x64 spills 40 B
    "sm120": {32: configs.Config(64, 64, 4, 2),  # 128x64 spills 8-32 B with FP8 P.V
              64: configs.Config(128, 64, 4, 2), 128: configs.Config(128, 64, 8, 2),
              256: configs.Config(32, 32, 4, 1)},  # 64x32 spills 8-24 B
    "amd": {64: configs.Config(64, 64, 4, 1), 128: configs.Config(64, 64, 4, 1), 256: configs.Config(32, 32, 4, 1)},
    "interpreter": {256: configs.Config(32, 32, 1, 1)},
}

# Families whose tensor cores multiply FP8 e4m3 (sm89 Ada included: the family of sm86 minus that).
FP8_TARGETS = ("sm89", "sm90", "sm100", "sm120", "sm121", "interpreter")


def int8_config(target: str, head_dim: int) -> configs.Config:
    """The tile of ``target``'s family for ``head_dim`` (``_INT8_TILES``)."""
    rows = _INT8_TILES[configs.arch_family(target)]
    bucket = block_d_of(head_dim)
    for max_bucket in sorted(rows):
        if bucket <= max_bucket:
            return rows[max_bucket]
    raise ValueError(f"head_dim must be at most 256 for 8-bit attention, got {head_dim}")


def fp8_problem(target: str) -> Optional[str]:
    """Why FP8 P.V cannot run on ``target`` (None: it can)."""
    if target in FP8_TARGETS or target.startswith("sm") and target[2:].isdigit() and int(target[2:]) >= 89:
        return None
    return (f"{target} has no FP8 tensor cores (FP8 P.V needs sm89 or newer: RTX 40xx, L4, H100, B200, RTX 50xx); "
            f"use 16-bit P.V (pv_dtype='fp16')")


class Int8Plan(NamedTuple):
    """The tile and the P.V format of one call."""

    config: configs.Config
    fp8: bool


def quantize_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, smooth_k: bool, plan: Int8Plan,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
) -> reference_int8.Quantized:
    """Steps 1-3 of the method with the quantization kernel (``reference_int8.quantize`` in torch)."""
    cfg = plan.config
    mean = reference_int8.key_means(k, cu_seqlens_k) if smooth_k else None
    q8, q_scale = quantize_blocks(q, cfg.block_m, softmax_scale * reference_int8.LOG2E, None, cu_seqlens_q,
                                  max_seqlen_q)
    k8, k_scale = quantize_blocks(k, cfg.block_n, 1.0, mean, cu_seqlens_k, max_seqlen_k)
    v_scale = reference_int8.value_scales(v, plan.fp8, cu_seqlens_k)
    v_pv = reference_int8.scaled_values(v, v_scale, plan.fp8, cu_seqlens_k)
    return reference_int8.Quantized(q8, q_scale, k8, k_scale, v_pv, v_scale, mean)


def attention_quantized(
    x: reference_int8.Quantized, plan: Int8Plan, causal: bool, out_dtype: torch.dtype,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on quantized inputs: ``(out in out_dtype, lse)``, the lse without the
    smoothing correction (``reference_int8.attention_from_quantized`` is its definition)."""
    q8, k8 = x.q8, x.k8
    packed = cu_seqlens_q is not None
    # Triton's interpreter rounds fp32 to bfloat16 wrongly (a rounding carry out of the mantissa is
    # lost: 1.999 becomes 1.0), so there the kernel stores fp32 and torch rounds.
    interpreted_bf16 = targets.target_of(q8.device) == "interpreter" and out_dtype == torch.bfloat16
    out_shape = q8.shape[:-1] + (x.v.shape[-1],)
    out = tiles.output_buffer(out_shape, dtype=torch.float32 if interpreted_bf16 else out_dtype, device=q8.device)
    if cu_seqlens_q is not None and max_seqlen_q is not None and max_seqlen_k is not None:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, int(max_seqlen_q), int(max_seqlen_k)
        lse = tiles.output_buffer((q8.shape[1], q8.shape[0]), dtype=torch.float32, device=q8.device)
        stride_lb, stride_lh = 0, lse.stride(0)
    else:
        batch, seqlen_q, seqlen_k = q8.shape[0], q8.shape[1], k8.shape[1]
        lse = tiles.output_buffer((batch, q8.shape[2], seqlen_q), dtype=torch.float32, device=q8.device)
        stride_lb, stride_lh = lse.stride(0), lse.stride(1)
    if q8.numel() == 0 or seqlen_q == 0:
        return out.zero_().to(out_dtype), lse.fill_(float("inf"))

    def strides(t, prefix, row):
        b, r, h = (0, t.stride(0), t.stride(1)) if packed else (t.stride(0), t.stride(1), t.stride(2))
        return {f"stride_{prefix}b": b, f"stride_{prefix}{row}": r, f"stride_{prefix}h": h}

    cfg = plan.config
    heads, heads_k = q8.shape[-2], k8.shape[-2]
    head_dim, block_d = x.v.shape[-1], q8.shape[-1]  # q8 and k8 come padded (ops.quantize)
    grid = (triton.cdiv(seqlen_q, cfg.block_m), heads, batch)
    vs = x.v_scale
    v = x.v
    if head_dim != block_d:  # V padded with zero columns like q8 and k8 (a copy, for odd head dims only)
        v = torch.zeros(x.v.shape[:-1] + (block_d,), dtype=x.v.dtype, device=x.v.device)
        v[..., :head_dim] = x.v
    launch_once(attn_int8_kernel, grid, dict(
        Q=q8, K=k8, V=v, O=out, LSE=lse, Q_SCALE=x.q_scale, K_SCALE=x.k_scale, V_SCALE=vs,
        CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k,
        **strides(q8, "q", "m"), **strides(k8, "k", "n"), **strides(v, "v", "n"), **strides(out, "o", "m"),
        stride_lb=stride_lb, stride_lh=stride_lh,
        stride_qsb=x.q_scale.stride(0), stride_qsh=x.q_scale.stride(1),
        stride_ksb=x.k_scale.stride(0), stride_ksh=x.k_scale.stride(1),
        stride_vsb=vs.stride(0) if vs is not None else 0, stride_vsh=vs.stride(1) if vs is not None else 0,
        group_size=heads // heads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        total_q=q8.shape[0] if packed else 0, total_k=k8.shape[0] if packed else 0, head_dim=head_dim,
        CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ), q8.device)
    return out.to(out_dtype), lse


def plan_int8(device: torch.device, head_dim: int, fp8: bool) -> Int8Plan:
    """The tile of ``device``'s family and the P.V format (FP8 refused where the GPU lacks it)."""
    target = targets.target_of(device)
    if fp8:
        problem = fp8_problem(target)
        if problem is not None:
            raise NotImplementedError(f"pv_dtype='fp8': {problem}")
    return Int8Plan(int8_config(target, head_dim), fp8)


def int8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, smooth_k: bool = True,
    fp8: bool = False, cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, need_lse: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The whole method on the kernels: ``(out like q, lse or None)``. Inputs are validated by the
    caller (``flash_recipe.sage``): fp16/bf16, last dim contiguous, ``H % Hk == 0``, D <= 256."""
    plan = plan_int8(q.device, q.shape[-1], fp8)
    x = quantize_inputs(q, k, v, softmax_scale, smooth_k, plan, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = attention_quantized(x, plan, causal, q.dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not need_lse:
        return out, None
    if x.mean is not None:
        lse = lse + reference_int8.lse_correction(q, x.mean, softmax_scale, cu_seqlens_q)
    return out, lse
