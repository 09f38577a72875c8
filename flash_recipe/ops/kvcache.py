"""KV-cache decoding: rotary embedding, in-place cache append, and attention over the cache.

Shapes (B batch, Sq query rows, Snew new tokens, H query heads, Hk kv heads, D head dim)::

    q (B, Sq, H, D)   k_new, v_new (B, Snew, Hk, D)   cos, sin (S_rotary, R / 2)
    cache, dense (B_cache, S_cache, Hk, D) or paged (num_pages, page_size, Hk, D)

A dense cache is addressed as a paged one whose pages are whole cache rows: page size
``S_cache`` and a one-column page table holding ``cache_batch_idx`` (or ``0..B-1``), so one code
path serves both. Row ``r`` of batch ``b`` lives in page ``table[b, r // page_size]`` at row
``r % page_size``.

``rotary_append_kernel`` writes the new keys and values into the cache at rows
``cache_seqlens[b] + i`` (rotating the keys first), both in one launch, and rotates q into a new
tensor; the forward
kernel (``flash_recipe.ops.forward``) then attends over rows ``[leftpad[b], cache_seqlens[b] +
Snew)`` with split-KV when there are few query blocks. Nothing reads the metadata on the host,
so there is no synchronisation; writes through a bad page index or past the cache are skipped
and the forward kernel turns that batch's output into NaN.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..memo_keys import SHARED_INDEXES, Fields, Memo, shared_index, signature
from . import choose, configs, splits, targets, tiles, tuned
from .forward import ForwardPlan, plan_forward, run_forward
from .launch import Plan, launch, plan
from .options import SCORE_FIELDS, KeyRanges, ScoreOptions
from .packing import PACK_MAX_ROWS, gqa_packing

# Helpers the kernels call by name: torch.compile regenerates a kernel with the jit functions it
# names, not the modules they are reached through.
from .tiles import grid_id, load_tile, store_tile


@triton.heuristics(
    {
        # The variants a launch asks for by passing a tensor (absent tensors are None).
        "ROTARY": lambda a: a["COS"] is not None,
        "TO_CACHE": lambda a: a["PAGE_TABLE"] is not None,
        "PAIR": lambda a: a["X2"] is not None,
        "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"],
    }
)
@triton.jit
def rotary_append_kernel(
    X, OUT, X2, OUT2, COS, SIN, POS, PAGE_TABLE,
    stride_xb, stride_xm, stride_xh, stride_ob, stride_om, stride_oh,
    stride_x2b, stride_x2m, stride_x2h, stride_o2b, stride_o2m, stride_o2h, stride_cos, stride_sin, stride_tb,
    heads, seqlen, head_dim, rotary_dim, seqlen_rotary, pos_step, page_size, num_pages, table_width, fold_batch,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, TO_CACHE: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr, GRID_FOLD: tl.constexpr,
):
    """Copy ``X (B, seqlen, Hx, D)`` into ``OUT``, optionally rotating the first ``rotary_dim`` dims;
    with ``PAIR``, also copy ``X2`` (shaped like ``X``, its own strides) into ``OUT2`` unrotated, in
    the same launch (a decoding step's new keys and values into their caches).

    Grid ``(cdiv(seqlen, BLOCK_M), Hx, B)``, or ``(..., 2 * Hx, B)`` with ``PAIR``, whose programs
    from head ``Hx = heads`` on copy ``X2`` (folded: ``tiles.grid_id``). Row ``i`` of batch ``b``
    sits at rotary position ``POS[b] + i * pos_step``; it is rotated by ``COS/SIN[position]``
    (``(S_rotary, rotary_dim / 2)``), pairing dims ``(2j, 2j + 1)`` when ``INTERLEAVED`` and
    ``(j, j + rotary_dim / 2)`` otherwise (GPT-NeoX). A position outside ``[0, seqlen_rotary)``
    yields NaN rather than a wild read.

    ``TO_CACHE``: ``OUT`` is a paged cache and row ``i`` goes to row ``POS[b] + i`` through
    ``PAGE_TABLE``; rows whose page is missing (past the table or outside ``[0, num_pages)``) are
    not written. Otherwise ``OUT`` is shaped like ``X`` and row ``i`` goes to row ``i``.
    """
    i_m = grid_id(0, GRID_FOLD)
    i_h = grid_id(1, GRID_FOLD).to(tl.int64)
    i_b = grid_id(2, GRID_FOLD).to(tl.int64)
    if GRID_FOLD > 1:  # a folded grid's padding
        if i_b >= fold_batch:
            return
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    rows = i_m * BLOCK_M + o_r  # [BLOCK_M]
    m_rows = rows < seqlen
    pos0 = tl.load(POS + i_b)
    # With PAIR, programs from head ``heads`` on copy X2 into OUT2, rows ``[0, seqlen)`` of each;
    # every access is X's or X2's, masked to the rows of the one this program copies (no pointer is
    # selected at run time: AMD's buffer-op pass under Triton 3.6 fails on a selected pointer).
    rows_x = seqlen
    if PAIR:
        first = i_h < heads
        i_h = tl.where(first, i_h, i_h - heads)
        rows_x = tl.where(first, seqlen, 0)  # X's rows this program copies
    m_x = rows < rows_x  # [BLOCK_M]: the rows of X this program copies (X2's are the others below seqlen)
    x_base = X + i_b * stride_xb + i_h * stride_xh
    b_x = load_tile(x_base, i_m * BLOCK_M, stride_xm, rows_x, head_dim, o_r, o_d, True, MASK_D).to(tl.float32)
    if PAIR:
        x2_base = X2 + i_b * stride_x2b + i_h * stride_x2h
        b_x2 = load_tile(x2_base, i_m * BLOCK_M, stride_x2m, seqlen - rows_x, head_dim, o_r, o_d, True, MASK_D)
        b_x = tl.where(first, b_x, b_x2.to(tl.float32))
    if ROTARY:
        half = rotary_dim // 2
        if INTERLEAVED:
            partner = o_d ^ 1
            freq = o_d // 2
            sign = tl.where(o_d % 2 == 0, -1.0, 1.0)
        else:
            partner = tl.where(o_d < half, o_d + half, o_d - half)
            freq = o_d % half
            sign = tl.where(o_d < half, -1.0, 1.0)
        m_rot = o_d < rotary_dim  # [BLOCK_D]
        pos = pos0 + rows * pos_step  # [BLOCK_M]
        m_pos = (pos >= 0) & (pos < seqlen_rotary)
        m_cs = (m_x & m_pos)[:, None] & m_rot[None, :]  # X2 is never rotated
        b_partner = tl.load(x_base + rows.to(tl.int64)[:, None] * stride_xm + partner[None, :],
                            mask=m_x[:, None] & m_rot[None, :], other=0.0).to(tl.float32)
        p_cs = pos.to(tl.int64)[:, None]
        b_cos = tl.load(COS + p_cs * stride_cos + freq[None, :], mask=m_cs, other=float("nan")).to(tl.float32)
        b_sin = tl.load(SIN + p_cs * stride_sin + freq[None, :], mask=m_cs, other=float("nan")).to(tl.float32)
        b_x = tl.where(m_x[:, None] & m_rot[None, :], b_x * b_cos + sign[None, :] * b_partner * b_sin, b_x)
    if TO_CACHE:
        dest = pos0 + rows  # absolute cache rows [BLOCK_M]
        slot = dest // page_size
        m_slot = m_rows & (dest >= 0) & (slot < table_width)
        page = tl.load(PAGE_TABLE + i_b * stride_tb + slot, mask=m_slot, other=-1)
        ok = m_slot & (page >= 0) & (page < num_pages)
        page = tl.where(ok, page, 0).to(tl.int64)
        o_row = (dest % page_size).to(tl.int64)[:, None]
        m_out = (ok & m_x)[:, None]
        if MASK_D:
            m_out = m_out & (o_d[None, :] < head_dim)
        p_out = OUT + page[:, None] * stride_ob + o_row * stride_om + i_h * stride_oh
        tl.store(p_out + o_d[None, :], b_x.to(OUT.dtype.element_ty), mask=m_out)
        if PAIR:
            m_out2 = (ok & (rows >= rows_x))[:, None]  # ok holds rows < seqlen
            if MASK_D:
                m_out2 = m_out2 & (o_d[None, :] < head_dim)
            p_out2 = OUT2 + page[:, None] * stride_o2b + o_row * stride_o2m + i_h * stride_o2h
            tl.store(p_out2 + o_d[None, :], b_x.to(OUT2.dtype.element_ty), mask=m_out2)
    else:  # (PAIR copies into caches only)
        o_base = OUT + i_b * stride_ob + i_h * stride_oh
        store_tile(o_base, i_m * BLOCK_M, stride_om, seqlen, head_dim, o_r, o_d, b_x, True, MASK_D)


class Rotary(NamedTuple):
    """Rotary embedding tables ``cos, sin (S_rotary, rotary_dim / 2)`` and the pairing."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool


class Cache(NamedTuple):
    """A KV cache as the kernels address it (see the module docstring).

    ``k, v``: ``(num_pages, page_size, Hk, D)`` (a dense cache is its own pages); ``table``: int32
    ``(B, width)``; ``seqlens``: int32 ``(B,)`` filled rows before this call; ``leftpad``: int32
    ``(B,)`` first valid row, or None for 0.
    """

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    seqlens: torch.Tensor
    leftpad: Optional[torch.Tensor]

    @property
    def capacity(self) -> int:
        """Rows one batch entry can address: page-table width times page size."""
        return self.table.shape[1] * self.k.shape[1]


_ROWS = 16  # rows per program of rotary_append_kernel


def _copy_tensors(x, out, positions, rotary: Optional[Rotary], cache: Optional[Cache], pair: tuple = (None, None)
                  ) -> dict:
    """The tensors of a ``rotary_append_kernel`` launch (absent ones None); ``pair``: ``(X2, OUT2)``."""
    return dict(X=x, OUT=out, X2=pair[0], OUT2=pair[1], POS=positions, COS=rotary.cos if rotary is not None else None,
                SIN=rotary.sin if rotary is not None else None, PAGE_TABLE=cache.table if cache is not None else None)


def _launch_copy(found: Plan, given: dict) -> None:
    launch(found, {name: given[name] for name in found.tensors})


def _plan_copy(x, out, positions, pos_step, rotary: Optional[Rotary], cache: Optional[Cache],
               pair: tuple = (None, None)) -> Plan:
    """The launch that copies ``x`` into ``out`` (see ``rotary_append_kernel``), and with ``pair``
    ``(x2, out2)`` (``x2`` shaped like ``x``) also ``x2`` into ``out2``, unrotated."""
    batch, seqlen, heads, head_dim = x.shape
    x2, out2 = pair
    if x2 is not None:
        strides2 = dict(stride_x2b=x2.stride(0), stride_x2m=x2.stride(1), stride_x2h=x2.stride(2),
                        stride_o2b=out2.stride(0), stride_o2m=out2.stride(1), stride_o2h=out2.stride(2))
    else:
        strides2 = dict(stride_x2b=0, stride_x2m=0, stride_x2h=0, stride_o2b=0, stride_o2m=0, stride_o2h=0)
    if cache is not None:  # out's batch stride is the page stride
        table = cache.table
        paging = dict(page_size=cache.k.shape[1], num_pages=cache.k.shape[0], table_width=cache.table.shape[1],
                      stride_tb=cache.table.stride(0))
    else:
        table, paging = None, dict(page_size=1, num_pages=1, table_width=1, stride_tb=0)
    if rotary is not None:
        tables = dict(COS=rotary.cos, SIN=rotary.sin, stride_cos=rotary.cos.stride(0), stride_sin=rotary.sin.stride(0),
                      rotary_dim=2 * rotary.cos.shape[1], seqlen_rotary=rotary.cos.shape[0])
    else:
        tables = dict(COS=None, SIN=None, stride_cos=0, stride_sin=0, rotary_dim=0, seqlen_rotary=0)
    copies = 2 if x2 is not None else 1
    return plan(rotary_append_kernel, (triton.cdiv(seqlen, _ROWS), heads * copies, batch), dict(
        X=x, OUT=out, X2=x2, OUT2=out2, POS=positions, PAGE_TABLE=table,
        stride_xb=x.stride(0), stride_xm=x.stride(1), stride_xh=x.stride(2),
        stride_ob=out.stride(0), stride_om=out.stride(1), stride_oh=out.stride(2), **strides2,
        heads=heads, seqlen=seqlen, head_dim=head_dim, pos_step=pos_step, **tables, **paging,
        INTERLEAVED=bool(rotary is not None and rotary.interleaved),
        BLOCK_M=_ROWS, BLOCK_D=configs.head_dim_bucket(head_dim), num_warps=4,
    ), x.device)


class StepPlan(NamedTuple):
    """A decoding step of one signature, decided once (``attention_kvcache``)."""

    append: Optional[Plan]  # new keys (rotated) and values into the caches, one launch; None without new rows
    rotate_q: Optional[Plan]  # q rotated into a new tensor, None without rotary (or no query rows)
    forward: ForwardPlan  # the attention over the cache (``forward.plan_forward``)


def _plan_step(q, k_new, v_new, cache: Cache, rotary: Optional[Rotary], options: ScoreOptions, keys: KeyRanges,
               num_splits: int, pack_gqa: Optional[bool], q_moves: bool) -> StepPlan:
    append = rotate_q = None
    if k_new is not None and k_new.shape[1] > 0:
        append = _plan_copy(k_new, cache.k, cache.seqlens, 1, rotary, cache, (v_new, cache.v))
    if rotary is not None and q.shape[1] > 0:
        q_rot = tiles.output_buffer(q.shape, dtype=q.dtype, device=q.device)  # as each step allocates its own
        rotate_q = _plan_copy(q, q_rot, cache.seqlens, 1 if q_moves else 0, rotary, None)
        q = q_rot
    batch, seqlen_q, nheads, head_dim = q.shape
    if num_splits == 0:
        heads, rows = program_heads(q, cache.k.shape[2], pack_gqa)
        num_splits = auto_splits(batch, heads, rows, keys.max_len, q.device, head_dim, q.element_size())
    kernel = "decode" if seqlen_q <= 16 else "fwd"
    found = plan_forward(q, cache.k, cache.v, options, None, keys, num_splits, kernel, pack_gqa)
    return StepPlan(append, rotate_q, found)


def auto_splits(
    batch: int, nheads: int, seqlen_q: int, capacity: int, device: torch.device, head_dim: int, element_size: int,
) -> int:
    """The split-KV count of a call over a KV cache whose launch has ``nheads`` heads of
    ``seqlen_q`` query rows each (``program_heads``): for a decoding step (at most 16 such rows)
    the one ``flash-recipe tune`` measured fastest on this GPU model for this head-dim bucket,
    element size and bucket of programs (``batch * nheads * cdiv(seqlen_q, 16)``) and cache
    capacity (``flash_recipe.ops.tuned``), else ``heuristic_splits``. 1 off CUDA."""
    if device.type != "cuda":
        return 1
    if seqlen_q <= 16:
        target = targets.target_of(device)
        if target != "interpreter":
            programs = batch * nheads * triton.cdiv(seqlen_q, 16)
            found = tuned.splits_for(device, target, configs.head_dim_bucket(head_dim), element_size, programs,
                                     capacity)
            if found is not None:
                return found
    return heuristic_splits(batch, nheads, seqlen_q, capacity, device, head_dim, element_size)


def launch_blocks(device: torch.device, rows: int, head_dim: int, element_size: int) -> tuple[int, int]:
    """``(query blocks, BLOCK_N)`` of the forward launch over a KV cache whose launched heads have
    ``rows`` query rows each (``program_heads``: ``Sq``, or ``Sq * group`` where the GQA group is
    packed), as ``packing.gqa_packing`` sizes it.

    Up to ``packing.PACK_MAX_ROWS`` rows, the launch is taken for a decoding step: one query tile
    (a packed group's tile grows to hold its rows; an unpacked step has at most 16) of the decode
    configuration, its keys in that configuration's ``BLOCK_N``. More rows count
    ``cdiv(rows, BLOCK_M)`` tiles of the general forward's configuration. Exact but for two calls
    the rows alone do not tell apart: 17 to 64 unpacked query rows (the general forward's tiles,
    counted as one decode tile) and a packed group of more than 64 rows from at most 16 query rows
    (decode tiles, counted as the general forward's).
    """
    if rows <= PACK_MAX_ROWS:
        return 1, choose.launch_config(device, "decode", head_dim, element_size).block_n
    cfg = choose.launch_config(device, "fwd_general", head_dim, element_size)
    return triton.cdiv(rows, cfg.block_m), cfg.block_n


def heuristic_splits(
    batch: int, nheads: int, seqlen_q: int, capacity: int, device: torch.device, head_dim: int, element_size: int,
    sms: Optional[int] = None,
) -> int:
    """The split-KV count by rule (``splits.choose_splits``): enough shares of the keys that the
    launch fills the GPU's multiprocessors with a well-filled last wave, 1 when its programs alone
    do, never more than the cache has key blocks.

    The programs of one split are ``batch * nheads * query blocks`` and the key blocks
    ``cdiv(capacity, BLOCK_N)``, with ``nheads`` heads of ``seqlen_q`` rows as ``program_heads``
    counts them and the blocks of the launch (``launch_blocks``). ``sms``: the multiprocessors
    (default: the device's; 1 split off CUDA); given, the rule is applied whatever the device
    (``tools.host_cost`` on the stub driver).
    """
    if sms is None:
        if device.type != "cuda":
            return 1
        sms = splits.sm_count(device)
    query_blocks, block_n = launch_blocks(device, seqlen_q, head_dim, element_size)
    return splits.choose_splits(batch * nheads * query_blocks, triton.cdiv(capacity, block_n), sms)


def program_heads(q: torch.Tensor, nheads_k: int, pack_gqa: Optional[bool] = None) -> tuple[int, int]:
    """The heads and query rows per head that a decoding step over ``q (B, Sq, H, D)`` launches
    programs for: ``(H, Sq)``, or where the GQA group is packed (``packing.gqa_packing``)
    ``(Hk, Sq * H / Hk)``: what the split-KV count is chosen for (``launch_blocks`` turns the rows
    into query blocks)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    kernel = "decode" if seqlen_q <= 16 else "fwd_general"  # as attention_forward launches over a cache
    group = nheads // nheads_k
    packed = gqa_packing(q.device, kernel, seqlen_q, head_dim, group, 0.0, q.element_size(), pack_gqa)[0]
    return (nheads_k, seqlen_q * group) if packed else (nheads, seqlen_q)


# Signature of a decoding step (``_step_key``) -> its ``StepPlan``.
_STEPS = Memo()
# The fields of the records a step's key takes beside ``ScoreOptions``'s (``options.SCORE_FIELDS``).
_CACHE_FIELDS = Fields(Cache)
_ROTARY_FIELDS = Fields(Rotary)


def _step_key(q, k_new, v_new, cache: Cache, rotary: Optional[Rotary], options: ScoreOptions, num_splits: int,
              pack_gqa: Optional[bool], signed: Optional[Hashable] = None) -> Optional[tuple]:
    """The signature that decides a decoding step: its tensors, every field of its records (none by
    hand), and the settings that can change at run time (the tuned configurations); None: not memoized.
    With ``signed`` (``attention_kvcache``), its token stands for the tensors' and records' signature,
    which the public call's signature decided."""
    state = choose.plan_state()
    if state is None:
        return None
    if signed is not None:
        return ("signed", signed, num_splits, pack_gqa), state, targets.target_of(q.device)
    tensors = (q, k_new, v_new) + _CACHE_FIELDS.tensors_of(cache) + SCORE_FIELDS.tensors_of(options)
    values = _CACHE_FIELDS.values_of(cache) + SCORE_FIELDS.values_of(options) + (num_splits, pack_gqa)
    if rotary is not None:  # a step without rotary has the shorter key
        tensors += _ROTARY_FIELDS.tensors_of(rotary)
        values += _ROTARY_FIELDS.values_of(rotary)
    found = signature(tensors, values)
    return None if found is None else (found, state, targets.target_of(q.device))


@choose.tuned_fallback
def attention_kvcache(
    q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], cache: Cache,
    rotary: Optional[Rotary], options: ScoreOptions, num_splits: int = 0,
    pack_gqa: Optional[bool] = None, signed: Optional[Hashable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` on validated input (see ``flash_recipe.decoding``).

    Appends ``k_new``/``v_new`` ``(B, Snew, Hk, D)`` to the cache in place, then attends from
    ``q (B, Sq, H, D)`` over rows ``[leftpad, cache_seqlens + Snew)`` of each batch entry's cache,
    aligned bottom-right. ``num_splits`` 0 picks the split-KV count (``auto_splits``: tuned, else
    the heuristic, counting the programs that GQA packing leaves: ``packing.gqa_packing``);
    ``pack_gqa`` as ``attention_forward`` takes it. ``signed``: the token of the public call every
    argument was derived from (``AttentionCall.signature``, ``TritonBackend.run_cache``), which
    stands for their signature in the step's key, or None.

    Returns ``out (B, Sq, H, D)`` in q's dtype and ``lse (B, H, Sq)`` float32.
    """
    q_moves = options.window_left >= 0 or options.window_right >= 0
    new = k_new.shape[1] if k_new is not None else 0
    end = cache.seqlens + new if new else cache.seqlens
    key = _step_key(q, k_new, v_new, cache, rotary, options, num_splits, pack_gqa, signed)
    start = cache.leftpad
    if start is None and key is None:
        start = torch.zeros_like(cache.seqlens)
    elif start is None:  # a memoized signature's calls share one index of zeros
        batch, device = q.shape[0], q.device
        start = SHARED_INDEXES.get(("zeros", batch, device))
        if start is None:
            start = shared_index("zeros", batch, device)
    keys = KeyRanges(start, end, cache.table.shape[1] * cache.k.shape[1], cache.table)  # capacity: Cache.capacity
    step = _STEPS.get(key) if key is not None else None
    if step is None:
        step = _STEPS.keep(key, _plan_step(q, k_new, v_new, cache, rotary, options, keys, num_splits, pack_gqa,
                                           q_moves))
    elif step.forward.tuned:
        choose.record_tuned(step.forward.tuned)
    if step.append is not None:
        _launch_copy(step.append, _copy_tensors(k_new, cache.k, cache.seqlens, rotary, cache, (v_new, cache.v)))
    if step.rotate_q is not None:
        q_rot = tiles.output_buffer(q.shape, dtype=q.dtype, device=q.device)
        _launch_copy(step.rotate_q, _copy_tensors(q, q_rot, cache.seqlens, rotary, None))
        q = q_rot
    return run_forward(step.forward, q, cache.k, cache.v, options, None, keys)
