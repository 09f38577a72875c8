"""Attention over a KV cache: flash-attn 2's ``flash_attn_with_kvcache`` and paged varlen keys.

Validation and backend choice live here; the Triton path is ``flash_recipe.ops.kvcache``. The
other backends (``sdpa``, ``reference``) run the same semantics in torch: rotary and cache writes
with indexing, then one dense attention call per batch entry over its gathered keys. Both are
forward only, as upstream.

Metadata values (``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad``, ``block_table``,
``cu_seqlens``) are checked when they are on the CPU (or given as ints). On a GPU, reading them
would synchronise every decoding step, so there the kernels bound every access instead: a write
through a bad index is skipped and the affected batch entry's output is NaN, never a stray
memory access or a plausible wrong number.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from flash_recipe import api, dispatch
from flash_recipe.dispatch import AttentionCall

PAGE_MULTIPLE = 16  # page sizes must be multiples of this (the smallest key block)
FLASH_ATTN_PAGE_MULTIPLE = 256  # upstream flash-attn's paged-cache requirement


@dataclasses.dataclass(frozen=True)
class CacheCall:
    """A validated ``flash_attn_with_kvcache`` call; ``table`` int32 ``(B, width)`` addresses the
    cache as pages of ``k_cache.shape[1]`` rows (a dense cache: one page per cache row)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary: Optional[tuple]  # (cos, sin, interleaved)
    seqlens: torch.Tensor  # int32 (B,)
    leftpad: Optional[torch.Tensor]
    table: torch.Tensor
    paged: bool
    attention: AttentionCall  # the score options; q, k_cache, v_cache stand in for the tensors
    num_splits: int
    user_args: dict  # the arguments for upstream flash-attn: as given, with metadata made contiguous

    @property
    def new_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]


