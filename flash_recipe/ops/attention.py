"""The Triton kernels as torch custom ops with autograd, so torch.compile traces them whole.

``flash_recipe::attn_fwd`` and ``flash_recipe::attn_bwd`` wrap the launchers in ``forward`` and
``backward``; their fake implementations give torch.compile the output shapes without running
anything. ``attention(...)`` is the differentiable entry point used by the dispatcher.
"""

from __future__ import annotations

import torch

from flash_recipe.ops.backward import attention_backward
from flash_recipe.ops.forward import attention_forward


@torch.library.custom_op("flash_recipe::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, diag_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)`` -> ``out (B, Sq, H, D)``, ``lse (B, H, Sq)`` float32."""
    return attention_forward(q, k, v, softmax_scale, causal, diag_offset)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal, diag_offset):
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
    causal: bool,
    diag_offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (shapes of q, k, v) from ``dout (B, Sq, H, D)``."""
    return attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, diag_offset)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, diag_offset):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    ), torch.empty_like(v, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, diag_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.diag_offset = diag_offset
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.diag_offset)
    return dq, dk, dv, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, diag_offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention through the Triton kernels; see ``attention_forward`` for shapes."""
    return attn_fwd(q, k, v, float(softmax_scale), bool(causal), int(diag_offset))
