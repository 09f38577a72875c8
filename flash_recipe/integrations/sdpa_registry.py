"""flash_recipe as torch's SDPA flash-attention implementation (torch 2.10 and newer).

Usage::

    import torch
    import flash_recipe.integrations.sdpa_registry as fr_sdpa

    fr_sdpa.register()                                              # once; activates nothing
    torch.nn.attention.activate_flash_attention_impl("flash_recipe")
    ...  # F.scaled_dot_product_attention's flash backend and varlen_attn run flash_recipe's kernels
    torch.nn.attention.restore_flash_attention_impl()               # torch's own kernels again

Since torch 2.10, ``torch.nn.attention`` keeps a registry of flash-attention implementations
(``register_flash_attention_impl``, ``activate_flash_attention_impl``; from 2.11 on also
``restore_flash_attention_impl``: torch 2.10.0 keeps an activated implementation for the rest of
the process, as its own registry says). Activating one replaces, through ``torch.library``, the kernels
of five aten ops for the CUDA dispatch key (ROCm included); torch's FA4 and FA3 providers do the
same. ``register()`` adds the name ``"flash_recipe"``; importing this module registers nothing.
On a torch without the registry (2.9 and older) ``register()`` raises RuntimeError naming 2.10.

The registry replaces kernels, not torch's choice of backend: SDPA's C++ selection still decides
when its flash backend runs (CUDA, fp16/bf16, sm80 or newer, head dim at most 256, no attn_mask,
and ``is_causal`` only with seqlen_q == seqlen_k: torch 2.11 on an H100 refuses the rest with
"Flash attention does not support the is_causal flag when seqlen_q != seqlen_k").
Elsewhere (a T4, fp32, a CPU) SDPA never reaches these ops; ``flash_recipe.scaled_dot_product_attention``
is the route there.

The five ops and what they do here (B batch, Sq/Sk lengths, H query heads, Hk key heads, D head dim):

``_scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, return_debug_mask, *, scale)``
    SDPA's layout ``query (B, H, Sq, D)``, ``key, value (B, Hk, Sk, D)`` (``enable_gqa`` passes
    Hk < H, ``H % Hk == 0``, query heads in contiguous groups per key head). ``is_causal`` is
    aligned top-left, as SDPA defines it: query ``i`` sees keys ``0..i``; with Sq = 3, Sk = 5::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0

    Returns ``(out (B, H, Sq, D) with query's strides, logsumexp (B, H, Sq) float32, None, None,
    Sq, Sk, rng_state, philox_offset, debug_mask)``.
``_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, ...)``
    ``(grad_query, grad_key, grad_value)`` with the inputs' strides.
``_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
return_debug_mask, *, scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table, num_splits)``
    flash-attn's layout: dense ``(B, Sq, H, D)`` or, with ``cum_seq_q/k`` (int32 ``(N + 1,)``),
    packed ``(total, H, D)``. ``is_causal`` and the window are aligned bottom-right per sequence,
    as flash-attn (torch's FA2 kernel) aligns them: query ``i`` sees keys
    ``[i + Sk - Sq - left, i + Sk - Sq + right]``; ``None`` or -1 is unbounded; ``is_causal`` sets
    ``right = 0``. Returns ``(out, logsumexp, rng_state, philox_offset, debug_mask)``; logsumexp is
    ``(B, H, Sq)`` dense, ``(H, total_q)`` packed. ``num_splits`` is a scheduling hint: flash_recipe's
    forward never splits a row's keys, so results are batch-invariant whatever it says.
``_flash_attention_forward_no_dropout_inplace(out, ...)``
    the same, writing ``out`` in place and returning the logsumexp (``varlen_attn_out``).
``_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, ...)``
    ``(dq, dk, dv)`` from the saved ``out`` and ``logsumexp``, dense or packed, with the window.

Dropout runs: the forward draws its seed from torch's generator for the device
(``torch.manual_seed`` reproduces it) and returns it in ``rng_state`` (uint64 ``(2,)``: the seed's
bits, 0; ``philox_offset`` is 0); the backward regenerates the same mask from it. The mask is
flash_recipe's counter-based one, not the one torch's kernel would draw for that seed.

``seqused_k`` (int32 ``(N,)``) keeps the first ``seqused_k[b]`` keys of each slot
``cum_seq_k[b]:cum_seq_k[b + 1]`` (aligned with that count); ``block_table`` (int32
``(N, max_pages)``) makes ``key, value`` pages ``(num_pages, page_size, Hk, D)``, ``page_size`` a
multiple of 16, with ``seqused_k`` (or ``cum_seq_k``'s lengths) as each sequence's key count. Both
are forward only, as ``varlen_attn`` documents them (inference).

What raises NotImplementedError (a RuntimeError; the message names the argument): a debug mask
(``return_debug_mask=True``), ``alibi_slopes`` (the backward op has no slopes, so its gradient
would be wrong), and any call flash_recipe's Triton kernels
cannot run (the reason is in the message: value head dim differing from the query's, head dim
above 256, a device the kernels do not run on). torch's original kernel is not reachable once
an implementation is active, so these calls are refused rather than sent elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import validate
from ..dispatch import AttentionCall, PagedCall, TritonBackend

NAME = "flash_recipe"
FIRST_TORCH = "2.10"  # the first torch release with torch.nn.attention's flash-attention registry
_REGISTRY_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl")
OPS = (
    "_flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace",
    "_flash_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)

__all__ = ["FIRST_TORCH", "NAME", "OPS", "check_registry", "register"]


def check_registry(attention=None):
    """``torch.nn.attention`` (or ``attention``, a module in its place) if it has the
    flash-attention registry; else RuntimeError naming torch 2.10. The one version gate."""
    if attention is None:
        import torch.nn.attention as attention
    missing = [name for name in _REGISTRY_FUNCTIONS if not hasattr(attention, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no flash-attention registry (torch.nn.attention lacks "
            f"{', '.join(missing)}); it first appears in torch {FIRST_TORCH}: install torch>={FIRST_TORCH}, "
            "or call flash_recipe.scaled_dot_product_attention directly"
        )
    return attention


def register(dispatch_key: str = "CUDA") -> None:
    """Add ``"flash_recipe"`` to torch's flash-attention registry; activates nothing.

    Then ``torch.nn.attention.activate_flash_attention_impl("flash_recipe")`` routes the five ops
    (module docstring) to flash_recipe's Triton kernels for ``dispatch_key`` and
    ``restore_flash_attention_impl()`` gives torch's kernels back (torch 2.11 and newer). ``dispatch_key`` is ``"CUDA"``
    (NVIDIA and ROCm GPUs); ``"CPU"`` exists for tests only, since torch has no CPU kernel for
    these ops and SDPA on a CPU calls another op. Registering again replaces the earlier entry.
    """
    if dispatch_key not in ("CUDA", "CPU"):
        raise ValueError(f"dispatch_key must be 'CUDA' or 'CPU', got {dispatch_key!r}")
    attention = check_registry()
    attention.register_flash_attention_impl(NAME, register_fn=lambda: _Handle(dispatch_key))


class _Handle:
    """The active implementation: a ``torch.library.Library`` holding the five kernels.
    ``remove()`` (the registry calls it on restore) unregisters them."""

    def __init__(self, dispatch_key: str):
        self.library = torch.library.Library("aten", "IMPL", dispatch_key)
        for op, kernel in _KERNELS.items():
            if hasattr(torch.ops.aten, op):  # each op of OPS that this torch release has
                self.library.impl(op, kernel, dispatch_key)

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _triton_backend():
    """The backend every call runs on: flash_recipe's Triton kernels, never the selection's
    fallbacks (its sdpa backend would call back into these very ops)."""
    return TritonBackend()


def _refuse(what: str, why: str):
    return NotImplementedError(f"flash_recipe's {what} cannot run this call: {why}")


def _window(value: Optional[int], name: str) -> int:
    value = -1 if value is None else int(value)
    if value < -1:
        raise ValueError(f"{name} must be -1 (unbounded), None or >= 0, got {value}")
    return value


def _make_call(
    what,
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    scale,
    window=(-1, -1),
    top_left=False,
    seed=None,
):
    """The ``AttentionCall`` for flash-attn-layout tensors, or NotImplementedError with the reason."""
    varlen = cum_seq_q is not None
    validate.check_qkv(query, key, value, ("query", "key", "value"), varlen=varlen)
    if varlen:
        if cum_seq_k is None:
            raise _refuse(what, "cum_seq_k is None (packed keys need their offsets; block_table is not supported)")
        cum_seq_q, cum_seq_k, max_q, max_k = validate.check_varlen(query, key, cum_seq_q, cum_seq_k, max_q, max_k)
    diag_offset = 0 if varlen or top_left else key.shape[1] - query.shape[1]
    call = AttentionCall(
        q=validate.unit_last_stride(query if query.stride(-1) == 1 else query.contiguous()),
        k=validate.unit_last_stride(key if key.stride(-1) == 1 else key.contiguous()),
        v=validate.unit_last_stride(value if value.stride(-1) == 1 else value.contiguous()),
        softmax_scale=validate.check_scale(scale, query.shape[-1], name="scale"),
        causal=bool(is_causal),
        diag_offset=diag_offset,
        window=window,
        dropout_p=validate.check_dropout(dropout_p),
        return_lse=True,
        cu_seqlens_q=cum_seq_q,
        cu_seqlens_k=cum_seq_k,
        max_seqlen_q=int(max_q) if varlen else 0,
        max_seqlen_k=int(max_k) if varlen else 0,
        seed=seed,
    )
    why = _triton_backend().is_available() or _triton_backend().supports(call)
    if why is not None:
        raise _refuse(what, why)
    return call


def _forward(what, call):
    """``(out, lse, rng_state, philox_offset)`` of ``call`` on the Triton kernels."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=call.q.device)
    if call.dropout_p > 0.0:
        # imports Triton, which importing this module does not: dropout calls only
        from ..ops.attention import new_seed

        call = dataclasses.replace(call, seed=new_seed(call.q.device))
        rng_state.view(torch.int64)[:1] = call.seed
    with torch.no_grad():
        out, lse, _ = _triton_backend().run_call(call)
    return out, lse, rng_state, torch.zeros((), dtype=torch.uint64, device=call.q.device)


