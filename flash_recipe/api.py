"""Public attention functions: flash-attn 2's ``flash_attn_*`` family and torch's SDPA signature.

This layer (with ``flash_recipe.decoding``) validates input, through ``flash_recipe.validate``, and
fills in defaults; it builds an ``AttentionCall`` and hands it to ``flash_recipe.dispatch``,
which picks the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import dispatch, validate
from .call_builder import FlashOptions, build_flash_call
from .decoding import paged_varlen
from .dispatch import AttentionCall


def _finish(result, return_attn_probs):
    out, lse, s_dmask = result
    if return_attn_probs:
        # flash-attn returns (out, softmax_lse, S_dmask); S_dmask exists only with dropout.
        return out, lse, s_dmask
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """Attention with flash-attn 2's signature and semantics.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``
        k, v: ``(batch_size, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (MQA/GQA):
            query heads map to kv heads in contiguous groups, e.g. with 6 query heads and 2 kv
            heads, query heads 0, 1, 2 use kv head 0 and 3, 4, 5 use kv head 1.
        dropout_p: dropout probability on the attention weights (pass 0.0 in evaluation). The mask
            is counter-based, from a seed drawn from torch's generator for q's device, so
            ``torch.manual_seed`` reproduces it and the backward regenerates it.
        softmax_scale: scaling of ``q @ k^T`` before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask aligned to the bottom-right corner. With seqlen_q = 2 and seqlen_k = 5::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row that sees no key outputs 0 (and gets zero gradients).
        window_size: ``(left, right)``: query ``i`` sees keys
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 is unbounded
            on that side; ``causal`` sets ``right = 0``. Key blocks outside every row's window are
            skipped, so the work scales with the window. Any pair of ints (a 2-element integer
            tensor too). An entry ``>= seqlen_k`` keeps this meaning (flash-attn's kernels make it
            -1; README: "Where flash-attn's code and docstring disagree").
        softcap: > 0 turns the scores into ``softcap * tanh(scores / softcap)`` (Gemma 2); 0 disables.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch_size, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the score of query ``i`` and key ``j``
            (after the softcap), with or without ``causal`` (the lse is that of these scores).
        deterministic: the backward bit-identical from run to run. The Triton kernels' default
            backward adds dQ with fp32 atomics in one pass over the keys (5 matrix products per
            block pair, not 7), so dQ's last bits vary with the order the adds land in; with
            ``deterministic=True`` they run the two-pass backward, as flash-attn does with its flag
            (or the one-launch backward where ``flash-recipe tune`` chose it: no atomics either).
        return_attn_probs: also return the log-sum-exp and, with dropout, the attention
            probabilities ``(batch_size, nheads, seqlen_q, seqlen_k)``, negative where dropped
            (testing only).
        learnable_sink: optional float ``(nheads,)`` (float32, or float16/bfloat16 as given), one
            attention sink logit per query head (gpt-oss; flash-attn's ``learnable_sink``, vLLM's
            ``s_aux``): it joins each row's softmax denominator only, ``p_ij = exp(s_ij) /
            (exp(sink_h) + sum_j exp(s_ij))``, so the row's weights sum to less than 1; the
            ``softmax_lse`` includes it, and a row that sees no key outputs 0 with lse ``sink_h``.
            Differentiable: autograd returns its gradient (flash-attn has no sink backward).

    Dtypes: float16, bfloat16 and float32 (fp32 is computed in full fp32, never TF32). The last
    dim of q, k, v must be contiguous; other strides are free, so views of packed tensors work
    (stride 0 too: ``expand``-ed tensors). A NaN in the inputs is not checked for (that would cost
    a pass over the tensors): it propagates, on every backend, to the output rows whose scores
    it reaches, as in flash-attn.

    Returns:
        out: ``(batch_size, seqlen_q, nheads, headdim)``.
        With ``return_attn_probs``: ``(out, softmax_lse, None)`` where ``softmax_lse`` is
        ``(batch_size, nheads, seqlen_q)`` float32, the natural-log log-sum-exp of each row of
        ``q @ k^T * softmax_scale`` (``+inf`` for a row that sees no key; with ``learnable_sink``
        the sink is one more term).
    """
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """``flash_attn_func`` on a packed ``qkv (batch_size, seqlen, 3, nheads, headdim)``.

    q, k and v are strided views of ``qkv`` (no copy); the gradient flows back into ``qkv``.
    Returns ``out (batch_size, seqlen, nheads, headdim)``, or ``(out, softmax_lse, None)``.
    """
    validate.check_packed("qkv", qkv, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
        names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """``flash_attn_func`` with ``q (batch_size, seqlen_q, nheads, headdim)`` and a packed
    ``kv (batch_size, seqlen_k, 2, nheads_k, headdim)``; ``nheads % nheads_k == 0``.

    Returns ``out (batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse, None)``.
    """
    validate.check_packed("kv", kv, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=2)
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
        names=("q", "kv[:, :, 0]", "kv[:, :, 1]"),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """``flash_attn_func`` over a batch of packed sequences of different lengths.

    Arguments:
        q: ``(total_q, nheads, headdim)``, the sequences one after another; k, v:
            ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch_size + 1,)``; sequence ``b`` is rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``. Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequence on each side.
        The rest as ``flash_attn_func``; each sequence aligns its causal mask and window
        bottom-right with its own lengths; ``alibi_slopes`` may be ``(batch_size, nheads)``.
        block_table: optional int32 ``(batch_size, max_num_blocks_per_seq)``: k and v are then a
            paged cache ``(num_blocks, page_block_size, nheads_k, headdim)`` (page size a multiple
            of 16), sequence ``b``'s key ``j`` is in page ``block_table[b, j // page_block_size]``
            and ``cu_seqlens_k`` gives only the lengths. Forward only (inference).

    Returns:
        ``out (total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with ``softmax_lse``
        ``(nheads, total_q)`` float32.
    """
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
        varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        paged=block_table is not None,
    )
    if block_table is not None:
        return _finish(paged_varlen(call, block_table), return_attn_probs)
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """``flash_attn_varlen_func`` on a packed ``qkv (total, 3, nheads, headdim)`` (views, no copy)."""
    validate.check_packed("qkv", qkv, 1, 3, "(total_tokens, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=1)
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
        names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"),
        varlen=(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """``flash_attn_varlen_func`` with ``q (total_q, nheads, headdim)`` and a packed
    ``kv (total_k, 2, nheads_k, headdim)``."""
    validate.check_packed("kv", kv, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=1)
    call = build_flash_call(
        q,
        k,
        v,
        FlashOptions.of(
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            learnable_sink,
        ),
        names=("q", "kv[:, 0]", "kv[:, 1]"),
        varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Arguments:
        query: ``(batch, nheads, seqlen_q, headdim)`` (or without the batch dim).
        key: ``(batch, nheads_k, seqlen_k, headdim)``; value: ``(batch, nheads_k, seqlen_k, headdim_v)``.
            ``nheads_k`` must equal ``nheads`` unless ``enable_gqa``, which allows any divisor.
        attn_mask: bool (True = attend) or additive float mask broadcastable to
            ``(batch, nheads, seqlen_q, seqlen_k)``; cannot be combined with ``is_causal``.
        dropout_p: dropout probability, applied as torch applies it (always, not only in training).
        is_causal: causal mask aligned to the top-left corner, as torch defines it: query ``i``
            sees keys ``0..i``.
        scale: defaults to ``1 / sqrt(headdim)``.
        learnable_sink: optional float ``(nheads,)`` attention sinks, as ``flash_attn_func``'s
            (torch's own SDPA has none, so such calls never go to torch's kernels).

    Returns:
        ``(batch, nheads, seqlen_q, headdim_v)``, a view in torch's layout. Calls without an
        ``attn_mask`` run on the Triton kernels where they can (a GPU, or the CPU through the
        interpreter); the rest go to torch. Dropout on the Triton kernels draws its own
        counter-based mask (reproducible under ``torch.manual_seed``, as ``flash_attn_func``'s),
        not the one torch's kernels would draw; ``use_backend("sdpa")`` gives torch's.
    """
    validate.check_sdpa(query, key, value, validate.check_bool("enable_gqa", enable_gqa))
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = (t.unsqueeze(0) for t in (query, key, value))
    # flash layout views; a non-contiguous last dim is copied, as torch itself would.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = (validate.unit_last_stride(t if t.stride(-1) == 1 else t.contiguous()) for t in (q, k, v))
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be used together")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            raise TypeError(
                f"attn_mask must be bool or have the query's dtype ({q.dtype}), got {attn_mask.dtype}; "
                f"fix: attn_mask.to(torch.bool) for a mask of True = attend, or attn_mask.to(query.dtype)"
            )
    call = AttentionCall(
        q=q,
        k=k,
        v=v,
        softmax_scale=validate.check_scale(scale, q.shape[-1], name="scale"),
        causal=validate.check_bool("is_causal", is_causal),
        diag_offset=0,
        attn_mask=attn_mask,
        dropout_p=validate.check_dropout(dropout_p),
        sinks=None if learnable_sink is None else validate.check_sinks(learnable_sink, q.shape[2], q.device),
    )
    out = dispatch.run(call)[0].transpose(1, 2)
    return out.squeeze(0) if unbatched else out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> dict[str, Optional[str]]:
    """Which backends can run ``flash_attn_func(q, k, v, **kwargs)``, and why the others cannot.

    Returns a dict in priority order: backend name -> None (it can run the call) or the reason.
    The backend that would run is the first with None, unless one is chosen explicitly.
    """
    allowed = [f.name for f in dataclasses.fields(FlashOptions) if not f.name.startswith("return_")]
    unknown = set(kwargs) - {*allowed, "return_attn_probs"}
    if unknown:
        allowed_names = sorted([*allowed, "return_attn_probs"])
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}; allowed: {allowed_names}")
    probs = kwargs.pop("return_attn_probs", False)
    call = build_flash_call(q, k, v, FlashOptions(**kwargs, return_lse=probs, return_probs=probs))
    return dispatch.explain_call(call)
