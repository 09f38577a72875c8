"""The ``triton`` backend: this package's Triton kernels (``flash_recipe.ops``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops.options import KeyRanges, ScoreOptions, Varlen
from . import capabilities
from .base import Backend
from .call import AttentionCall, CacheCall, PagedCall

# The kernels' modules by name (``attention``, ``kvcache``, ``forward``, ``dropout``), imported on the
# first run that needs one (they import Triton, this module does not); a repeated call looks them up
# here, which costs no Python call where a relative import inside the method would cost one each time.
_KERNELS: dict[str, Any] = {}


def _kernels(name: str) -> Any:
    """``flash_recipe.ops.<name>``, kept in ``_KERNELS`` with the other kernels' modules. Imported by
    an import statement, which Dynamo runs as it traces it (it refuses to trace
    ``importlib.import_module``): the first call of a process may be one that torch.compile traces
    with ``fullgraph=True``."""
    from ..ops import attention, dropout, forward, kvcache  # imports Triton, on first use: this module does not

    _KERNELS.update(attention=attention, dropout=dropout, forward=forward, kvcache=kvcache)
    return _KERNELS[name]


def score_options(call: AttentionCall, key_ranges: bool = False) -> ScoreOptions:
    """The kernels' ``ScoreOptions`` for ``call``: its scale, window, softcap, ALiBi, dropout and
    sinks. ``key_ranges``: the call runs on per-batch key ranges (a cache, paged keys), which align
    each batch's diagonal bottom-right in the kernel, so its ``diag_offset`` is 0."""
    return ScoreOptions(
        softmax_scale=float(call.softmax_scale),
        diag_offset=0 if key_ranges else int(call.diag_offset),
        window_left=int(call.window[0]),
        window_right=int(call.window[1]),
        softcap=float(call.softcap),
        alibi_slopes=call.alibi_slopes,
        dropout_p=float(call.dropout_p),
        seed=call.seed,
        sinks=call.sinks,
    )


def varlen_of(call: AttentionCall) -> Optional[Varlen]:
    """The packed sequences of a varlen call (None for a dense one)."""
    if call.cu_seqlens_q is None:
        return None
    return Varlen(call.cu_seqlens_q, call.cu_seqlens_k, int(call.max_seqlen_q), int(call.max_seqlen_k))


class TritonBackend(Backend):
    """This package's Triton kernels: dense, varlen, KV cache and paged keys, on NVIDIA sm80+,
    AMD CDNA, and the CPU through Triton's interpreter."""

    name = "triton"
    native_varlen = True
    deterministic = True
    replays_dropout = True
    atomic_backward = True  # the one-pass backward adds dQ with atomics (``ops.backward``)

    def is_available(self) -> Optional[str]:
        error = capabilities.import_error("triton")
        if error == "triton is not installed":
            return (
                f"{error} (Triton publishes wheels for Linux x86_64 and aarch64; on Windows the triton module "
                f"comes from the triton-windows package, a dependency of flash-recipe there)"
            )
        if error is not None:
            return f"triton fails to import: {error}"
        return capabilities.triton_too_old()

    def supports(self, call: AttentionCall) -> Optional[str]:
        q, v = call.q, call.v
        if q.device.type == "cpu":
            problem = capabilities.interpreter_problem()
            if problem is not None:
                return problem
            if q.dtype == torch.bfloat16:
                return (
                    "the Triton interpreter computes bfloat16 dot products incorrectly; "
                    "use float16 or float32 on the CPU"
                )
        elif q.device.type == "cuda":
            if torch.version.hip is None:
                major, minor = capabilities.device_capability(q.device)
                if major < 8:
                    return capabilities.pre_ampere_reason(major, minor)
            problem = capabilities.configs_problem(capabilities.device_index(q.device))
            if problem is not None:
                return problem
        else:
            return f"device type {q.device.type!r} is not supported (cuda or, with the interpreter, cpu)"
        if v.shape[-1] != q.shape[-1]:
            return f"value head dim {v.shape[-1]} differs from query head dim {q.shape[-1]}"
        if q.shape[-1] > 256:
            return f"head dim {q.shape[-1]} is above 256"
        if call.attn_mask is not None:
            return "an explicit attn_mask is not supported (causal masking is)"
        if call.dropout_p > 0.0 and call.return_probs and call.is_varlen:
            return "the dropped-out probabilities are returned for dense calls only"
        return capabilities.last_dim_strided(call)

    def run(self, call: AttentionCall):
        ops = _KERNELS.get("attention") or _kernels("attention")
        options = score_options(call)
        if options.dropout_p > 0.0 and options.seed is None:
            options = options._replace(seed=ops.new_seed(call.q.device))
        varlen = varlen_of(call) if call.cu_seqlens_q is not None else None
        # A signed call was built outside torch.compile (``AttentionCall.signed``), and its token
        # stands for the signature of what it passes (``attention_forward``).
        signed = call.signature
        traced = None if signed is None else False
        out, lse = ops.attention(call.q, call.k, call.v, options, varlen, call.deterministic, traced, signed)
        s_dmask = None
        if options.seed is not None and call.return_probs:
            s_dmask = self._dropped_probs(call, options.seed)
        return out, lse, s_dmask

    run_call = run  # varlen calls run whole (``native_varlen``): ``Backend.run_call`` would call ``run``

    def grad(self, call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple:
        ops = _KERNELS.get("attention") or _kernels("attention")
        if call.dropout_p > 0.0 and call.seed is None:
            raise ValueError("a backward with dropout needs the forward's seed (call.seed)")
        options = score_options(call)._replace(sinks=None)  # a backend's grad: dq, dk, dv only
        # own_lse=False: out and lse may be those of a larger attention (ring attention).
        flat = ops.flatten(options, varlen_of(call))
        return ops.attn_bwd(dout, call.q, call.k, call.v, out, lse, *flat, False, call.deterministic)[:3]

    @staticmethod
    def _dropped_probs(call: AttentionCall, seed) -> torch.Tensor:
        """The probabilities ``(B, H, Sq, Sk)`` the kernel used, negated where dropout dropped them."""
        batch, seqlen_q, nheads, _ = call.q.shape
        ops = _KERNELS.get("dropout") or _kernels("dropout")
        keep = ops.dropout_mask(seed, batch, nheads, seqlen_q, call.k.shape[1], call.dropout_p)
        probs = call.probabilities()
        return torch.where(keep, probs, -probs).to(call.q.dtype)

    def run_cache(self, call: CacheCall) -> tuple:
        ops = _KERNELS.get("kvcache") or _kernels("kvcache")
        cache = ops.Cache(call.k_cache, call.v_cache, call.table, call.seqlens, call.leftpad)
        rotary = ops.Rotary(*call.rotary) if call.rotary is not None else None
        options = score_options(call.attention, key_ranges=True)
        # A signed call's token stands for the signature of every argument (``attention_kvcache``).
        return ops.attention_kvcache(
            call.q, call.k, call.v, cache, rotary, options, call.num_splits, signed=call.attention.signature
        )

    def run_paged(self, call: PagedCall) -> tuple:
        ops = _KERNELS.get("forward") or _kernels("forward")
        att = call.attention
        lengths_k = call.lengths_k
        keys = KeyRanges(torch.zeros_like(lengths_k), lengths_k, att.max_seqlen_k, call.block_table)
        return ops.attention_forward(att.q, att.k, att.v, score_options(att, key_ranges=True), varlen_of(att), keys)
