"""flash-attn 2.8.3's internal functions, the ones other libraries import from
``flash_attn.flash_attn_interface`` (ring-flash-attn, yunchang, ColossalAI, ...) and the compiled
extension's stand-in (``extension``) calls.

They have upstream's names, argument names, order and defaults (libraries fill them by name through
``inspect.getfullargspec``), return tuples and layouts:

- ``_flash_attn_forward(q, k, v, ...) -> (out, softmax_lse, S_dmask, rng_state)``:
  ``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)``, ``out (B, Sq, H, D)``, ``softmax_lse (B, H, Sq)``
  float32 (natural log; ``+inf`` for a row that sees no key), ``S_dmask`` empty unless
  ``return_softmax``, ``rng_state`` int64 ``(2,)``.
- ``_flash_attn_varlen_forward``: ``q (total_q, H, D)``, ``k, v (total_k, Hk, D)``,
  ``softmax_lse (H, total_q)``.
- ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, ...) -> softmax_d``: writes
  the gradients into the caller's ``dq, dk, dv`` (any strides; None skips one) and returns
  ``softmax_d = rowsum(dout * out)`` float32 in upstream's layout: dense
  ``(B, H, round128(Sq))``, varlen ``(H, total_q + 128 * B)`` with sequence ``b`` at column
  offset ``cu_seqlens_q[b] + 128 * b``.

The backward follows FlashAttention-2: it uses the given ``out`` and ``softmax_lse`` as they are, so
when they are a larger attention's (ring attention's merged result), the gradients are this
block's share of it. Every call runs on flash_recipe's backends (``flash_recipe.dispatch``):
Triton on GPUs, the plain-torch reference on CPUs. Dropout (``dropout_p > 0``) needs the
triton backend, whose backward regenerates the forward's mask from ``rng_state``.
Not provided: ``leftpad_k`` and ``seqused_k`` of the varlen forward (NotImplementedError).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import dispatch, validate
from ..call_builder import FlashOptions, build_flash_call
from ..decoding import paged_varlen
from ..dispatch import AttentionCall

ROUND = 128  # upstream pads S_dmask and softmax_d to multiples of 128 rows


def _round(n: int) -> int:
    return (n + ROUND - 1) // ROUND * ROUND


def _call(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic=False,
    varlen=None,
    paged=False,
    return_softmax=False,
) -> AttentionCall:
    """The validated call; the log-sum-exp is always asked for, the probabilities with ``return_softmax``."""
    validate.check_bool("causal", causal)
    validate.check_bool("return_softmax", return_softmax)
    window = (window_size_left, window_size_right)
    options = FlashOptions(
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_lse=True,
        return_probs=return_softmax,
    )
    return build_flash_call(q, k, v, options, varlen=varlen, paged=paged)


def _replays_dropout(call: AttentionCall):
    """With dropout, refuse the backends whose backward cannot regenerate the forward's mask."""
    if call.dropout_p == 0.0:
        return None
    return lambda backend: (
        None
        if backend.replays_dropout
        else "dropout_p > 0 needs a backend whose backward "
        "regenerates the forward's dropout mask from rng_state (triton)"
    )


def _forward(call: AttentionCall, block_table=None) -> tuple:
    if call.return_probs and call.is_varlen:
        raise NotImplementedError("return_softmax=True is supported by _flash_attn_forward only (dense calls)")
    q = call.q
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    probs = None
    with torch.no_grad():
        if block_table is not None:
            out, lse, _ = paged_varlen(call, block_table)
        else:
            backend = dispatch.select(call, _replays_dropout(call))
            if call.dropout_p > 0.0:
                # imports Triton, which importing the stand-in does not: dropout calls only
                from ..ops.attention import new_seed

                call = dataclasses.replace(call, seed=new_seed(q.device))
                rng_state[:1] = call.seed
            out, lse, probs = backend.run_call(call)
    if not call.return_probs:
        return out, lse, q.new_empty((0,)), rng_state
    return out, lse, _softmax_matrix(call, probs), rng_state


