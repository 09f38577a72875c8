"""The Triton kernels as torch custom ops with autograd, so torch.compile traces them whole.

``flash_recipe::attn_fwd`` and ``flash_recipe::attn_bwd`` wrap the launchers in ``forward`` and
``backward``; their fake implementations give torch.compile the output shapes without running
anything. ``attention(...)`` is the differentiable entry point used by the dispatcher.

Masking arguments follow flash-attn: query ``i`` sees keys
``[i + diag_offset - window_left, i + diag_offset + window_right]``, ``-1`` meaning unbounded on
that side (causal is ``window_right = 0``).
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_recipe.ops.backward import attention_backward
from flash_recipe.ops.forward import attention_forward, variant


@torch.library.custom_op("flash_recipe::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    diag_offset: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)`` -> ``out (B, Sq, H, D)``, ``lse (B, H, Sq)`` float32."""
    var = variant(diag_offset, window_left, window_right, softcap, alibi_slopes)
    return attention_forward(q, k, v, softmax_scale, var)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, diag_offset, window_left, window_right, softcap, alibi_slopes):
    batch, seqlen_q, nheads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flash_recipe::attn_bwd", mutates_args=())
def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    diag_offset: int,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (shapes of q, k, v) from ``dout (B, Sq, H, D)``."""
    var = variant(diag_offset, window_left, window_right, softcap, alibi_slopes)
    return attention_backward(dout, q, k, v, out, lse, softmax_scale, var)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, *args):
    contiguous = torch.contiguous_format
    return (torch.empty_like(q, memory_format=contiguous), torch.empty_like(k, memory_format=contiguous),
            torch.empty_like(v, memory_format=contiguous))


def _setup_context(ctx, inputs, output):
    q, k, v, *options, alibi_slopes = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = options  # softmax_scale, diag_offset, window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, *ctx.options, alibi_slopes)
    return dq, dk, dv, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    diag_offset: int,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention through the Triton kernels; see ``attention_forward`` for shapes."""
    return attn_fwd(q, k, v, float(softmax_scale), int(diag_offset), int(window[0]), int(window[1]),
                    float(softcap), alibi_slopes)