def _check_index(name: str, t, shape: tuple, device) -> torch.Tensor:
    """Check an int32 metadata tensor and return it contiguous (a copy only when it is a strided view)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}")
    return t.contiguous()


def _check_pages(name: str, table: torch.Tensor, num_pages: int, page_size: int, starts, ends) -> None:
    """Every page that rows ``[starts[b], ends[b])`` touch must exist (CPU values only)."""
    if table.device.type != "cpu":
        return
    rows = table.tolist()
    for b, (lo, hi) in enumerate(zip(starts, ends)):
        if hi <= lo:
            continue
        used = rows[b][lo // page_size:(hi - 1) // page_size + 1]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"{name}[{b}] holds page indices {bad} outside [0, {num_pages}) (num_blocks)")


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim: int) -> None:
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}")
        if t.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}")
    if not 1 <= 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]}) must be in [2, headdim = {head_dim}]")
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys: pass k and v with them")


def _check_cache_tensors(q, k_cache, v_cache, k, v) -> tuple:
    """Check the tensors; return them with a last dim of size 1 given stride 1 (``api.unit_last_stride``)."""
    api._check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"), same_batch=False)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if k is not None:
        api._check_qkv(q, k, v)
        if k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k must have nheads_k = {k_cache.shape[2]} like k_cache, got {k.shape[2]}")
    q, k_cache, v_cache, k, v = (None if t is None else api.unit_last_stride(t) for t in (q, k_cache, v_cache, k, v))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")
    return q, k_cache, v_cache, k, v


def _cache_seqlens(cache_seqlens, batch: int, full: int, device) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((batch,), full, dtype=torch.int32, device=device)
    if api.is_int(cache_seqlens):
        length = api.check_int("cache_seqlens", cache_seqlens, minimum=0)
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor (batch_size,) or None, got {type(cache_seqlens).__name__}")
    return _check_index("cache_seqlens", cache_seqlens, (batch,), device)


def build_cache_call(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
) -> CacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments (see there) and build the call."""
    user_args = dict(
        k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
        return_softmax_lse=return_softmax_lse,
    )
    q, k_cache, v_cache, k, v = _check_cache_tensors(q, k_cache, v_cache, k, v)
    batch, seqlen_q, nheads, head_dim = q.shape
    window = api.check_window(causal, window_size)
    softcap = api.check_softcap(softcap)
    if alibi_slopes is not None:
        api._check_alibi(alibi_slopes, batch, nheads, q.device)
    num_splits = api.check_int("num_splits", num_splits, minimum=0, meaning="0 chooses automatically")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(rotary_cos, rotary_sin, q, k, head_dim)
        rotary = (rotary_cos, rotary_sin, rotary_interleaved)

    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the page table already maps batches)")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError("block_table must be an int32 tensor (batch_size, max_num_blocks_per_seq)")
        block_table = _check_index("block_table", block_table, (batch, block_table.shape[1]), q.device)
        if page_size % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"the page size (k_cache.shape[1] with a block_table) must be a multiple of {PAGE_MULTIPLE}, got {page_size}"
            )
        table = block_table
    else:
        if cache_batch_idx is not None:
            cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, (batch,), q.device)
            if cache_batch_idx.device.type == "cpu":
                bad = [i for i in cache_batch_idx.tolist() if not 0 <= i < num_pages]
                if bad:
                    raise ValueError(f"cache_batch_idx holds {bad} outside [0, {num_pages}) (k_cache.shape[0])")
            table = cache_batch_idx.view(batch, 1)
        else:
            if num_pages < batch:
                raise ValueError(
                    f"k_cache must hold at least batch_size = {batch} sequences without cache_batch_idx, got {num_pages}"
                )
            table = torch.arange(batch, dtype=torch.int32, device=q.device).view(batch, 1)
    capacity = table.shape[1] * page_size
    seqlens = _cache_seqlens(cache_seqlens, batch, capacity, q.device)
    if cache_leftpad is not None:
        cache_leftpad = _check_index("cache_leftpad", cache_leftpad, (batch,), q.device)
    new = 0 if k is None else k.shape[1]

    lengths = None  # known on the host: an int, None (the whole cache) or a CPU tensor
    if not isinstance(cache_seqlens, torch.Tensor):
        lengths = [capacity if cache_seqlens is None else api.check_int("cache_seqlens", cache_seqlens)] * batch
    elif seqlens.device.type == "cpu":
        lengths = seqlens.tolist()
    if lengths is not None:
        pads = cache_leftpad.tolist() if cache_leftpad is not None and cache_leftpad.device.type == "cpu" else None
        for b, n in enumerate(lengths):
            if n < 0:
                raise ValueError(f"cache_seqlens must be >= 0, got {n} for batch {b}")
            if n + new > capacity:
                raise ValueError(
                    f"cache overflow: cache_seqlens[{b}] + seqlen_new = {n} + {new} exceeds the cache capacity {capacity}"
                )
            if pads is not None and not 0 <= pads[b] <= n:
                raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {n}]")
        if rotary is not None:
            moves = window != (-1, -1)
            last = max((n + max(new, seqlen_q if moves else 1) - 1 for n in lengths), default=-1)
            if last >= rotary_cos.shape[0]:
                raise ValueError(
                    f"rotary_cos/rotary_sin cover positions [0, {rotary_cos.shape[0]}), position {last} is needed"
                )
        starts = pads if pads is not None else [0] * batch
        if block_table is not None:
            _check_pages("block_table", block_table, num_pages, page_size, starts, [n + new for n in lengths])

    attention = AttentionCall(
        q=q, k=k_cache, v=v_cache, softmax_scale=api._check_scale(softmax_scale, head_dim), causal=causal,
        diag_offset=k_cache.shape[1] - seqlen_q, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        return_lse=return_softmax_lse,
    )
    if isinstance(cache_seqlens, torch.Tensor):
        user_args["cache_seqlens"] = seqlens
    user_args.update(cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                     window_size=window, num_splits=int(num_splits))
    return CacheCall(q, k_cache, v_cache, k, v, rotary, seqlens, cache_leftpad, table, block_table is not None,
                     attention, int(num_splits), user_args)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention for incremental decoding over a KV cache, with flash-attn 2's signature.

    If ``k`` and ``v`` are given they are written into the cache in place at rows
    ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` (the cache must have room), then q attends
    over rows ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` of its cache entry, with the
    causal mask and window aligned bottom-right as in ``flash_attn_func``. Forward only.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or with a
            ``block_table`` a paged cache ``(num_blocks, page_block_size, nheads_k, headdim)``;
            ``page_block_size`` may be any multiple of 16.
        k, v: optional new keys/values ``(batch_size, seqlen_new, nheads_k, headdim)``.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)``, q's dtype or float32;
            rotate the new keys at positions ``cache_seqlens + i`` and q at ``cache_seqlens + i``
            when causal or local, else all of q at ``cache_seqlens``. Need ``k`` and ``v``.
        cache_seqlens: int or int32 ``(batch_size,)``: rows already in each cache entry (None:
            the whole cache).
        cache_batch_idx: int32 ``(batch_size,)``: the cache entry of each batch element (default
            ``0..batch_size-1``); not with ``block_table``. Duplicates make the written rows
            come from any one of them.
        cache_leftpad: int32 ``(batch_size,)``: the first valid cache row (left padding).
        block_table: int32 ``(batch_size, max_num_blocks_per_seq)``: the pages of each sequence.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func``;
            positions count from ``cache_leftpad``.
        rotary_interleaved: rotate dims ``(0, 1), (2, 3), ...`` (True) or ``(0, rotary_dim / 2), ...``
            (False, GPT-NeoX).
        num_splits: split each row's keys over this many programs and merge (split-KV), so one
            query token over a long cache still fills the GPU; 0 chooses from the GPU's size.
        return_softmax_lse: also return the log-sum-exp ``(batch_size, nheads, seqlen_q)`` float32.

    Returns:
        ``out (batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``.
    """
    call = build_cache_call(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse,
    )
    backend = dispatch.select(call.attention, extra=lambda b: _cache_refusal(b, call))
    if backend.name == "flash_attn":
        import flash_attn

        return flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **call.user_args)
    run = (lambda: _run_triton(call)) if backend.name == "triton" else (lambda: _run_torch(call, backend))
    out, lse = forward_only("flash_attn_with_kvcache", run, q, k, v)
    return (out, lse) if return_softmax_lse else out


class _ForwardOnly(torch.autograd.Function):
    """A forward-only computation joined to the graph of its inputs: the backward raises."""

    @staticmethod
    def forward(ctx, what: str, run, *inputs):
        ctx.what = what
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.what} has no backward (it is an inference path, as in flash-attn); compute the loss through "
            f"flash_attn_func or flash_attn_varlen_func without block_table, or detach its inputs"
        )


def forward_only(what: str, run, *inputs) -> tuple:
    """``run()`` (returning ``(out, lse or None)``) for a path that has no backward.

    As flash-attn, the forward runs on inputs that require grad; when they do (and grad mode is
    on) the outputs are attached to them, so that a backward reaching ``what`` raises a clear
    error instead of leaving the inputs silently without a gradient.
    """
    tensors = [t for t in inputs if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        with torch.no_grad():
            return run()
    return _ForwardOnly.apply(what, run, *tensors)


def _cache_refusal(backend: dispatch.Backend, call: CacheCall) -> Optional[str]:
    if backend.name == "flash_attn" and call.paged and call.k_cache.shape[1] % FLASH_ATTN_PAGE_MULTIPLE:
        return f"flash_attn needs a page size that is a multiple of {FLASH_ATTN_PAGE_MULTIPLE}, got {call.k_cache.shape[1]}"
    if backend.name == "flash_attn" and call.rotary is not None and call.rotary[0].dtype != call.q.dtype:
        return "flash_attn needs rotary_cos/rotary_sin in q's dtype"
    return None


def _run_triton(call: CacheCall):
    from flash_recipe.ops.forward import Variant
    from flash_recipe.ops.kvcache import Cache, Rotary, attention_kvcache

    att = call.attention
    cache = Cache(call.k_cache, call.v_cache, call.table, call.seqlens, call.leftpad)
    rotary = Rotary(*call.rotary) if call.rotary is not None else None
    var = Variant(0, att.window[0], att.window[1], att.softcap, att.alibi_slopes)
    return attention_kvcache(call.q, call.k, call.v, cache, rotary, att.softmax_scale, var, call.num_splits)


def _slots(pages: torch.Tensor, table_row: list, start: int, end: int) -> tuple:
    """Index tensors ``(page, row)`` of rows ``[start, end)`` of one sequence of a paged tensor
    ``(num_pages, page_size, ...)``: ``pages[_slots(...)]`` reads them, assigning to it writes."""
    page_size = pages.shape[1]
    idx = torch.arange(start, end, device=pages.device)
    return torch.tensor(table_row, dtype=torch.long, device=pages.device)[idx // page_size], idx % page_size


def _rows(pages: torch.Tensor, table_row: list, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of one sequence of a paged tensor ``(num_pages, page_size, ...)``."""
    return pages[_slots(pages, table_row, start, end)]


def _run_torch(call: CacheCall, backend: dispatch.Backend):
    """The KV-cache semantics in torch, then one dense attention call per batch entry."""
    from flash_recipe.reference import rotary_reference

    q, att = call.q, call.attention
    batch, seqlen_q = q.shape[:2]
    lengths = call.seqlens.tolist()
    table = call.table.tolist()
    pads = call.leftpad.tolist() if call.leftpad is not None else [0] * batch
    new = call.new_tokens
    pos = torch.tensor(lengths, device=q.device)[:, None]
    k_new = call.k
    if call.rotary is not None:
        cos, sin, interleaved = call.rotary
        k_new = rotary_reference(k_new, cos, sin, pos + torch.arange(new, device=q.device), interleaved)
        step = 1 if att.window != (-1, -1) else 0
        q = rotary_reference(q, cos, sin, pos + step * torch.arange(seqlen_q, device=q.device), interleaved)
    with torch.no_grad():
        for b in range(batch):
            if new:
                slots = _slots(call.k_cache, table[b], lengths[b], lengths[b] + new)
                call.k_cache[slots] = k_new[b]
                call.v_cache[slots] = call.v[b]
        outs, lses = [], []
        for b in range(batch):
            k = _rows(call.k_cache, table[b], pads[b], lengths[b] + new)[None]
            v = _rows(call.v_cache, table[b], pads[b], lengths[b] + new)[None]
            slopes = att.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b:b + 1]
            part = dataclasses.replace(att, q=q[b:b + 1], k=k, v=v, diag_offset=k.shape[1] - seqlen_q, alibi_slopes=slopes)
            out, lse, _ = backend.run(part)
            outs.append(out)
            lses.append(lse)
    lse = torch.cat(lses) if att.return_lse else None
    return torch.cat(outs), lse


