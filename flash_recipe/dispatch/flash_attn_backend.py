"""The ``flash_attn`` backend: the upstream flash-attn 2 package, when installed and its compiled
kernels load."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import alias
from . import capabilities
from .base import Backend
from .call import AttentionCall, CacheCall, PagedCall

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Whether ``import flash_attn`` gives flash_recipe's stand-in, which must never serve as this backend.
_stand_in_installed = capabilities.constant_under_compile(alias.is_installed)
PAGE_MULTIPLE = 256  # upstream flash-attn's paged-cache requirement


class FlashAttnBackend(Backend):
    """The upstream flash-attn 2 package, when installed and its compiled kernels load."""

    name = "flash_attn"
    native_varlen = True

    def is_available(self) -> Optional[str]:
        if _stand_in_installed():
            return "flash_attn resolves to flash_recipe's own stand-in (install_as_flash_attn()), not to flash-attn"
        if capabilities.import_error("flash_attn") == "flash_attn is not installed":
            return "flash_attn is not installed"
        error = capabilities.import_error("flash_attn_2_cuda")
        package_error = capabilities.import_error("flash_attn")
        if error is not None and package_error is not None:
            # the package's own error says why (an undefined symbol, a missing module), as the doctor quotes it
            return f"flash_attn does not import ({package_error})"
        if error is not None:
            return f"flash_attn is installed but its compiled module does not load ({error})"
        return None

    def supports(self, call: AttentionCall) -> Optional[str]:
        q, k, v = call.q, call.k, call.v
        if call.sinks is not None:
            return "flash_attn 2 has no attention sinks (learnable_sink)"
        if q.device.type != "cuda" or torch.version.hip is not None:
            return "flash_attn runs on NVIDIA GPUs only"
        if q.dtype not in HALF_DTYPES:
            return f"flash_attn supports float16 and bfloat16 only, got {q.dtype}"
        major, minor = capabilities.device_capability(q.device)
        if major < 8:
            return (
                f"flash_attn 2 needs compute capability 8.0 (Ampere) or newer, this GPU has {major}.{minor}; "
                f"it has no Turing support (flash-attention issues {capabilities.TURING_ISSUES})"
            )
        if v.shape[-1] != q.shape[-1] or q.shape[-1] > 256:
            return "flash_attn needs equal query and value head dims of at most 256"
        if call.causal and call.diag_offset != k.shape[1] - q.shape[1]:
            return "flash_attn aligns the causal mask bottom-right only"
        if call.attn_mask is not None:
            return "flash_attn takes no explicit attn_mask"
        return capabilities.last_dim_strided(call)

    def run(self, call: AttentionCall):
        import flash_attn

        if call.is_varlen:
            fn = functools.partial(
                flash_attn.flash_attn_varlen_func,
                cu_seqlens_q=call.cu_seqlens_q,
                cu_seqlens_k=call.cu_seqlens_k,
                max_seqlen_q=call.max_seqlen_q,
                max_seqlen_k=call.max_seqlen_k,
            )
        else:
            fn = flash_attn.flash_attn_func
        result = fn(
            call.q,
            call.k,
            call.v,
            dropout_p=call.dropout_p,
            softmax_scale=call.softmax_scale,
            causal=call.causal,
            window_size=call.window,
            softcap=call.softcap,
            alibi_slopes=call.alibi_slopes,
            deterministic=call.deterministic,
            return_attn_probs=call.return_lse or call.return_probs,
        )
        if call.return_lse or call.return_probs:
            return result[0], result[1], result[2]
        return result, None, None

    def supports_cache(self, call: CacheCall) -> Optional[str]:
        if call.paged and call.k_cache.shape[1] % PAGE_MULTIPLE:
            return f"flash_attn needs a page size that is a multiple of {PAGE_MULTIPLE}, got {call.k_cache.shape[1]}"
        if call.rotary is not None and call.rotary[0].dtype != call.q.dtype:
            return "flash_attn needs rotary_cos/rotary_sin in q's dtype"
        return None

    def run_cache(self, call: CacheCall) -> tuple:
        import flash_attn

        result = flash_attn.flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.user_args)
        return result if call.attention.return_lse else (result, None)

    def supports_paged(self, call: PagedCall) -> Optional[str]:
        return "paged keys run on the triton backend or in torch"
