"""The Triton kernels as torch custom ops with autograd, so torch.compile traces them whole.

``flash_recipe::attn_fwd`` and ``flash_recipe::attn_bwd`` wrap the launchers in ``forward`` and
``backward``; their fake implementations give torch.compile the output shapes without running
anything. ``attention(...)`` is the differentiable entry point used by the dispatcher.

Masking arguments follow flash-attn: query ``i`` sees keys
``[i + diag_offset - window_left, i + diag_offset + window_right]``, ``-1`` meaning unbounded on
that side (causal is ``window_right = 0``). With ``cu_seqlens_q``/``cu_seqlens_k`` (int32
``(B + 1,)``) the tensors are packed varlen ``(total, heads, head_dim)`` and every sequence
aligns its diagonal bottom-right. ``sinks (H,)``, optional, adds each query head's sink logit to its
softmax's denominator (``forward``); autograd returns its gradient too.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_recipe.ops.backward import attention_backward
from flash_recipe.ops.forward import attention_forward
from flash_recipe.ops.launch import ScoreOptions, Varlen


def _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, diag_offset, window_left, window_right,
            softcap, alibi_slopes, dropout_p, seed, sinks):
    varlen = None
    if cu_seqlens_q is not None:
        varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = ScoreOptions(diag_offset, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, sinks)
    return options, varlen


@torch.library.custom_op("flash_recipe::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    diag_offset: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor] = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)`` -> ``out (B, Sq, H, D)``, ``lse (B, H, Sq)`` float32.

    Varlen: ``q (total_q, H, D)``, ``k, v (total_k, Hk, D)`` -> ``out (total_q, H, D)``, ``lse (H, total_q)``.
    ``deterministic`` chooses the backward's path (``attention_backward``).
    """
    return attn_fwd_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, diag_offset,
                           window_left, window_right, softcap, alibi_slopes, dropout_p, seed, sinks)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, *args):
    if cu_seqlens_q is not None:
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flash_recipe::attn_bwd", mutates_args=())
def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    diag_offset: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: Optional[torch.Tensor],
    own_lse: bool = True,
    sinks: Optional[torch.Tensor] = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv, dsink`` (shapes of q, k, v, sinks; ``dsink`` empty without sinks) from
    ``dout`` (shape of q); ``own_lse=False`` when ``out, lse`` may be a larger attention's
    (``attention_backward``, which ``deterministic`` also steers)."""
    options, varlen = _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, diag_offset, window_left,
                              window_right, softcap, alibi_slopes, dropout_p, seed, sinks)
    dq, dk, dv, dsink = attention_backward(dout, q, k, v, out, lse, softmax_scale, options, varlen, own_lse,
                                           deterministic)
    return dq, dk, dv, dsink if dsink is not None else lse.new_empty(0)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   diag_offset, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, own_lse=True,
                   sinks=None, deterministic=False):
    contiguous = torch.contiguous_format
    return (torch.empty_like(q, memory_format=contiguous), torch.empty_like(k, memory_format=contiguous),
            torch.empty_like(v, memory_format=contiguous),
            torch.empty_like(sinks) if sinks is not None else lse.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, alibi_slopes, dropout_p, seed, sinks, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed, sinks)
    ctx.options = options  # max_seqlen_q, max_seqlen_k, softmax_scale, diag_offset, window_left, window_right, softcap
    ctx.dropout_p = dropout_p
    ctx.deterministic = deterministic
    ctx.num_inputs = len(inputs)  # the op's arguments: q, k, v and the sinks get gradients, the rest None
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed, sinks = ctx.saved_tensors
    dq, dk, dv, dsink = attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, alibi_slopes,
                                 ctx.dropout_p, seed, sinks=sinks, deterministic=ctx.deterministic)
    # Gradients for the op's arguments in order: q, k, v, ..., sinks (the next to last), deterministic.
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 5) + (dsink if sinks is not None else None, None)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """``attn_fwd`` with its registered autograd, for eager calls: the same launcher, the same
    ``_setup_context`` and ``_backward``, without the custom op's dispatch (which torch.compile
    needs and an eager call pays for on every step). ``args`` holds the op's arguments after v.
    A ``forward(ctx, ...)`` Function, for which torch binds no signature per call (``torch.func``
    transforms take neither it nor the custom op's autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, args, deterministic):
        output = attn_fwd_launch(q, k, v, *args, sinks)
        _setup_context(ctx, (q, k, v, *args, sinks, deterministic), output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = _backward(ctx, dout, dlse)
        return grads[0], grads[1], grads[2], grads[-2], None, None


def attn_fwd_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, diag_offset,
                    window_left, window_right, softcap, alibi_slopes, dropout_p, seed, sinks=None):
    """What ``attn_fwd`` runs: the forward launcher on the op's arguments."""
    options, varlen = _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, diag_offset, window_left,
                              window_right, softcap, alibi_slopes, dropout_p, seed, sinks)
    return attention_forward(q, k, v, softmax_scale, options, varlen)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    diag_offset: int,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    cu_seqlens: tuple = (None, None),
    max_seqlens: tuple[int, int] = (0, 0),
    dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention through the Triton kernels; see ``attention_forward`` for shapes;
    ``sinks (H,)``: each query head's sink logit (``forward``), differentiable; ``deterministic``:
    the backward's three-kernel path, bit-identical from run to run (``attention_backward``).

    With ``dropout_p > 0`` and no ``seed``, the dropout mask's seed is drawn from torch's
    generator for q's device (so ``torch.manual_seed`` makes it reproducible) and kept for the
    backward, which regenerates the same mask.
    """
    if dropout_p > 0.0 and seed is None:
        seed = new_seed(q.device)
    args = (cu_seqlens[0], cu_seqlens[1], int(max_seqlens[0]), int(max_seqlens[1]), float(softmax_scale),
            int(diag_offset), int(window[0]), int(window[1]), float(softcap), alibi_slopes, float(dropout_p), seed)
    if torch.compiler.is_compiling() or not (type(q) is type(k) is type(v) is torch.Tensor) or (
        sinks is not None and type(sinks) not in (torch.Tensor, torch.nn.Parameter)  # a model's sinks: a Parameter
    ):
        # Traced whole, as one op; or tensor subclasses (a collective's pending result, for one),
        # which the op's dispatch turns into the plain tensors a launch reads.
        return attn_fwd(q, k, v, *args, sinks, bool(deterministic))
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    ):
        return _EagerAttention.apply(q, k, v, sinks, args, bool(deterministic))
    return attn_fwd_launch(q, k, v, *args, sinks)  # nothing to record


def new_seed(device: torch.device) -> torch.Tensor:
    """A dropout seed, int64 ``(1,)`` on ``device``, from torch's generator for that device."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