def _seed(dropout_p: float, rng_state: Optional[torch.Tensor], what: str):
    """The dropout seed the forward stored in ``rng_state`` (None without dropout)."""
    if not dropout_p > 0.0:
        return None
    if not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2 or rng_state.element_size() != 8:
        raise ValueError(f"{what}: dropout_p > 0 needs the rng_state (uint64 (2,)) that the forward returned")
    return rng_state.reshape(2).view(torch.int64)[:1].clone()


def _refuse_unsupported(what, return_debug_mask, alibi_slopes=None, seqused_k=None, block_table=None):
    for name, given in (
        ("return_debug_mask=True", return_debug_mask),
        ("alibi_slopes", alibi_slopes is not None),
        ("seqused_k", seqused_k is not None),
        ("block_table", block_table is not None),
    ):
        if given:
            raise _refuse(what, f"{name} is not supported; {_back_to_torch()}")


def _back_to_torch() -> str:
    """How a user gets torch's own kernels back (torch 2.10.0's registry cannot deactivate)."""
    import torch.nn.attention as attention

    if hasattr(attention, "restore_flash_attention_impl"):
        return "restore_flash_attention_impl() gives torch's kernels back"
    return (
        f"torch {torch.__version__} cannot deactivate an implementation (restore_flash_attention_impl "
        "comes with 2.11): call flash_recipe.scaled_dot_product_attention instead of activating the registry"
    )


