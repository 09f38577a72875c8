"""Triton helpers shared by the forward and backward kernels: tile loads/stores and loop bounds.

Conventions used by every kernel in ``flash_recipe.ops``:

- tensors are ``(batch, seqlen, nheads, head_dim)`` with arbitrary strides except a contiguous last
  dim; a kernel receives the batch, sequence and head strides;
- a tile is ``[BLOCK_ROWS, BLOCK_D]`` rows of one head; ``BLOCK_D`` is the head dim rounded up to a
  power of two and the padded columns are masked (loaded as 0, never stored);
- offsets (the one rule for tensors of more than 2**31 elements): every index that is multiplied
  by a stride outside a tile is promoted to int64 before the multiply: the batch, head, split and
  page indices, a sequence's first row (``sequence`` returns it as int64), a tile's first row
  (``load_tile``: ``row0.to(tl.int64) * stride_row``), and a row gathered from anywhere in the
  tensor (a packed GQA tile's ``[BLOCK_ROWS]`` row offsets, a paged key's page and row). What
  stays 32-bit is the per-element offset inside one tile, ``o_r * stride_row + o_d`` with
  ``o_r < BLOCK_ROWS`` (at most 256) and ``o_d < BLOCK_D``: it spans one tile, so it stays below
  2**31 while ``BLOCK_ROWS * stride_row`` does (a row stride below 2**23 elements at 256-row tiles,
  2**24 at 128: a row of 2**23 elements means ``H * D`` of 8M). A stride of 2**31 or more arrives
  as an int64 argument (Triton types an integer argument by its value), so its products are
  64-bit anyway. Row, key and block indices that are not multiplied by a stride (an lse entry
  ``first row + i``, a block scale's index) are below 2**31 as the sequence lengths are. Keeping
  the per-element part 32-bit keeps the compiled tiles' registers and instructions: a scalar
  promoted once per tile costs nothing per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The kernels' softmax runs in base 2 (``exp2``, ``log2``); these convert to and from natural units.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2)


# Allocates a kernel output, ``output_buffer(shape, dtype=..., device=...)``: every element is written by
# the kernel. Tests replace it with a NaN fill (``tests/conftest.py``'s ``nan_outputs``); it is
# ``torch.empty`` itself, not a function around it, so that an allocation adds no Python frame to a
# repeated call (``flash_recipe.tools.host_cost``).
output_buffer = torch.empty


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
def load_keys(base, table, bos, row0, stride_page, stride_row, first, n_rows, head_dim, page_size, num_pages, o_r, o_d,
              MASK_ROWS: tl.constexpr, MASK_FIRST: tl.constexpr, MASK_D: tl.constexpr, PAGED: tl.constexpr):
    """Key or value rows ``row0 + o_r`` of one sequence as a tile, 0 outside ``[0, n_rows)`` (with
    ``MASK_ROWS``) and below ``first`` (with ``MASK_ROWS`` and ``MASK_FIRST``): rows no query of the
    tile sees are not read.

    Without ``PAGED`` the rows are ``stride_row`` apart. With ``PAGED`` the sequence's row ``r`` is absolute
    row ``bos + r``, stored in page ``table[(bos + r) // page_size]`` at row ``(bos + r) % page_size``
    (``stride_page`` apart). A row whose page index lies outside ``[0, num_pages)`` is not read
    (it loads as 0).

    Returns ``(tile, bad)``: ``bad`` (``[len(o_r)]``) marks the rows that ``PAGED`` could not read
    (a page index out of range), which the caller turns into a NaN output, so a bad page table
    shows up instead of a wrong result or an illegal memory access; all False without ``PAGED``.
    """
    in_seq = o_r >= 0
    if MASK_ROWS:
        in_seq = (row0 + o_r) < n_rows
        if MASK_FIRST:
            in_seq = in_seq & (row0 + o_r >= first)
    if PAGED:
        rows = bos + row0 + o_r  # [len(o_r)] absolute rows, int64
        page = tl.load(table + rows // page_size, mask=in_seq, other=0)
        ok = (page >= 0) & (page < num_pages)
        page = tl.where(ok, page, 0).to(tl.int64)
        p_x = base + page[:, None] * stride_page + (rows % page_size)[:, None] * stride_row + o_d[None, :]
        m_x = (ok & in_seq)[:, None]
        if MASK_D:
            m_x = m_x & (o_d[None, :] < head_dim)
        # ``ok ^ True`` is ``~ok``, which the interpreters of Triton 3.2 and 3.3 cannot evaluate on booleans.
        return tl.load(p_x, mask=m_x, other=0.0), in_seq & (ok ^ True)
    elif MASK_ROWS and MASK_FIRST:
        p_x = base + row0.to(tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
        m_x = in_seq[:, None]
        if MASK_D:
            m_x = m_x & (o_d[None, :] < head_dim)
        return tl.load(p_x, mask=m_x, other=0.0), o_r < 0
    else:
        return load_tile(base, row0, stride_row, n_rows, head_dim, o_r, o_d, MASK_ROWS, MASK_D), o_r < 0


@triton.jit
def load_rows(base, o_row, m_rows, head_dim, o_d, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    """Load a tile whose row ``i`` starts at ``base + o_row[i]`` (a gather of rows, such as the
    query heads of one group packed into one tile), 0 where ``m_rows`` is False."""
    p_x = base + o_row[:, None] + o_d[None, :]
    if MASK_ROWS:
        if MASK_D:
            return tl.load(p_x, mask=m_rows[:, None] & (o_d[None, :] < head_dim), other=0.0)
        else:
            return tl.load(p_x, mask=m_rows[:, None], other=0.0)
    else:
        if MASK_D:
            return tl.load(p_x, mask=o_d[None, :] < head_dim, other=0.0)
        else:
            return tl.load(p_x)


@triton.jit
def store_rows(base, o_row, m_rows, head_dim, o_d, b_x, MASK_ROWS: tl.constexpr, MASK_D: tl.constexpr):
    """Store the tile ``b_x``, row ``i`` at ``base + o_row[i]``, where ``m_rows`` is True."""
    p_x = base + o_row[:, None] + o_d[None, :]
    b_x = b_x.to(p_x.dtype.element_ty)
    if MASK_ROWS:
        if MASK_D:
            tl.store(p_x, b_x, mask=m_rows[:, None] & (o_d[None, :] < head_dim))
        else:
            tl.store(p_x, b_x, mask=m_rows[:, None])
    else:
        if MASK_D:
            tl.store(p_x, b_x, mask=o_d[None, :] < head_dim)
        else:
            tl.store(p_x, b_x)


@triton.jit
def key_blocks(q_start, q_last, seqlen_k, lo_offset, hi_offset,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks that query rows ``[q_start, q_last]`` must visit, in three stages.

    Query ``i`` sees key ``j`` iff ``0 <= j < seqlen_k``, ``j >= i + lo_offset`` (with
    ``MASK_LEFT``) and ``j <= i + hi_offset`` (with ``MASK_RIGHT``). Returns
    ``(begin, full_begin, full_end, end)``: keys ``[full_begin, full_end)`` lie in whole blocks
    that every row sees in full (no mask needed); ``[begin, full_begin)`` and ``[full_end, end)``
    need masks; keys outside ``[begin, end)`` are seen by no row and are skipped.
    """
    if MASK_LEFT:
        begin = tl.minimum(tl.maximum(q_start + lo_offset, 0), seqlen_k)
        begin = (begin // BLOCK_N) * BLOCK_N
    else:
        begin = 0
    if MASK_RIGHT:
        end = tl.minimum(tl.maximum(q_last + hi_offset + 1, 0), seqlen_k)
    else:
        end = seqlen_k
    if MASK_LEFT:
        full_begin = tl.minimum(tl.maximum(q_last + lo_offset, begin), end)
        full_begin = tl.minimum(tl.cdiv(full_begin, BLOCK_N) * BLOCK_N, end)
    else:
        full_begin = begin
    if MASK_RIGHT:
        full_end = tl.minimum(tl.maximum(q_start + hi_offset + 1, full_begin), end)
    else:
        full_end = end
    full_end = tl.maximum((full_end // BLOCK_N) * BLOCK_N, full_begin)
    return begin, full_begin, full_end, end


@triton.jit
def loop_bound(x):
    """A ``range`` bound computed in the kernel: ``x`` itself (inlined away by the compiler).

    Under Triton's interpreter this name is ``_interpreted_loop_bound`` instead (see below).
    """
    return x


def _interpreted_loop_bound(x):
    """``x`` as a Python int, for a ``range`` run by Triton's interpreter.

    The interpreter holds a scalar as a one-element numpy array and turns it into a Python int
    with ``int(array)``, which NumPy 2.4 refuses for arrays of ndim > 0 ("only 0-dimensional
    arrays can be converted to Python scalars"); only the interpreters of Triton 3.9 and later
    squeeze the array first. ``item()`` reads any one-element array on every Triton and NumPy.
    """
    if isinstance(x, tl.tensor):
        return x.handle.data.item()
    if isinstance(x, tl.constexpr):
        return x.value
    return x


if not isinstance(loop_bound, triton.runtime.JITFunction):  # triton.jit chose the interpreter
    loop_bound = _interpreted_loop_bound


@triton.jit
def stage_bounds(stage: tl.constexpr, begin, full_begin, full_end, end, UNMASKED_LAST: tl.constexpr = False):
    """The range of stage 0 (masked edge), 1 (no mask) or 2 (masked edge) of a three-stage loop;
    with ``UNMASKED_LAST`` the stages run in the order 0, 2, 1: stage 1 is the masked edge and
    stage 2 the unmasked middle. (The order is chosen here, from constexprs: a constexpr assigned
    to a name in a kernel becomes a runtime value.)"""
    if stage == 0:
        return begin, full_begin
    elif (stage == 1) != UNMASKED_LAST:
        return full_begin, full_end
    else:
        return full_end, end


@triton.jit
def query_blocks(k_start, seqlen_q, lo_offset, hi_offset,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see any of keys ``[k_start, k_start + BLOCK_N)``; the mirror of ``key_blocks``.

    Returns ``(begin, full_begin, full_end, end)`` over query rows, each a multiple of ``BLOCK_M``
    except where clamped to ``end``. Rows past ``seqlen_q`` inside the last block are harmless
    without a mask: they load q = dO = 0 and so contribute nothing to dK and dV.
    """
    k_last = k_start + BLOCK_N - 1
    m_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if MASK_RIGHT:
        begin = tl.minimum(tl.maximum(k_start - hi_offset, 0), m_end)
        begin = (begin // BLOCK_M) * BLOCK_M
    else:
        begin = 0
    if MASK_LEFT:
        end = tl.minimum(tl.maximum(k_last - lo_offset + 1, 0), m_end)
    else:
        end = m_end
    if MASK_RIGHT:
        full_begin = tl.minimum(tl.maximum(k_last - hi_offset, begin), end)
        full_begin = tl.minimum(tl.cdiv(full_begin, BLOCK_M) * BLOCK_M, end)
    else:
        full_begin = begin
    if MASK_LEFT:
        full_end = tl.minimum(tl.maximum(k_start - lo_offset + 1, full_begin), end)
        full_end = tl.maximum((full_end // BLOCK_M) * BLOCK_M, full_begin)
    else:
        full_end = end
    return begin, full_begin, full_end, end


@triton.jit
def tanh(x):
    """``tanh(x)`` in fp32 within about 1.2 ulp for every ``x``.

    The softcap multiplies tanh's error by the softcap (50 for Gemma 2), so the usual
    ``1 - 2 / (exp(2x) + 1)`` over the whole range (absolute error ~1e-7, huge relative error near 0)
    is not enough, and neither is 2 ulp: with inputs at 4x unit scale, the fp32 forward at softcap 50
    then misses the accuracy rule where torch's own error happens to be small.
    Below ``|x| = 1``: ``x + x^3 P(x^2)`` with ``P`` of degree 6, fitted to ``(tanh(x) - x) / x^3``
    for minimal relative error (1.0 ulp in fp32 on a fine grid). From 1 on: ``1 - 2 / (E + 1)``
    with ``E = exp(2|x|) >= 7.4``: the subtracted term is at most 0.24, so its rounding reaches the
    result shrunk (1.2 ulp; ``E`` overflowing to inf gives exactly 1). ``2.885...`` is ``2 * log2(e)``.
    """
    y = x * x
    p = -0.000361991273835488
    p = p * y + 0.0023115580491933838
    p = p * y - 0.007957543816657621
    p = p * y + 0.021493144320809815
    p = p * y - 0.05388185536481841
    p = p * y + 0.13332381528141546
    p = p * y - 0.3333329844327351
    near_zero = x + x * y * p
    far = 1.0 - 2.0 / (tl.math.exp2(tl.abs(x) * 2.8853900817779268) + 1.0)
    far = tl.where(x < 0.0, -far, far)
    return tl.where(tl.abs(x) < 1.0, near_zero, far)


@triton.jit
def scores(b_qk, o_q, o_k, seqlen_k, lo_offset, hi_offset, diag_offset, sm_scale, softcap, slope,
           MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
           SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Turn raw ``q . k`` products into softmax logits (natural units); returns ``(logits, tanh)``.

    ``o_q`` and ``o_k`` are query and key indices broadcastable to ``b_qk``'s shape, so the same
    code serves ``[queries, keys]`` tiles (forward, dQ) and ``[keys, queries]`` tiles (dK, dV).
    In natural units the logit is ``softcap * tanh(qk * sm_scale / softcap)`` (or ``qk * sm_scale``),
    minus ``slope * |i + diag_offset - j|`` with ALiBi. Masked entries are ``-inf``. The backward
    subtracts the log-sum-exp in these units and only then multiplies by ``log2(e)`` for ``exp2``:
    the difference is small, so scaling it rounds little, where a logit scaled first would carry
    the rounding of a number 1.44 times as large (the forward scales first; see there). ``tanh``
    is returned for the softcap's backward (``d logit / d qk = sm_scale * (1 - tanh^2)``); without
    softcap it is unused.
    """
    if SOFTCAP:
        b_t = tanh(b_qk * (sm_scale / softcap))
        b_s = softcap * b_t
    else:
        b_t = b_qk
        b_s = b_qk * sm_scale
    if ALIBI:
        b_s = b_s - slope * tl.abs((o_q + diag_offset - o_k).to(tl.float32))
    if MASKED:
        b_s = tl.where(visible(o_q, o_k, seqlen_k, lo_offset, hi_offset, MASK_LEFT, MASK_RIGHT), b_s, float("-inf"))
    return b_s, b_t


@triton.jit
def visible(o_q, o_k, seqlen_k, lo_offset, hi_offset, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Whether query ``o_q`` sees key ``o_k`` (broadcast): ``o_k < seqlen_k``, and the window's
    ``o_q + lo_offset <= o_k <= o_q + hi_offset`` on the sides ``MASK_LEFT``/``MASK_RIGHT`` bound."""
    m_valid = o_k < seqlen_k
    if MASK_RIGHT:
        m_valid = m_valid & (o_k <= o_q + hi_offset)
    if MASK_LEFT:
        m_valid = m_valid & (o_k >= o_q + lo_offset)
    return m_valid


@triton.jit
def sees_one_key(o_q, seqlen_k, lo_offset, hi_offset, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Whether query rows ``o_q`` see exactly one key (``key_blocks``' masks).

    Such a row's softmax is exactly 1 on that key, so its ``dS = P * (dP - delta)`` is exactly 0.
    Computed, it is not: ``dP = dO . v`` comes from the matrix product and ``delta = dO . out``
    from a row sum, two fp32 sums of the same products in different orders, which leaves their
    rounding noise in dQ and dK where the true gradient is 0. The backward stores the exact 0.
    """
    first = tl.zeros_like(o_q)
    last = first + seqlen_k - 1
    if MASK_LEFT:
        first = tl.maximum(o_q + lo_offset, first)
    if MASK_RIGHT:
        last = tl.minimum(o_q + hi_offset, last)
    return first == last


def rows_see_one_key_at_most(seqlen_q: int, seqlen_k: int, diag_offset: int, window_left: int, window_right: int,
                             mask_left: bool, mask_right: bool, varlen: bool) -> bool:
    """Whether no query row of a launch sees more than one key (``sees_one_key``'s masks): row
    ``i`` sees keys ``max(0, i + diag_offset - window_left)`` (with ``mask_left``) to
    ``min(seqlen_k - 1, i + diag_offset + window_right)`` (with ``mask_right``). The count is
    piecewise linear in ``i``, so its largest value is at an end of ``[0, seqlen_q)`` or where a
    bound stops being clamped. With ``varlen`` each sequence aligns its own diagonal, unknown here:
    only a window of width one (both edges, ``window_left + window_right == 0``) qualifies."""
    if seqlen_k <= 1 or (mask_left and mask_right and window_left + window_right <= 0):
        return True
    if varlen:
        return False
    if seqlen_q <= 0:
        return True
    lo = diag_offset - window_left if mask_left else None
    hi = diag_offset + window_right if mask_right else None
    rows = {0, seqlen_q - 1}
    rows.update(min(max(r, 0), seqlen_q - 1) for r in ((-lo,) if lo is not None else ()) + (
        (seqlen_k - 1 - hi,) if hi is not None else ()))
    for row in rows:
        first = max(0, row + lo) if lo is not None else 0
        last = min(seqlen_k - 1, row + hi) if hi is not None else seqlen_k - 1
        if last - first >= 1:
            return False
    return True


@triton.jit
def grid_id(axis: tl.constexpr, GRID_FOLD: tl.constexpr):
    """This program's id on ``axis`` of the grid ``(n0, heads, batch)`` its launcher planned: every
    kernel reads its ids here, in place of ``tl.program_id`` (``flash_recipe.ops.launch``).

    ``GRID_FOLD`` is the launch's fold (``launch.fold_grid``): 1 for the planned grid as launched
    (the id is the program id, and compiles as ``tl.program_id`` alone); ``F > 1`` (a power of two)
    for a batch past CUDA's axis-2 limit folded into axis 0, launched as
    ``(n0 * F, heads, cdiv(batch, F))``, where program ``(i0 * F + r, h, j)`` serves axis-0 id
    ``i0`` of batch entry ``j * F + r``. A batch entry from ``fold_batch`` on is the fold's
    padding, for the kernel to skip.
    """
    i = tl.program_id(axis)
    if GRID_FOLD > 1:
        if axis == 0:
            i = i // GRID_FOLD
        if axis == 2:
            i = i * GRID_FOLD + tl.program_id(0) % GRID_FOLD
    return i


@triton.jit
def grid_programs(axis: tl.constexpr, GRID_FOLD: tl.constexpr):
    """``tl.num_programs(axis)`` of the planned grid (``grid_id``), for axes 0 and 1: a folded
    grid's batch is its launch's ``fold_batch``."""
    tl.static_assert(axis != 2 or GRID_FOLD == 1, "a folded grid's batch is fold_batch, not its axis 2")
    n = tl.num_programs(axis)
    if GRID_FOLD > 1:
        if axis == 0:
            n = n // GRID_FOLD
    return n


@triton.jit
def sequence(CU_SEQLENS, i_b, seqlen, total, VARLEN: tl.constexpr, ENDS=None):
    """``(first row, length)`` of sequence ``i_b``: rows ``CU_SEQLENS[i_b]:CU_SEQLENS[i_b + 1]``
    (or ``:ENDS[i_b]``) when varlen, else ``(0, seqlen)``.

    The offsets are clamped to the ``total`` rows of the packed tensor, so offsets that were not
    checked (on a GPU they are trusted, as flash-attn trusts them) never address a row outside it.
    """
    if VARLEN:
        if ENDS is None:
            ENDS = CU_SEQLENS + 1
        # As unsigned, a negative offset is above every total and is clamped to it.
        limit = tl.zeros([], dtype=tl.uint32) + total  # (a total of 1 arrives as a constexpr)
        bos = tl.minimum(tl.load(CU_SEQLENS + i_b).to(tl.uint32, bitcast=True), limit)
        eos = tl.maximum(tl.minimum(tl.load(ENDS + i_b).to(tl.uint32, bitcast=True), limit), bos)
        return bos.to(tl.int64), (eos - bos).to(tl.int32)
    else:
        return tl.zeros([], dtype=tl.int64), seqlen


@triton.jit
def sequences(CU_Q, CU_K, i_b, seqlen_q, seqlen_k, total_q, total_k, diag_offset, VARLEN: tl.constexpr):
    """The prologue of a program of batch entry ``i_b`` over queries and keys: ``(bos_q, seqlen_q,
    bos_k, seqlen_k, diag_offset)``, each side's first row and length (``sequence``) and the
    diagonal's offset (a varlen sequence aligns bottom-right: ``seqlen_k - seqlen_q`` of its own
    lengths). The window's edges are ``diag_offset - window_left`` and ``diag_offset + window_right``."""
    bos_q, seqlen_q = sequence(CU_Q, i_b, seqlen_q, total_q, VARLEN)
    bos_k, seqlen_k = sequence(CU_K, i_b, seqlen_k, total_k, VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
    return bos_q, seqlen_q, bos_k, seqlen_k, diag_offset


@triton.jit
def dropout_keep(seed, rng_base, o_q, o_k, rng_stride, dropout_p):
    """Which attention probabilities dropout keeps: True with probability ``1 - dropout_p``.

    Counter-based (Philox): entry ``(i, j)`` of a head draws the number at offset
    ``rng_base + i * rng_stride + j`` from ``seed``, so the forward and the backward, whatever
    their tiling, regenerate the same mask. ``o_q`` and ``o_k`` broadcast like in ``scores``.
    """
    offsets = rng_base + o_q.to(tl.int64) * rng_stride + o_k
    return tl.rand(seed, offsets) >= dropout_p
