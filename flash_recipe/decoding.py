"""Attention over a KV cache: flash-attn 2's ``flash_attn_with_kvcache`` and paged varlen keys.

This is the public layer: it validates the arguments (``flash_recipe.validate``), builds a
``CacheCall`` or ``PagedCall`` and runs it on the backend ``flash_recipe.dispatch`` selects
(``Backend.run_cache`` / ``run_paged``). Both paths are forward only, as upstream.

Metadata values (``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad``, ``block_table``,
``cu_seqlens``) are checked when they are on the CPU (or given as ints). On a GPU, reading them
would synchronise every decoding step, so there the kernels bound every access instead: a write
through a bad index is skipped and the affected batch entry's output is NaN, never a stray
memory access or a plausible wrong number.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple, Optional, Union

import torch

from . import dispatch, validate
from .dispatch import AttentionCall, CacheCall, PagedCall
from .memo_keys import SHARED_INDEXES, TOKENS, Memo, shared_index, signature
from .ops.limits import MAX_SPLITS


def _check_cache_tensors(q, k_cache, v_cache, k, v) -> tuple:
    """Check the tensors; return them with a last dim of size 1 given stride 1 (``validate.unit_last_stride``)."""
    validate.check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"), same_batch=False)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    if k is not None:
        validate.check_qkv(q, k, v)
        if k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k must have nheads_k = {k_cache.shape[2]} like k_cache, got {k.shape[2]}")
    return validate.last_dim_contiguous(("q", "k_cache", "v_cache", "k", "v"), (q, k_cache, v_cache, k, v))


def _cache_seqlens(cache_seqlens, batch: int, full: int, device) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((batch,), full, dtype=torch.int32, device=device)
    if validate.is_int(cache_seqlens):
        length = validate.check_int("cache_seqlens", cache_seqlens, minimum=0)
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be an int, an int32 tensor (batch_size,) or None, got {type(cache_seqlens).__name__}"
        )
    return validate.check_index("cache_seqlens", cache_seqlens, (batch,), device)


def build_cache_call(q, k_cache, v_cache, **args) -> CacheCall:
    """Validate ``flash_attn_with_kvcache``'s arguments (see there) and build the call; ``args`` are
    its keyword arguments after ``v_cache``, every one of them.

    The first call of a signature (``flash_recipe.memo_keys``) runs every check; a call with the
    same signature reuses the verdict, unless it passes metadata whose values the checks read on
    the host (``validate.on_host``): those calls are checked in full each time.
    """
    seqlens = args["cache_seqlens"]
    metadata = (
        seqlens if isinstance(seqlens, torch.Tensor) else None,
        args["cache_batch_idx"],
        args["cache_leftpad"],
        args["block_table"],
    )
    k, v = args["k"], args["v"]
    key = None
    if not torch.compiler.is_compiling():
        key = signature(
            (
                q,
                k_cache,
                v_cache,
                k,
                v,
                args["rotary_cos"],
                args["rotary_sin"],
                args["alibi_slopes"],
                args["learnable_sink"],
                *metadata,
            ),
            ("kvcache_call", None if metadata[0] is not None else seqlens) + _CACHE_OPTION_VALUES(args),
        )
        form = _CACHE_CALLS.get(key) if key is not None else None
        if form is not None:
            return _repeat_cache_call(form, q, k_cache, v_cache, args)
    call = _checked_cache_call(q, k_cache, v_cache, _upstream_args(args), **args)
    given = (q, k_cache, v_cache, k, v, args["learnable_sink"])
    passed = all(
        a is b for a, b in zip((call.q, call.k_cache, call.v_cache, call.k, call.v, call.attention.sinks), given)
    )
    checked = (
        call.seqlens if metadata[0] is not None else None,
        call.user_args["cache_batch_idx"],
        call.leftpad,
        call.user_args["block_table"],
    )
    unchanged = all(a is b for a, b in zip(checked, metadata))
    if key is not None and passed and unchanged and not any(t is not None and validate.on_host(t) for t in metadata):
        fields = {
            f.name: getattr(call.attention, f.name)
            for f in dataclasses.fields(call.attention)
            if f.name not in ("q", "k", "v", "alibi_slopes", "sinks", "signature")
        }
        capacity = call.table.shape[1] * k_cache.shape[1]
        token = next(TOKENS)
        _CACHE_CALLS.keep(
            key, _CacheForm(token, fields, call.num_splits, call.paged, capacity, args["rotary_interleaved"])
        )
        call.attention.signed(token)
    return call


class _CacheForm(NamedTuple):
    """What a checked ``flash_attn_with_kvcache`` call of one signature derived (``build_cache_call``)."""

    token: int  # what the call's attention is signed with (``memo_keys.TOKENS``)
    fields: dict  # the AttentionCall's fields other than its tensors
    num_splits: int
    paged: bool
    capacity: int  # rows one batch entry's cache can address
    interleaved: bool  # rotary_interleaved


# Signature of a flash_attn_with_kvcache call -> its ``_CacheForm``.
_CACHE_CALLS = Memo()
# The options of a call beside its tensors, which its signature holds as values.
_CACHE_OPTIONS = (
    "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved", "num_splits", "return_softmax_lse"
)  # fmt: skip
_CACHE_OPTION_VALUES = operator.itemgetter(*_CACHE_OPTIONS)  # their values from the arguments, as a tuple


def _upstream_args(args: dict) -> dict:
    """The keyword arguments upstream flash-attn 2 takes, as given: all but ``learnable_sink``."""
    return {name: value for name, value in args.items() if name != "learnable_sink"}


def _repeat_cache_call(form: _CacheForm, q, k_cache, v_cache, args: dict) -> CacheCall:
    """The ``CacheCall`` of a call whose signature was checked before (see ``build_cache_call``):
    what the checks derived, from ``form``, with this call's tensors from ``args``."""
    batch = q.shape[0]
    cache_seqlens, cache_batch_idx, block_table = args["cache_seqlens"], args["cache_batch_idx"], args["block_table"]
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = cache_seqlens
    else:
        seqlens = torch.full(
            (batch,), form.capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32, device=q.device
        )
    if block_table is not None:
        table = block_table
    elif cache_batch_idx is not None:
        table = cache_batch_idx.view(batch, 1)
    else:  # entry b at cache row b, one index shared by every such call
        device = q.device
        table = SHARED_INDEXES.get(("rows", batch, device))
        if table is None:
            table = shared_index("rows", batch, device)
    attention = AttentionCall.repeated(
        form.fields,
        form.token,
        q=q,
        k=k_cache,
        v=v_cache,
        alibi_slopes=args["alibi_slopes"],
        sinks=args["learnable_sink"],
    )
    rotary_cos = args["rotary_cos"]
    rotary = None if rotary_cos is None else (rotary_cos, args["rotary_sin"], form.interleaved)
    # As the checked call gives them to upstream flash-attn: the window it masks, the split count as an int.
    user_args = _upstream_args(args)
    user_args.update(window_size=attention.window, num_splits=form.num_splits)
    return CacheCall(
        q, k_cache, v_cache, args["k"], args["v"], rotary, seqlens, args["cache_leftpad"], table, form.paged,
        attention, form.num_splits, user_args,
    )  # fmt: skip


