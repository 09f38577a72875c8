"""8-bit attention (SageAttention's method) in plain torch: the definition the Triton kernels
(``flash_recipe.ops.quantize``, ``flash_recipe.ops.int8_attention``) follow step for step, the
fallback where Triton cannot run, and the reference their accuracy checks compare with.

Shapes (legend: B batch, S length, H query heads, Hk key/value heads, D head dim, nb blocks)::

    q (B, Sq, H, D)   k, v (B, Sk, Hk, D)   (or packed (total, H, D) with cu_seqlens)

The method, per (batch, head):

1. **K smoothing.** ``k - mean(k)`` over the tokens of each sequence, per channel (``key_means``).
   Every score of a query row moves by the same ``q . mean``, which softmax ignores; the
   log-sum-exp gets it back (``lse_correction``).
2. **INT8 Q and K, one scale per block of rows** (``quantize_blocks``): ``scale = absmax / 127``
   over the block's rows and channels, ``x8 = round(x / scale)`` (halves away from zero). Q is
   multiplied by ``softmax_scale * log2(e)`` first, so ``q8 . k8 * q_scale * k_scale`` is the
   score in base 2, ready for ``exp2``.
3. **P.V in 16 bits** (fp16; a bf16 V becomes fp16 divided by a power of two per channel where
   its magnitude needs it), or **FP8 e4m3** (``V / v_scale`` per channel with ``v_scale = absmax /
   448``, and ``P * 448``), both accumulated in fp32 (``value_scales``).

Block boundaries restart at each sequence of a packed batch; scale tensors are ``(B, H, nb)`` with
``nb`` the blocks of the longest sequence.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP16_SAFE = 32768.0  # a bf16 V channel above this is divided by a power of two before fp16
LOG2E = math.log2(math.e)


def _segments(n: int, cu_seqlens: Optional[torch.Tensor], rows: int) -> list:
    """``(batch, first row, length)`` of each sequence: ``cu_seqlens`` packed, else ``n`` of ``rows``."""
    if cu_seqlens is None:
        return [(b, 0, rows) for b in range(n)]
    cu = cu_seqlens.tolist()
    return [(b, cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]


def _rows(x: torch.Tensor, b: int, start: int, length: int, packed: bool) -> torch.Tensor:
    return x[start : start + length] if packed else x[b, start : start + length]


def key_means(k: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each sequence's mean key per head and channel, ``(B, Hk, D)`` float32 (0 for an empty one)."""
    if cu_seqlens_k is None:
        if k.shape[1] == 0:
            return torch.zeros((k.shape[0], k.shape[2], k.shape[3]), dtype=torch.float32, device=k.device)
        return k.float().mean(1)
    lengths = cu_seqlens_k.diff().to(torch.int64)
    batch = lengths.numel()
    seq = torch.repeat_interleave(torch.arange(batch, device=k.device), lengths.clamp(min=0), output_size=k.shape[0])
    sums = torch.zeros((batch,) + tuple(k.shape[1:]), dtype=torch.float32, device=k.device)
    sums.index_add_(0, seq, k.float())
    return sums / lengths.clamp(min=1).to(torch.float32)[:, None, None]


def value_scales(v: torch.Tensor, fp8: bool, cu_seqlens_k: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """V's per-channel divisors, ``(B, Hk, D)`` float32, or None where V is used as it is (fp16 V,
    16-bit P.V).

    FP8: ``absmax / 448`` over each sequence's tokens (1 for an all-zero channel). bf16 V for fp16
    P.V: the power of two that brings the channel under ``FP16_SAFE`` (1 for almost every channel:
    exact, no rounding added)."""
    if not fp8 and v.dtype == torch.float16:
        return None
    if cu_seqlens_k is None:
        absmax = v.abs().amax(1).float() if v.shape[1] else torch.zeros_like(v[:, 0], dtype=torch.float32)
    else:
        lengths = cu_seqlens_k.diff().to(torch.int64)
        seq = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=v.device), lengths.clamp(min=0), output_size=v.shape[0]
        )
        absmax = torch.zeros((lengths.numel(),) + tuple(v.shape[1:]), dtype=torch.float32, device=v.device)
        index = seq[:, None, None].expand(v.shape)
        absmax.scatter_reduce_(0, index, v.abs().float(), "amax", include_self=True)
    if fp8:
        return torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    exponent = torch.ceil(torch.log2(torch.clamp(absmax, min=FP16_SAFE) / FP16_SAFE))
    return torch.exp2(exponent)