def paged_varlen(call: AttentionCall, block_table) -> tuple:
    """``flash_attn_varlen_func`` with a paged ``k, v (num_blocks, page_size, nheads_k, headdim)``
    (``call`` validated by ``flash_recipe.api`` with ``paged=True``): sequence ``b``'s key ``j`` is
    row ``j % page_size`` of page ``block_table[b, j // page_size]``, and ``cu_seqlens_k`` gives only
    the lengths. Forward only. Returns ``(out, lse or None, None)`` like ``dispatch.run``."""
    q, k = call.q, call.k
    batch = call.cu_seqlens_q.numel() - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be an int32 tensor (batch_size, max_num_blocks_per_seq)")
    block_table = _check_index("block_table", block_table, (batch, block_table.shape[1]), q.device)
    num_pages, page_size = k.shape[0], k.shape[1]
    if page_size % PAGE_MULTIPLE != 0:
        raise ValueError(f"the page size (k.shape[1] with a block_table) must be a multiple of {PAGE_MULTIPLE}, got {page_size}")
    if call.dropout_p > 0.0:
        raise NotImplementedError("dropout is not supported with block_table (paged KV is for inference); pass dropout_p=0.0")
    lengths_k = call.cu_seqlens_k[1:] - call.cu_seqlens_k[:-1]
    capacity = block_table.shape[1] * page_size
    if call.cu_seqlens_k.device.type == "cpu":
        ends = lengths_k.tolist()
        if max(ends, default=0) > capacity:
            raise ValueError(f"a key sequence is longer than its block_table can address ({capacity} rows)")
        _check_pages("block_table", block_table, num_pages, page_size, [0] * batch, ends)
    backend = dispatch.select(call, extra=lambda b: "paged keys run on the triton backend or in torch"
                              if b.name == "flash_attn" else None)
    run = (lambda: _paged_varlen_triton(call, block_table, lengths_k)) if backend.name == "triton" else (
        lambda: _paged_varlen_torch(call, block_table, backend))
    out, lse = forward_only("flash_attn_varlen_func with block_table", run, q, k, call.v)
    return out, (lse if call.return_lse else None), None


