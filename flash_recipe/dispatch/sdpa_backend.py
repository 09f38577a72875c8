"""The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Optional

import torch

from ..reference import alibi_bias, visible_keys
from . import capabilities
from .base import Backend
from .call import AttentionCall


class SdpaBackend(Backend):
    """``torch.nn.functional.scaled_dot_product_attention``.

    torch picks its own kernel, except on NVIDIA GPUs below sm80 (T4, RTX 20xx), where torch's
    flash kernel does not exist: there the call is restricted to the memory-efficient kernel (with
    math as the last resort), so an enclosing ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` cannot
    make it fail with "No available kernel", and it is shaped so that kernel takes it: key/value
    heads repeated for GQA (the kernel has no GQA) and bfloat16 computed in float32 (the kernel
    takes float16 and float32 only below sm80; the result is cast back).

    On the CPU, a call that autograd records runs on torch's math kernel: the CPU flash kernel
    torch picks otherwise recomputes probabilities from a rounded log-sum-exp, and its gradients
    miss the accuracy rule (measured on torch 2.13: fp32 at logits of about 30, up to 3.3x the
    rule's bound on dq; bf16 dv up to 1.1x). So does a query holding a NaN: torch 2.13's CPU flash
    kernel drops it (on an AVX-512 CPU a NaN in one query row left that row's output finite), where
    flash-attn and the other backends give that row NaN. The check is one sum over q (a NaN makes
    it NaN; so may infinities of both signs, which then take the math kernel too): 10 us at
    (1, 512, 8, 64) on one CPU thread, where ``isnan().any()`` took 290 us. Inference keeps
    torch's choice otherwise, whose outputs pass.
    """

    name = "sdpa"

    def supports(self, call: AttentionCall) -> Optional[str]:
        if call.return_lse:
            return "torch SDPA does not return the log-sum-exp"
        if call.softcap > 0.0:
            return "torch SDPA has no softcap"
        if call.sinks is not None:
            return "torch SDPA has no attention sinks (learnable_sink)"
        if not call.is_varlen and call.k.shape[1] == 0:
            return "no keys (seqlen_k = 0)"
        return None

    def run(self, call: AttentionCall):
        q, k, v = (t.transpose(1, 2) for t in (call.q, call.k, call.v))  # (B, H, S, D) views
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        if seqlen_k == 0:  # rows that see no key output 0
            return call.q.new_zeros(call.q.shape[:-1] + (call.v.shape[-1],)), None, None
        mask, is_causal = call.attn_mask, False
        efficient_only = capabilities.pre_ampere_nvidia(q.device)
        if efficient_only and q.dtype == torch.bfloat16:
            q, k, v = (t.float() for t in (q, k, v))
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.float()
        window = call.window
        if call.causal and call.diag_offset == 0 and window[0] < 0 and mask is None and call.alibi_slopes is None:
            is_causal = True
        elif window != (-1, -1):
            visible = visible_keys(seqlen_q, seqlen_k, call.diag_offset, window, q.device)
            mask = visible if mask is None else _combine_masks(visible, mask)
        if call.alibi_slopes is not None:
            bias = alibi_bias(call.alibi_slopes, seqlen_q, seqlen_k, call.diag_offset).to(q.dtype)
            if mask is None:
                mask = bias
            elif mask.dtype == torch.bool:
                mask = _combine_masks(mask, bias)
            else:
                mask = mask + bias
        options = dict(attn_mask=mask, dropout_p=call.dropout_p, is_causal=is_causal, scale=call.softmax_scale)
        if q.shape[1] != k.shape[1]:
            if not efficient_only:  # enable_gqa: every supported torch (2.5 and newer) has it
                options["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if efficient_only:
            with _sdpa_kernels("EFFICIENT_ATTENTION", "MATH"):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
            out = out.to(call.q.dtype).transpose(1, 2)
        elif q.device.type == "cpu" and (
            (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            or (
                seqlen_k < NAN_DROP_KEYS
                and not torch.compiler.is_compiling()  # eager only
                and bool(call.q.sum(dtype=torch.float32).isnan())
            )
        ):
            with _sdpa_kernels("MATH"):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options).transpose(1, 2)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options).transpose(1, 2)
        left, right = window
        first_row_blind = right >= 0 and call.diag_offset + right < 0
        last_row_blind = left >= 0 and seqlen_q - 1 + call.diag_offset - left >= seqlen_k
        if first_row_blind or last_row_blind:
            # Rows that see no key: some torch kernels give NaN there, flash-attn gives 0.
            visible = visible_keys(seqlen_q, seqlen_k, call.diag_offset, window, q.device)
            out = out.masked_fill(~visible.any(dim=-1)[None, :, None, None], 0.0)
        return out, None, None


# torch's CPU flash kernel drops a NaN query row (AVX-512; torch 2.13: fp32, fp16 and bf16, with
# or without a causal mask) only where there are fewer than 16 keys, less than one vector of its
# reduction; from 16 keys on it gives the row NaN as every other backend does. Below this many keys
# a query holding a NaN runs on the math kernel (a sum over q finds it: a pass over q, 2% of a
# 512-row call on one core, spared where the kernel is right).
NAN_DROP_KEYS = 64


def _sdpa_kernels(*names: str):
    """torch SDPA restricted to the named kernels (``SDPBackend`` members), in that order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in names])


def _combine_masks(visible: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Restrict ``mask`` (bool or additive) to the ``visible`` bool mask."""
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))