def quantize_blocks(
    x: torch.Tensor,
    block: int,
    multiplier: float = 1.0,
    mean: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 ``x`` with one fp32 scale per ``block`` rows of each sequence and head.

    ``x`` is ``(B, S, H, D)`` or packed ``(total, H, D)`` with ``cu_seqlens``; ``mean`` ``(B, H, D)``
    is subtracted first (K smoothing), then ``multiplier`` applied, in fp32 and in that order.
    Returns ``x8`` (x's shape, int8) and ``scales`` ``(B, H, cdiv(S or max_seqlen, block))``:
    ``x ~ x8 * scale``.
    """
    packed = cu_seqlens is not None
    if cu_seqlens is not None:
        batch = cu_seqlens.numel() - 1
        length = int(max_seqlen) if max_seqlen is not None else int(cu_seqlens.diff().max())
    else:
        batch, length = x.shape[0], x.shape[1]
    nblocks = max(-(-length // block), 1)
    heads = x.shape[-2]
    x8 = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.ones((batch, heads, nblocks), dtype=torch.float32, device=x.device)
    mult = torch.tensor(multiplier, dtype=torch.float32, device=x.device)
    for b, start, n in _segments(batch, cu_seqlens, x.shape[1] if not packed else 0):
        for i in range(0, n, block):
            rows = _rows(x, b, start + i, min(block, n - i), packed).float()  # (rows, H, D)
            if mean is not None:
                rows = rows - mean[b]
            rows = rows * mult
            absmax = rows.abs().amax(dim=(0, 2))  # (H,)
            scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
            y = rows / scale[:, None]
            q = torch.trunc(y + torch.where(y >= 0, 0.5, -0.5)).to(torch.int8)
            _rows(x8, b, start + i, min(block, n - i), packed).copy_(q)
            scales[b, :, i // block] = scale
    return x8, scales


def lse_correction(
    q: torch.Tensor, mean: torch.Tensor, softmax_scale: float, cu_seqlens_q: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``softmax_scale * q . mean`` for each query row and head: what K smoothing took from every
    score of the row, added back to its log-sum-exp. ``(B, H, Sq)``, or ``(H, total_q)`` packed."""
    group = q.shape[-2] // mean.shape[1]
    means = mean.repeat_interleave(group, dim=1)  # (B, H, D): each query head's kv head
    if cu_seqlens_q is None:
        return torch.einsum("bshd,bhd->bhs", q.to(means.dtype), means) * softmax_scale
    lengths = cu_seqlens_q.diff().to(torch.int64)
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=q.device), lengths.clamp(min=0), output_size=q.shape[0]
    )
    return torch.einsum("thd,thd->ht", q.to(means.dtype), means[seq]) * softmax_scale


class Quantized(NamedTuple):
    """The method's inputs to the attention product: INT8 Q and K with their block scales, V as
    P.V reads it (fp16 or float8_e4m3fn) with its per-channel divisors (or None), and the key means
    (or None without smoothing)."""

    q8: torch.Tensor
    q_scale: torch.Tensor  # (B, H, nb_q)
    k8: torch.Tensor
    k_scale: torch.Tensor  # (B, Hk, nb_k)
    v: torch.Tensor
    v_scale: Optional[torch.Tensor]  # (B, Hk, D)
    mean: Optional[torch.Tensor]  # (B, Hk, D)


def scaled_values(
    v: torch.Tensor, v_scale: Optional[torch.Tensor], fp8: bool, cu_seqlens_k: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """V as P.V reads it: divided by ``v_scale`` per sequence and channel, in fp8 or fp16."""
    dtype = torch.float8_e4m3fn if fp8 else torch.float16
    if v_scale is None:
        return v.to(dtype)
    if cu_seqlens_k is None:
        return (v.float() / v_scale[:, None]).to(dtype)
    lengths = cu_seqlens_k.diff().to(torch.int64)
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=v.device), lengths.clamp(min=0), output_size=v.shape[0]
    )
    return (v.float() / v_scale[seq]).to(dtype)