def _checked_batch_idx(cache_batch_idx, batch: int, num_pages: int, device) -> torch.Tensor:
    """``cache_batch_idx`` checked: an int32 index ``(batch,)`` on ``device``, every value (read
    where it lies on the host) a row of the cache."""
    cache_batch_idx = validate.check_index("cache_batch_idx", cache_batch_idx, (batch,), device)
    if validate.on_host(cache_batch_idx):
        bad = [i for i in cache_batch_idx.tolist() if not 0 <= i < num_pages]
        if bad:
            raise ValueError(f"cache_batch_idx holds {bad} outside [0, {num_pages}) (k_cache.shape[0])")
    return cache_batch_idx


def _cache_table(block_table, cache_batch_idx, batch: int, num_pages: int, device) -> torch.Tensor:
    """The cache rows of each batch entry, ``(batch, pages per entry)``: the page table, the batch
    index as one page per entry, or entry ``b`` at row ``b`` (the cache must hold ``batch`` rows)."""
    if block_table is not None:
        return block_table
    if cache_batch_idx is not None:
        return cache_batch_idx.view(batch, 1)
    if num_pages < batch:
        raise ValueError(
            f"k_cache must hold at least batch_size = {batch} sequences without cache_batch_idx, got {num_pages}"
        )
    return torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)


