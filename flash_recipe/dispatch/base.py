"""The interface every backend implements.

A backend answers, for each kind of call, whether it can run it (``None`` for yes, else a short
reason) and runs it:

=====================  ===================  ================  ===========================================
call                   can run              runs              default
=====================  ===================  ================  ===========================================
any                    ``is_available()``                     available
``AttentionCall``      ``supports(call)``   ``run(call)``     (must implement)
``CacheCall``          ``supports_cache``   ``run_cache``     the cache semantics in torch around ``run``
``PagedCall``          ``supports_paged``   ``run_paged``     the pages gathered in torch, then ``run_call``
backward of a call                          ``grad``          ``reference.attention_reference_backward``
=====================  ===================  ================  ===========================================

Adding a backend is one module in this package plus its place in ``BACKENDS``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..reference import attention_reference_backward
from . import torch_cache
from .call import AttentionCall, CacheCall, PagedCall


class BackendUnavailableError(NotImplementedError):
    """The backend chosen explicitly cannot run this call (the message says why)."""


class Backend:
    """Base class: subclasses set ``name`` and implement ``supports`` and ``run``.

    ``native_varlen = False``: varlen calls run one sequence at a time. ``deterministic``: the
    same input gives the same bytes on every run, for calls with ``deterministic=True`` (it takes
    part in ``flash-recipe verify``'s fingerprint, which makes such calls).
    """

    name = ""
    native_varlen = False
    deterministic = False
    replays_dropout = False  # ``grad`` regenerates the forward's dropout mask from ``call.seed``
    # Its default backward differs from its ``deterministic=True`` one (sums in the order atomics land).
    atomic_backward = False

    def is_available(self) -> Optional[str]:
        return None

    def supports(self, call: AttentionCall) -> Optional[str]:
        raise NotImplementedError

    def run(self, call: AttentionCall) -> tuple:
        """Return ``out (B, Sq, H, Dv)`` in q's dtype and, if asked, ``lse (B, H, Sq)`` float32 and,
        with dropout, the probabilities ``(B, H, Sq, Sk)``, negative where dropped (else None)."""
        raise NotImplementedError

    def run_call(self, call: AttentionCall) -> tuple:
        """``run``, with varlen calls split per sequence where the backend has no varlen kernel.

        Varlen results are ``out (total_q, H, Dv)`` and ``lse (H, total_q)``.
        """
        if call.cu_seqlens_q is None or self.native_varlen:  # not varlen
            return self.run(call)
        results = [self.run(part) for part in call.sequences()]
        out = torch.cat([r[0].squeeze(0) for r in results], dim=0)
        lse = torch.cat([r[1].squeeze(0) for r in results], dim=1) if call.return_lse else None
        return out, lse, None

    def grad(self, call: AttentionCall, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple:
        """FlashAttention-2's backward of ``call`` from a saved ``out`` and ``lse`` (not recomputed):
        ``dq, dk, dv`` shaped like ``call.q, call.k, call.v``.

        ``dout`` and ``out`` have q's shape with v's head dim; ``lse`` float32 ``(B, H, Sq)``
        (varlen: ``(H, total_q)``), contiguous. ``out, lse`` may be those of a larger attention of
        which ``call``'s keys are one block (``reference.attention_reference_backward`` says what
        that gives). Default: that reference in plain torch, one sequence at a time for varlen.
        """
        if call.dropout_p > 0.0 and not self.replays_dropout:
            raise NotImplementedError(
                f"backend {self.name!r} cannot regenerate the forward's dropout mask in a separate "
                "backward; pass dropout_p=0.0 or run on the triton backend"
            )
        if not call.is_varlen:
            options = dict(window=call.window, softcap=call.softcap, alibi_slopes=call.alibi_slopes)
            return attention_reference_backward(
                dout, call.q, call.k, call.v, out, lse, call.softmax_scale, call.causal, call.diag_offset, **options
            )
        grads = [torch.zeros_like(t) for t in (call.q, call.k, call.v)]
        starts_q, starts_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        for b, part in enumerate(call.sequences()):
            rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            parts = self.grad(part, dout[rows_q].unsqueeze(0), out[rows_q].unsqueeze(0), lse[:, rows_q].unsqueeze(0))
            for grad, rows, g in zip(grads, (rows_q, rows_k, rows_k), parts):
                grad[rows] = g.squeeze(0)
        return tuple(grads)

    def supports_cache(self, call: CacheCall) -> Optional[str]:
        """Why this backend cannot run ``call`` beyond ``supports(call.attention)``, or None."""
        return None

    def run_cache(self, call: CacheCall) -> tuple:
        """Append the new keys and values to the cache in place and attend over it: ``out (B, Sq, H, D)``
        and ``lse (B, H, Sq)`` float32 (None unless ``call.attention.return_lse``). Forward only."""
        return torch_cache.run_cache(self, call)

    def supports_paged(self, call: PagedCall) -> Optional[str]:
        """Why this backend cannot run ``call`` beyond ``supports(call.attention)``, or None."""
        return None

    def run_paged(self, call: PagedCall) -> tuple:
        """``out (total_q, H, D)`` and ``lse (H, total_q)`` (None unless asked). Forward only."""
        return torch_cache.run_paged(self, call)