def attention_from_quantized(
    x: Quantized,
    block_m: int,
    block_n: int,
    causal: bool,
    fp8: bool,
    compute: torch.dtype,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of quantized inputs: ``(out (like q8, float32), lse)``, lse natural and without
    the smoothing correction (``(B, H, Sq)``, or ``(H, total_q)`` packed).

    ``compute`` is the precision of the softmax and of P.V: float64 (or float32) computes
    everything in it, P and V exact as quantized (the truth of accuracy check (a)); float16 rounds
    the unnormalised probabilities to P.V's format (fp16, or fp8 after ``* 448``) before an fp32
    product, as the kernel's tensor cores read them (PyTorch "in the input precision"). Scores are
    exact either way: products of int8 sum exactly in fp32 up to head dim 1040.
    """
    packed = cu_seqlens_q is not None
    heads, heads_k = x.q8.shape[-2], x.k8.shape[-2]
    group = heads // heads_k
    wide = torch.float64 if compute == torch.float64 else torch.float32
    out = torch.zeros(x.q8.shape[:-1] + (x.v.shape[-1],), dtype=torch.float32, device=x.q8.device)
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else x.q8.shape[0]
    q_segs = _segments(batch, cu_seqlens_q, 0 if packed else x.q8.shape[1])
    k_segs = _segments(batch, cu_seqlens_k, 0 if packed else x.k8.shape[1])
    lse = torch.empty(
        (heads, x.q8.shape[0]) if packed else (batch, heads, x.q8.shape[1]), dtype=torch.float32, device=x.q8.device
    )
    for (b, qs, nq), (_, ks, nk) in zip(q_segs, k_segs):
        q8 = _rows(x.q8, b, qs, nq, packed).to(wide)  # (nq, H, D)
        k8 = _rows(x.k8, b, ks, nk, packed).to(wide)
        v = _rows(x.v, b, ks, nk, packed).to(wide)
        q_sc = x.q_scale[b].repeat_interleave(block_m, dim=1)[:, :nq].to(wide)  # (H, nq)
        k_sc = x.k_scale[b].repeat_interleave(block_n, dim=1)[:, :nk].to(wide)  # (Hk, nk)
        for h in range(heads):
            hk = h // group
            s = (q8[:, h] @ k8[:, hk].T) * q_sc[h][:, None] * k_sc[hk][None, :]  # base-2 scores (nq, nk)
            if causal:
                rows, cols = torch.arange(nq, device=s.device), torch.arange(nk, device=s.device)
                visible = cols[None, :] <= rows[:, None] + (nk - nq)
                s = s.masked_fill(~visible, float("-inf"))
            m = s.amax(1, keepdim=True) if nk else s.new_zeros((nq, 1))  # a sequence without keys: rows of 0
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp2(s - m)
            denom = p.sum(1)
            if compute == torch.float16:
                p = (p * FP8_MAX).to(torch.float8_e4m3fn).float() / FP8_MAX if fp8 else p.half().float()
            o = (p.to(wide) @ v[:, hk]) / torch.where(denom > 0, denom, torch.ones_like(denom))[:, None]
            if x.v_scale is not None:
                o = o * x.v_scale[b, hk].to(wide)
            row_lse = torch.where(
                denom > 0, (m[:, 0] + torch.log2(denom)) * math.log(2), torch.full_like(denom, math.inf)
            )
            if packed:
                out[qs : qs + nq, h] = o.float()
                lse[h, qs : qs + nq] = row_lse.float()
            else:
                out[b, qs : qs + nq, h] = o.float()
                lse[b, h, qs : qs + nq] = row_lse.float()
    return out, lse


def quantize(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    smooth_k: bool,
    fp8: bool,
    block_m: int,
    block_n: int,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
) -> Quantized:
    """Steps 1-3 of the method in torch (the kernels' ``ops.int8_attention.quantize_inputs``)."""
    mean = key_means(k, cu_seqlens_k) if smooth_k else None
    q8, q_scale = quantize_blocks(q, block_m, softmax_scale * LOG2E, None, cu_seqlens_q, max_seqlen_q)
    k8, k_scale = quantize_blocks(k, block_n, 1.0, mean, cu_seqlens_k, max_seqlen_k)
    v_scale = value_scales(v, fp8, cu_seqlens_k)
    return Quantized(q8, q_scale, k8, k_scale, scaled_values(v, v_scale, fp8, cu_seqlens_k), v_scale, mean)


def sage_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    smooth_k: bool,
    fp8: bool,
    block_m: int = 64,
    block_n: int = 64,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole method in torch: ``(out in q's dtype, lse float32)``, lse as the kernels return it
    (``(B, H, Sq)``, or ``(H, total_q)`` packed; +inf for a row that sees no key)."""
    x = quantize(
        q, k, v, softmax_scale, smooth_k, fp8, block_m, block_n, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    out, lse = attention_from_quantized(x, block_m, block_n, causal, fp8, torch.float16, cu_seqlens_q, cu_seqlens_k)
    if x.mean is not None:
        lse = lse + lse_correction(q, x.mean, softmax_scale, cu_seqlens_q)
    return out.to(q.dtype), lse
