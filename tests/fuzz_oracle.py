"""Plain-torch oracles for the differential fuzz test (``tests/test_fuzz.py``).

Each oracle restates flash-attn 2.8's documented semantics for one entry point and reduces it to
``flash_recipe.reference.attention_reference`` (the project's definition of one dense call) on
slices and gathered rows; 8-bit attention (``sage``) reduces to ``flash_recipe.reference_int8``,
the method's torch definition. Nothing here calls flash_recipe's backends or its KV-cache torch path.

Every function computes in the dtype of the tensors it is given (``attention_reference`` with
``upcast=False``): give it tensors converted to fp32 / fp64 for the accuracy rule's truth, or the
inputs as they are for "plain torch in the input precision". All functions are differentiable.

Legend: B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim,
Dv value head dim, T total tokens of a packed batch, P page size, R rotary dim.
"""

from __future__ import annotations

import dataclasses

import torch

from flash_recipe import reference_int8
from flash_recipe.reference import attention_reference
from flash_recipe.testing import rotary as rotate


@dataclasses.dataclass(frozen=True)
class Scores:
    """The score options every entry point shares.

    ``window = (left, right)`` as plain ints, -1 unbounded (``causal`` implies ``right = 0``);
    ``alibi`` float32 ``(H,)`` or ``(B, H)``; ``scale`` the softmax scale, already defaulted;
    ``sinks`` ``(H,)`` attention sinks (``attention_reference``'s), or None.
    """

    scale: float
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    def with_sinks(self, sinks: torch.Tensor | None) -> Scores:
        """These options with ``sinks`` (a case's differentiable sinks, in the oracle's dtype)."""
        return dataclasses.replace(self, sinks=sinks)

    def slopes(self, b: int) -> torch.Tensor | None:
        """The slopes of batch entry (sequence) ``b``: ``(H,)`` or None."""
        if self.alibi is None or self.alibi.dim() == 1:
            return self.alibi
        return self.alibi[b]


