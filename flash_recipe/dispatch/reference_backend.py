"""The ``reference`` backend: ``flash_recipe.reference``, slow and always correct."""

from __future__ import annotations

from typing import Optional

from ..reference import attention_reference
from .base import Backend
from .call import AttentionCall


class ReferenceBackend(Backend):
    """``flash_recipe.reference`` in fp32 (fp64 for fp32 inputs): slow, always correct."""

    name = "reference"
    deterministic = True

    def supports(self, call: AttentionCall) -> Optional[str]:
        if call.dropout_p > 0.0 and call.return_probs:
            return "the reference draws dropout from torch's RNG and cannot return the dropped-out probabilities"
        return None

    def run(self, call: AttentionCall):
        out, lse = attention_reference(
            call.q,
            call.k,
            call.v,
            call.softmax_scale,
            call.causal,
            call.diag_offset,
            attn_mask=call.attn_mask,
            dropout_p=call.dropout_p,
            window=call.window,
            softcap=call.softcap,
            alibi_slopes=call.alibi_slopes,
            sinks=call.sinks,
        )
        return out.to(call.q.dtype), (lse if call.return_lse else None), None