def _paged_varlen_triton(call: AttentionCall, block_table: torch.Tensor, lengths_k: torch.Tensor) -> tuple:
    from flash_recipe.ops.forward import KeyRanges, Variant, Varlen, attention_forward

    var = Variant(0, call.window[0], 0 if call.causal else call.window[1], call.softcap, call.alibi_slopes)
    keys = KeyRanges(torch.zeros_like(lengths_k), lengths_k, call.max_seqlen_k, block_table)
    varlen = Varlen(call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k)
    return attention_forward(call.q, call.k, call.v, call.softmax_scale, var, varlen, keys)


def _paged_varlen_torch(call: AttentionCall, block_table: torch.Tensor, backend: dispatch.Backend) -> tuple:
    """Gather each sequence's pages into packed keys and run the backend's varlen call."""
    batch = call.cu_seqlens_q.numel() - 1
    table = block_table.tolist()
    starts = call.cu_seqlens_k.tolist()
    keys = [_rows(call.k, table[b], 0, starts[b + 1] - starts[b]) for b in range(batch)]
    values = [_rows(call.v, table[b], 0, starts[b + 1] - starts[b]) for b in range(batch)]
    total = torch.cat(keys) if keys else call.k.new_empty((0,) + tuple(call.k.shape[2:]))
    packed = dataclasses.replace(call, k=total, v=torch.cat(values) if values else total)
    out, lse, _ = backend.run_call(packed)
    return out, lse