def _check_lengths(lengths: list, pads: Optional[list], new: int, capacity: int) -> None:
    """Each entry's length, known on the host: at least 0, room for the ``new`` rows in the
    ``capacity``, and its left padding (where known) within it."""
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {n} for batch {b}")
        if n + new > capacity:
            raise ValueError(
                f"cache overflow: cache_seqlens[{b}] + seqlen_new = {n} + {new} exceeds the cache capacity {capacity}"
            )
        if pads is not None and not 0 <= pads[b] <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {n}]")


def _checked_cache_call(
    q,
    k_cache,
    v_cache,
    user_args: dict,
    *,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_size,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    return_softmax_lse,
    learnable_sink,
) -> CacheCall:
    """``build_cache_call``'s checks, all of them; ``user_args`` is ``_upstream_args`` of the keywords."""
    q, k_cache, v_cache, k, v = _check_cache_tensors(q, k_cache, v_cache, k, v)
    batch, seqlen_q, nheads, head_dim = q.shape
    window = validate.check_window(causal, window_size)
    softcap = validate.check_softcap(softcap)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, batch, nheads, q.device)
    if learnable_sink is not None:
        learnable_sink = validate.check_sinks(learnable_sink, nheads, q.device)
    num_splits = validate.check_int(
        "num_splits", num_splits, minimum=0, meaning="0 chooses automatically", maximum=MAX_SPLITS
    )
    validate.check_bool("rotary_interleaved", rotary_interleaved)
    validate.check_bool("return_softmax_lse", return_softmax_lse)
    attention = AttentionCall(
        q=q,
        k=k_cache,
        v=v_cache,
        softmax_scale=validate.check_scale(softmax_scale, head_dim),
        causal=causal,
        diag_offset=k_cache.shape[1] - seqlen_q,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_lse=return_softmax_lse,
        sinks=learnable_sink,
    )
    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        validate.check_rotary(rotary_cos, rotary_sin, q, k, head_dim)
        rotary = (rotary_cos, rotary_sin, rotary_interleaved)

    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table (the page table already maps batches)")
    if block_table is not None:
        block_table = validate.check_block_table(block_table, batch, page_size, q.device, "k_cache.shape[1]")
    elif cache_batch_idx is not None:
        cache_batch_idx = _checked_batch_idx(cache_batch_idx, batch, num_pages, q.device)
    table = _cache_table(block_table, cache_batch_idx, batch, num_pages, q.device)
    capacity = table.shape[1] * page_size
    seqlens = _cache_seqlens(cache_seqlens, batch, capacity, q.device)
    if cache_leftpad is not None:
        cache_leftpad = validate.check_index("cache_leftpad", cache_leftpad, (batch,), q.device)
    new = 0 if k is None else k.shape[1]

    lengths = None  # known on the host: an int, None (the whole cache) or a CPU tensor
    if not isinstance(cache_seqlens, torch.Tensor):
        lengths = [capacity if cache_seqlens is None else validate.check_int("cache_seqlens", cache_seqlens)] * batch
    elif validate.on_host(seqlens):
        lengths = seqlens.tolist()
    if lengths is not None:
        pads = cache_leftpad.tolist() if cache_leftpad is not None and validate.on_host(cache_leftpad) else None
        _check_lengths(lengths, pads, new, capacity)
        if rotary is not None:
            moves = attention.window != (-1, -1)
            last = max((n + max(new, seqlen_q if moves else 1) - 1 for n in lengths), default=-1)
            if last >= rotary_cos.shape[0]:
                raise ValueError(
                    f"rotary_cos/rotary_sin cover positions [0, {rotary_cos.shape[0]}), position {last} is needed"
                )
        starts = pads if pads is not None else [0] * batch
        if block_table is not None:
            validate.check_pages("block_table", block_table, num_pages, page_size, starts, [n + new for n in lengths])
    if isinstance(cache_seqlens, torch.Tensor):
        user_args["cache_seqlens"] = seqlens
    user_args.update(
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        window_size=attention.window,
        num_splits=int(num_splits),
    )
    return CacheCall(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary,
        seqlens,
        cache_leftpad,
        table,
        block_table is not None,
        attention,
        int(num_splits),
        user_args,
    )


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
    learnable_sink: Optional[torch.Tensor] = None,
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
            query token over a long cache still fills the GPU; 0 chooses from the GPU's size; at
            most 128, as in flash-attn.
        return_softmax_lse: also return the log-sum-exp ``(batch_size, nheads, seqlen_q)`` float32.
        learnable_sink: optional float ``(nheads,)`` attention sinks, as ``flash_attn_func``'s.

    Returns:
        ``out (batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``.
    """
    call = build_cache_call(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes,
        num_splits=num_splits,
        return_softmax_lse=return_softmax_lse,
        learnable_sink=learnable_sink,
    )
    backend = dispatch.select_cache(call)
    out, lse = forward_only("flash_attn_with_kvcache", lambda: backend.run_cache(call), q, k, v, call.attention.sinks)
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
    if not torch.is_grad_enabled():
        return run()
    for t in inputs:  # a loop, not a comprehension: no Python frame on a decoding step
        if t is not None and t.requires_grad:
            return _ForwardOnly.apply(what, run, *(t for t in inputs if t is not None))
    return run()  # nothing to attach to: no graph is recorded


def paged_varlen(call: AttentionCall, block_table) -> tuple:
    """``flash_attn_varlen_func`` with a paged ``k, v (num_blocks, page_size, nheads_k, headdim)``
    (``call`` validated by ``flash_recipe.api`` with ``paged=True``): sequence ``b``'s key ``j`` is
    row ``j % page_size`` of page ``block_table[b, j // page_size]``, and ``cu_seqlens_k`` gives only
    the lengths. Forward only. Returns ``(out, lse or None, None)`` like ``dispatch.run``."""
    q, k = call.q, call.k
    batch = call.cu_seqlens_q.numel() - 1
    num_pages, page_size = k.shape[0], k.shape[1]
    block_table = validate.check_block_table(block_table, batch, page_size, q.device, "k.shape[1]")
    if call.dropout_p > 0.0:
        raise NotImplementedError(
            "dropout is not supported with block_table (paged KV is for inference); pass dropout_p=0.0"
        )
    capacity = block_table.shape[1] * page_size
    if call.max_seqlen_k > capacity:  # no sequence is longer than its block_table can address
        call = dataclasses.replace(call, max_seqlen_k=capacity)
    paged = PagedCall(call, block_table)
    if validate.on_host(call.cu_seqlens_k):
        ends = paged.lengths_k.tolist()
        if max(ends, default=0) > capacity:
            raise ValueError(f"a key sequence is longer than its block_table can address ({capacity} rows)")
        validate.check_pages("block_table", block_table, num_pages, page_size, [0] * batch, ends)
    backend = dispatch.select_paged(paged)
    out, lse = forward_only(
        "flash_attn_varlen_func with block_table", lambda: backend.run_paged(paged), q, k, call.v, call.sinks
    )
    return out, (lse if call.return_lse else None), None
