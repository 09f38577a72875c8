"""The ``AttentionCall`` of a ``flash_attn_*`` call: ``FlashOptions`` (the keyword options the
family shares), ``build_flash_call`` (every check, then the call), and the memo that lets a repeated
call of one signature skip the checks (``flash_recipe.memo_keys``).

Part of the public layer with ``flash_recipe.api``, which calls it, and the ``flash_attn``
stand-in and ``flash_recipe.distributed``, which build calls of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from . import validate
from .dispatch import AttentionCall
from .memo_keys import TOKENS, Fields, Memo, signature


@dataclasses.dataclass
class FlashOptions:
    """The options every flash-attn style call shares, as the caller passed them (``build_flash_call``
    validates them); the fields mean what ``flash_attn_func``'s arguments of the same names mean.
    ``return_lse`` asks for the log-sum-exp, ``return_probs`` also for the dropped-out probabilities
    (``flash_attn_func``'s ``return_attn_probs`` sets both). Built on every call and never changed
    after: not frozen, since a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` (1.5 us against 0.2 us for ten fields, CPython 3.11)."""

    dropout_p: float = 0.0
    softmax_scale: Optional[float] = None
    causal: bool = False
    window_size: Any = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    deterministic: bool = False
    return_lse: bool = False
    return_probs: bool = False
    learnable_sink: Optional[torch.Tensor] = None

    @classmethod
    def of(
        cls,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=None,
    ) -> FlashOptions:
        """The options of a flash-attn entry point, its arguments in flash-attn's order (every
        ``flash_attn_*_func`` has them in this order); ``return_attn_probs`` sets both
        ``return_lse`` and ``return_probs``. (Not ``locals()``: torch 2.6's torch.compile cannot
        trace that call.)"""
        return cls(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            return_attn_probs,
            learnable_sink,
        )


def build_flash_call(
    q,
    k,
    v,
    options: FlashOptions,
    names=("q", "k", "v"),
    varlen: Optional[tuple] = None,
    paged: bool = False,
) -> AttentionCall:
    """Validate flash-attn style arguments and build the call.

    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for packed sequences;
    with ``paged`` the keys and values are pages ``(num_blocks, page_block_size, nheads_k, headdim)``.

    The first call of a signature (``flash_recipe.memo_keys``) runs every check; a call with the
    same signature reuses the verdict and the values derived from it, unless the call passed
    metadata whose values the checks read on the host (CPU ``cu_seqlens``): those run each time.
    """
    key = None
    if not torch.compiler.is_compiling():
        key = _call_key(q, k, v, options, names, varlen, paged)
        found = _CALLS.get(key) if key is not None else None
        if found is not None:
            token, fields = found
            cu_q, cu_k = varlen[:2] if varlen is not None else (None, None)
            return AttentionCall.repeated(
                fields,
                token,
                q=q,
                k=k,
                v=v,
                alibi_slopes=options.alibi_slopes,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                sinks=options.learnable_sink,
            )
    call = _checked_flash_call(q, k, v, options, names, varlen, paged)
    if key is not None and _reusable(call, (q, k, v, options.learnable_sink), varlen):
        token = next(TOKENS)
        _CALLS.keep(key, (token, _derived_fields(call)))
        call.signed(token)
    return call


# Signature of a flash-attn style call (``_call_key``) -> (its token, ``memo_keys.TOKENS``; the fields of
# its AttentionCall other than its tensors).
_CALLS = Memo()
_TENSOR_FIELDS = ("q", "k", "v", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "sinks")
# The fields of the options, tensors and values, as the call's key takes them.
_OPTION_FIELDS = Fields(FlashOptions)


def _call_key(q, k, v, options: FlashOptions, names: tuple, varlen: Optional[tuple], paged: bool) -> Optional[tuple]:
    """The signature of a flash-attn style call (``flash_recipe.memo_keys``): its tensors, every field
    of ``options`` (none by hand), the names, the varlen metadata and ``paged``; None: not memoized."""
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, None, None)
    return signature(
        (q, k, v, cu_q, cu_k) + _OPTION_FIELDS.tensors_of(options),
        ("flash_call", names, max_q, max_k, paged) + _OPTION_FIELDS.values_of(options),
    )


def _reusable(call: AttentionCall, given: tuple, varlen: Optional[tuple]) -> bool:
    """Whether a call's checks can stand for every call of its signature: the tensors passed through
    unchanged (no restrided or contiguous copy) and no metadata values were read on the host."""
    if not (call.q is given[0] and call.k is given[1] and call.v is given[2] and call.sinks is given[3]):
        return False
    if varlen is None:
        return True
    if call.cu_seqlens_q is not varlen[0] or call.cu_seqlens_k is not varlen[1]:
        return False
    return not (validate.on_host(call.cu_seqlens_q) or validate.on_host(call.cu_seqlens_k))


def _derived_fields(call: AttentionCall) -> dict:
    """Every field of a checked ``call`` but its tensors and signature (``AttentionCall.repeated``)."""
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name not in _TENSOR_FIELDS}
    # ``seed`` stays (None: the public layer draws none; a backend does, on a call of its own).
    fields.pop("signature")  # set by ``signed``
    return fields


def _checked_flash_call(q, k, v, options: FlashOptions, names, varlen: Optional[tuple], paged: bool) -> AttentionCall:
    """``build_flash_call``'s checks, all of them."""
    if paged:
        layout = "(num_blocks, page_block_size, nheads_k, headdim)"
        for name, t in zip(names[1:], (k, v)):
            validate.check_tensor(name, t, 4, layout)
        if k.shape != v.shape or k.shape[0] == 0:
            raise ValueError(
                f"{names[2]} must have the shape of {names[1]} {layout} with at least one block, "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        validate.check_qkv(q, k[0], v[0], names, varlen=True)
    else:
        validate.check_qkv(q, k, v, names, varlen=varlen is not None)
        if varlen is None:
            validate.check_scores(names[:2], q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.dtype)
    q, k, v = validate.last_dim_contiguous(names, (q, k, v))
    dropout_p = validate.check_dropout(options.dropout_p)
    deterministic = validate.check_bool("deterministic", options.deterministic)
    causal, alibi_slopes = options.causal, options.alibi_slopes
    window = validate.check_window(causal, options.window_size)
    softcap = validate.check_softcap(options.softcap)
    batch = q.shape[0]
    if varlen is not None:
        varlen = validate.check_varlen(q, None if paged else k, *varlen)
        batch = varlen[0].numel() - 1
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, batch, q.shape[-2], q.device)
    sinks = options.learnable_sink
    if sinks is not None:
        sinks = validate.check_sinks(sinks, q.shape[-2], q.device)
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    return AttentionCall(
        q=q,
        k=k,
        v=v,
        softmax_scale=validate.check_scale(options.softmax_scale, q.shape[-1]),
        causal=causal,
        diag_offset=0 if varlen is not None else k.shape[1] - q.shape[1],
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_lse=bool(options.return_lse),
        return_probs=bool(options.return_probs),
        dropout_p=dropout_p,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        sinks=sinks,
        deterministic=bool(deterministic),
    )