def _softmax_matrix(call: AttentionCall, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``S_dmask (B, H, round128(Sq), round128(Sk))``: the probabilities, negative where dropout dropped
    them, zero in the padding."""
    if probs is None:  # no dropout: the probabilities themselves
        probs = call.probabilities()
    seqlen_q, seqlen_k = probs.shape[-2:]
    padding = (0, _round(seqlen_k) - seqlen_k, 0, _round(seqlen_q) - seqlen_q)
    return torch.nn.functional.pad(probs, padding).to(call.q.dtype)


def _backward(call: AttentionCall, dout, out, softmax_lse, grads, rng_state) -> torch.Tensor:
    q = call.q
    expected = q.shape[:-1] + call.v.shape[-1:]
    for name, t in (("dout", dout), ("out", out)):
        validate.check_tensor(name, t, q.dim(), "q's shape with v's head dim")
        if t.shape != expected:
            raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")
    lse_shape = (q.shape[1], q.shape[0]) if call.is_varlen else (q.shape[0], q.shape[2], q.shape[1])
    if not isinstance(softmax_lse, torch.Tensor) or softmax_lse.dtype != torch.float32:
        raise TypeError("softmax_lse must be the float32 tensor the forward returned")
    if tuple(softmax_lse.shape) != lse_shape:
        raise ValueError(f"softmax_lse must have shape {lse_shape}, got {tuple(softmax_lse.shape)}")
    for name, t in (("dout", dout), ("out", out)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}")
    for name, buffer, like in zip(("dq", "dk", "dv"), grads, (q, call.k, call.v)):
        if buffer is not None and not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(buffer).__name__}")
        if buffer is not None and buffer.shape != like.shape:
            raise ValueError(f"{name} must be None or a tensor of shape {tuple(like.shape)}, got {tuple(buffer.shape)}")
    if call.dropout_p > 0.0:
        if not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2:
            raise ValueError("dropout_p > 0 needs the rng_state (int64 (2,)) that the forward returned")
        call = dataclasses.replace(call, seed=rng_state[:1].to(q.device))
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # as upstream: a gradient of .sum() has stride 0
    with torch.no_grad():
        backend = dispatch.select(call, _replays_dropout(call))
        computed = backend.grad(call, dout, out.contiguous(), softmax_lse.contiguous())
        for buffer, grad in zip(grads, computed):
            if buffer is not None:
                buffer.copy_(grad)
        return _softmax_d(call, dout, out)


def _softmax_d(call: AttentionCall, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)`` float32 in upstream's padded layout (module docstring)."""
    delta = (dout.float() * out.float()).sum(dim=-1)  # (B, Sq, H) or (total_q, H)
    if call.cu_seqlens_q is None:  # dense
        delta = delta.transpose(1, 2)  # (B, H, Sq)
        return torch.nn.functional.pad(delta, (0, _round(delta.shape[-1]) - delta.shape[-1])).contiguous()
    cu = call.cu_seqlens_q.long()
    batch, total = cu.numel() - 1, delta.shape[0]
    rows = torch.arange(total, device=delta.device)
    columns = rows + ROUND * torch.bucketize(rows, cu[1:], right=True)  # sequence b shifted by 128 * b
    result = delta.new_zeros((delta.shape[1], total + ROUND * batch))
    result[:, columns] = delta.t()
    return result


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
):
    """Dense forward, no autograd: ``(out, softmax_lse, S_dmask, rng_state)`` (module docstring)."""
    call = _call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax=return_softmax,
    )
    return _forward(call)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
):
    """Varlen forward, no autograd: ``(out, softmax_lse (H, total_q), S_dmask, rng_state)``; with
    ``block_table`` k and v are pages, as ``flash_attn_varlen_func`` takes them."""
    for name, value in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if value is not None:
            raise NotImplementedError(
                f"{name} is not supported by flash_recipe's _flash_attn_varlen_forward; pass None"
            )
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    call = _call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        varlen=varlen,
        paged=block_table is not None,
        return_softmax=return_softmax,
    )
    return _forward(call, block_table)


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense backward: writes ``dq, dk, dv`` in place, returns ``softmax_d (B, H, round128(Sq))``."""
    call = _call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
    )
    return _backward(call, dout, out, softmax_lse, (dq, dk, dv), rng_state)


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Varlen backward: writes ``dq, dk, dv`` in place, returns ``softmax_d (H, total_q + 128 * B)``."""
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    call = _call(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        varlen=varlen,
    )
    return _backward(call, dout, out, softmax_lse, (dq, dk, dv), rng_state)