def _flash_attention_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
    out=None,
):
    what = "_flash_attention_forward"
    _refuse_unsupported(what, return_debug_mask, alibi_slopes)
    window = (_window(window_size_left, "window_size_left"), _window(window_size_right, "window_size_right"))
    if seqused_k is not None or block_table is not None:
        if cum_seq_q is None or dropout_p != 0.0:
            raise _refuse(what, "seqused_k and block_table need packed queries (cum_seq_q) and dropout_p=0.0")
        if block_table is not None:
            result, lse = _paged_forward(
                what,
                query,
                key,
                value,
                cum_seq_q,
                cum_seq_k,
                max_q,
                max_k,
                is_causal,
                scale,
                window,
                seqused_k,
                block_table,
            )
            zero = torch.zeros((), dtype=torch.uint64, device=query.device)
            out = torch.empty_like(query) if out is None else out
            out.copy_(result)
            return out, lse, torch.zeros(2, dtype=torch.uint64, device=query.device), zero, query.new_empty((0,))
        key, value, cum_seq_k = _used_keys(key, value, cum_seq_k, seqused_k)
    call = _make_call(what, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale, window)
    result, lse, rng_state, philox_offset = _forward(what, call)
    if out is None:
        out = torch.empty_like(query)
    out.copy_(result)
    return out, lse, rng_state, philox_offset, query.new_empty((0,))