def _one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Scores, diag_offset: int, slopes: torch.Tensor | None
) -> tuple:
    """``attention_reference`` in the tensors' own dtype: q ``(1 or B, Sq, H, D)`` -> out, lse ``(., H, Sq)``."""
    return attention_reference(
        q,
        k,
        v,
        opts.scale,
        opts.causal,
        diag_offset,
        upcast=False,
        window=opts.window,
        softcap=opts.softcap,
        alibi_slopes=slopes,
        sinks=opts.sinks,
    )


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Scores) -> tuple:
    """``flash_attn_func``: q ``(B, Sq, H, D)``, k ``(B, Sk, Hk, D)``, v ``(B, Sk, Hk, Dv)``; masks aligned
    bottom-right. Returns out ``(B, Sq, H, Dv)``, lse ``(B, H, Sq)``."""
    return _one(q, k, v, opts, k.shape[1] - q.shape[1], opts.alibi)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, is_causal: bool) -> torch.Tensor:
    """torch SDPA's semantics: ``(B, H, Sq, D)``, ``(B, Hk, Sk, D)``, ``(B, Hk, Sk, Dv)`` (GQA in contiguous
    head groups), causal aligned top-left. Returns ``(B, H, Sq, Dv)``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, _ = attention_reference(q, k, v, scale, is_causal, 0, upcast=False)
    return out.transpose(1, 2)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list, cu_k: list, opts: Scores) -> tuple:
    """``flash_attn_varlen_func``: q ``(Tq, H, D)``, k/v ``(Tk, Hk, D/Dv)``, ``cu_q``/``cu_k`` the offsets
    as Python lists ``(B + 1)``; each sequence alone, its masks aligned bottom-right with its own lengths.
    Returns out ``(Tq, H, Dv)``, lse ``(H, Tq)``."""
    keys = [k[cu_k[b] : cu_k[b + 1]] for b in range(len(cu_k) - 1)]
    values = [v[cu_k[b] : cu_k[b + 1]] for b in range(len(cu_k) - 1)]
    return _per_sequence(q, keys, values, cu_q, opts)


def gather_pages(pages: torch.Tensor, table_row: list, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of one sequence of a paged tensor ``(num_blocks, P, Hk, D)``: row ``j`` is
    row ``j % P`` of page ``table_row[j // P]``. Returns ``(end - start, Hk, D)``."""
    page_size = pages.shape[1]
    rows = torch.arange(start, end, device=pages.device)
    page = torch.tensor(table_row, dtype=torch.long, device=pages.device)[rows // page_size]
    return pages[page, rows % page_size]


def paged_varlen(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cu_q: list,
    lengths_k: list,
    table: list,
    opts: Scores,
) -> tuple:
    """``flash_attn_varlen_func`` with ``block_table``: k/v pages ``(num_blocks, P, Hk, D)``, ``table`` the
    block table as nested lists ``(B, width)``, ``lengths_k`` the key lengths (from ``cu_seqlens_k``).
    Returns out ``(Tq, H, Dv)``, lse ``(H, Tq)``."""
    keys = [gather_pages(k_pages, table[b], 0, n) for b, n in enumerate(lengths_k)]
    values = [gather_pages(v_pages, table[b], 0, n) for b, n in enumerate(lengths_k)]
    return _per_sequence(q, keys, values, cu_q, opts)


def _per_sequence(q: torch.Tensor, keys: list, values: list, cu_q: list, opts: Scores) -> tuple:
    outs, lses = [], []
    for b, (kb, vb) in enumerate(zip(keys, values)):
        qb = q[cu_q[b] : cu_q[b + 1]]
        out, lse = _one(qb[None], kb[None], vb[None], opts, kb.shape[0] - qb.shape[0], opts.slopes(b))
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where each batch entry's cache rows live. A dense cache ``(B_cache, S_cache, Hk, D)`` is a paged one
    whose pages are whole entries: ``table[b] = [cache_batch_idx[b]]`` and ``P = S_cache``.

    ``seqlens[b]`` rows are filled before the call; ``leftpad[b]`` is the first valid row.
    """

    table: list  # (B, width) page indices
    seqlens: list  # (B,)
    leftpad: list  # (B,)


def kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    layout: CacheLayout,
    opts: Scores,
    rotary: tuple | None = None,
) -> tuple:
    """``flash_attn_with_kvcache`` on a cache of pages ``(num_blocks, P, Hk, D)`` (see ``CacheLayout``).

    The new keys/values ``(B, S_new, Hk, D)`` go to rows ``[seqlens[b], seqlens[b] + S_new)``; with
    ``rotary = (cos, sin, interleaved)`` the new keys rotate at positions ``seqlens[b] + i`` and q at
    ``seqlens[b] + i`` when causal or local (``window != (-1, -1)``), else all of q at ``seqlens[b]``.
    Query b attends over rows ``[leftpad[b], seqlens[b] + S_new)`` with masks aligned bottom-right.
    The cache holds its own dtype: the rotated new keys are attended to as stored, rounded to it.

    Returns out ``(B, Sq, H, D)``, lse ``(B, H, Sq)`` and the new rows ``(B, S_new, Hk, D)`` of k (rotated,
    before that rounding) and v (None without new keys), all in q's dtype.
    """
    batch, seqlen_q = q.shape[:2]
    new = 0 if k_new is None else k_new.shape[1]
    pos = torch.tensor(layout.seqlens, device=q.device)[:, None]  # (B, 1)
    k_stored = k_new
    if rotary is not None:
        cos, sin, interleaved = rotary
        k_new = rotate(k_new, cos, sin, pos + torch.arange(new, device=q.device), interleaved, q.dtype)
        k_stored = k_new.to(k_cache.dtype).to(q.dtype)
        moves = opts.causal or tuple(opts.window) != (-1, -1)
        steps = torch.arange(seqlen_q, device=q.device) if moves else torch.zeros(seqlen_q, dtype=torch.long)
        q = rotate(q, cos, sin, pos + steps.to(q.device), interleaved, q.dtype)
    outs, lses = [], []
    for b in range(batch):
        n, pad = layout.seqlens[b], layout.leftpad[b]
        keys = gather_pages(k_cache, layout.table[b], pad, n).to(q.dtype)
        values = gather_pages(v_cache, layout.table[b], pad, n).to(q.dtype)
        if new:
            keys = torch.cat((keys, k_stored[b].to(q.dtype)), dim=0)
            values = torch.cat((values, v_new[b].to(q.dtype)), dim=0)
        out, lse = _one(q[b : b + 1], keys[None], values[None], opts, keys.shape[0] - seqlen_q, opts.slopes(b))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_new, v_new


def sage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    smooth_k: bool,
    fp8: bool,
    blocks: tuple,
    compute: torch.dtype,
    varlen: tuple = (),
) -> tuple:
    """``sageattn`` / ``sageattn_varlen`` on 16-bit inputs, q ``(B, Sq, H, D)`` (NHD) or packed
    ``(Tq, H, D)`` with ``varlen = (cu_q, cu_k, max_q, max_k)`` (offsets as int32 tensors).

    Q, K and V are quantized by the method's torch definition with ``blocks = (block_m, block_n)``
    (the kernel's tile: the quantization blocks are its rows), then attended in ``compute``:
    float64 is the truth of accuracy check (a) (the quantized values exact), float16 rounds P as the
    tensor cores read it. The lse gets the smoothing correction back, in ``compute``'s width.
    Returns out float32 ``(B, Sq, H, D)`` / ``(Tq, H, D)`` and lse ``(B, H, Sq)`` / ``(H, Tq)``.
    """
    x = reference_int8.quantize(q, k, v, scale, smooth_k, fp8, *blocks, *varlen)
    cu = varlen[:2] if varlen else (None, None)
    out, lse = reference_int8.attention_from_quantized(x, *blocks, causal, fp8, compute, *cu)
    if x.mean is not None:
        wide = torch.float64 if compute == torch.float64 else torch.float32
        lse = (lse.to(wide) + reference_int8.lse_correction(q, x.mean.to(wide), scale, cu[0])).float()
    return out, lse