def _lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])


def _used_keys(key, value, cum_seq_k, seqused_k):
    """``seqused_k`` without pages: the first ``seqused_k[b]`` keys of each sequence's slot
    ``cum_seq_k[b]:cum_seq_k[b + 1]``, packed (a copy), with their own offsets."""
    if cum_seq_k is None:
        raise ValueError("seqused_k without block_table needs cum_seq_k (the key slots)")
    cum_seq_k = validate.check_offsets("cum_seq_k", cum_seq_k, key.shape[0], key.device)
    used = validate.check_index("seqused_k", seqused_k, (cum_seq_k.numel() - 1,), key.device)
    slots = cum_seq_k[1:] - cum_seq_k[:-1]
    if bool(((used < 0) | (used > slots)).any()):
        raise ValueError(
            f"seqused_k must lie in [0, the key slot's length]: got {used.tolist()}, slots {slots.tolist()}"
        )
    starts = cum_seq_k[:-1].long()
    offsets = _lengths_to_offsets(used)
    within = torch.arange(int(offsets[-1]), device=key.device) - torch.repeat_interleave(
        offsets[:-1].long(), used.long()
    )
    rows = torch.repeat_interleave(starts, used.long()) + within
    return key[rows], value[rows], offsets


def _paged_forward(
    what, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, window, seqused_k, block_table
):
    """Packed queries over paged keys ``(num_pages, page_size, Hk, D)``: sequence ``b``'s key ``j``
    is row ``j % page_size`` of page ``block_table[b, j // page_size]``; ``seqused_k`` (else the
    lengths in ``cum_seq_k``) gives each sequence's number of keys. Forward only."""
    names = ("query", "key", "value")
    for name, t in zip(names[1:], (key, value)):
        validate.check_tensor(name, t, 4, "(num_pages, page_size, nheads_k, headdim) with block_table")
    if key.shape != value.shape or key.shape[0] == 0:
        raise ValueError(
            f"value must have key's shape with at least one page, got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    validate.check_qkv(query, key[0], value[0], names, varlen=True)
    batch = validate.check_offsets("cum_seq_q", cum_seq_q, query.shape[0], query.device).numel() - 1
    if seqused_k is not None:
        lengths = validate.check_index("seqused_k", seqused_k, (batch,), query.device)
    elif cum_seq_k is not None:
        cum_seq_k = validate.check_offsets("cum_seq_k", cum_seq_k, None, query.device)
        lengths = cum_seq_k[1:] - cum_seq_k[:-1]
    else:
        raise ValueError("block_table needs seqused_k or cum_seq_k (the number of keys of each sequence)")
    cu_q, cu_k, max_q, max_k = validate.check_varlen(query, None, cum_seq_q, _lengths_to_offsets(lengths), max_q, max_k)
    page_size = key.shape[1]
    table = validate.check_block_table(block_table, batch, page_size, query.device, "key.shape[1]")
    if cu_k.device.type == "cpu":
        ends = lengths.tolist()
        if max(ends, default=0) > table.shape[1] * page_size:
            raise ValueError(
                f"a key sequence is longer than its block_table addresses ({table.shape[1] * page_size} rows)"
            )
        validate.check_pages("block_table", table, key.shape[0], page_size, [0] * batch, ends)
    call = AttentionCall(
        q=query,
        k=key,
        v=value,
        softmax_scale=validate.check_scale(scale, query.shape[-1], name="scale"),
        causal=bool(is_causal),
        window=window,
        return_lse=True,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
    paged = PagedCall(call, table)
    backend = _triton_backend()
    why = backend.is_available() or backend.supports(call) or backend.supports_paged(paged)
    if why is not None:
        raise _refuse(what, why)
    with torch.no_grad():
        return backend.run_paged(paged)


def _flash_attention_forward_no_dropout_inplace(
    out,
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    if dropout_p != 0.0:
        raise ValueError(f"_flash_attention_forward_no_dropout_inplace takes dropout_p=0.0, got {dropout_p}")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"out must have query's shape and dtype {tuple(query.shape)}, {query.dtype}; "
            f"got {tuple(out.shape)}, {out.dtype}"
        )
    return _flash_attention_forward(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        scale=scale,
        window_size_left=window_size_left,
        window_size_right=window_size_right,
        seqused_k=seqused_k,
        alibi_slopes=alibi_slopes,
        block_table=block_table,
        num_splits=num_splits,
        out=out,
    )[1]


def _backward(what, call, grad_out, out, logsumexp, like):
    """``(dq, dk, dv)`` with the strides of the tensors in ``like``."""
    if logsumexp.dtype != torch.float32:
        raise TypeError(f"{what}: logsumexp must be the float32 tensor the forward returned, got {logsumexp.dtype}")
    dout = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()  # .sum()'s gradient has stride 0
    with torch.no_grad():
        grads = _triton_backend().grad(call, dout, out.contiguous(), logsumexp.contiguous())
    return tuple(torch.empty_like(t).copy_(g) for t, g in zip(like, grads))


def _flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    what = "_flash_attention_backward"
    window = (_window(window_size_left, "window_size_left"), _window(window_size_right, "window_size_right"))
    call = _make_call(
        what,
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        scale,
        window,
        seed=_seed(dropout_p, rng_state, what),
    )
    return _backward(what, call, grad_out, out, logsumexp, (query, key, value))


def _transposed(*tensors):
    """SDPA's ``(B, H, S, D)`` as flash-attn's ``(B, S, H, D)`` (views)."""
    for name, t in zip(("query", "key", "value", "out", "grad_out"), tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-dimensional tensor (batch, nheads, seqlen, headdim)")
    return tuple(t.transpose(1, 2) for t in tensors)


def _scaled_dot_product_flash_attention(
    query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    what = "_scaled_dot_product_flash_attention"
    _refuse_unsupported(what, return_debug_mask)
    q, k, v = _transposed(query, key, value)
    call = _make_call(what, q, k, v, None, None, 0, 0, dropout_p, is_causal, scale, top_left=True)
    result, lse, rng_state, philox_offset = _forward(what, call)
    out = torch.empty_like(query)
    out.transpose(1, 2).copy_(result)
    empty = query.new_empty((0,))
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, philox_offset, empty


def _scaled_dot_product_flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    what = "_scaled_dot_product_flash_attention_backward"
    q, k, v, o, dout = _transposed(query, key, value, out, grad_out)
    call = _make_call(
        what,
        q,
        k,
        v,
        None,
        None,
        0,
        0,
        dropout_p,
        is_causal,
        scale,
        top_left=True,
        seed=_seed(dropout_p, philox_seed, what),
    )
    grads = _backward(what, call, dout, o, logsumexp, (q, k, v))
    return tuple(g.transpose(1, 2) for g in grads)


_KERNELS = {
    "_flash_attention_forward": _flash_attention_forward,
    "_flash_attention_forward_no_dropout_inplace": _flash_attention_forward_no_dropout_inplace,
    "_flash_attention_backward": _flash_attention_backward,
    "_scaled_dot_product_flash_attention": _scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_backward": _scaled_dot_product_flash_attention_backward,
}
