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
=====================  ===================  ================  ===========================================

Adding a backend is one module in this package plus its place in ``BACKENDS``.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_recipe.dispatch import torch_cache
from flash_recipe.dispatch.call import AttentionCall, CacheCall, PagedCall


class BackendUnavailableError(NotImplementedError):
    """The backend chosen explicitly cannot run this call (the message says why)."""


class Backend:
    """Base class: subclasses set ``name`` and implement ``supports`` and ``run``.

    ``native_varlen = False``: varlen calls run one sequence at a time. ``deterministic``: the
    same input gives the same bytes on every run (it takes part in ``flash-recipe verify``'s
    fingerprint).
    """

    name = ""
    native_varlen = False
    deterministic = False

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
        if not call.is_varlen or self.native_varlen:
            return self.run(call)
        results = [self.run(part) for part in call.sequences()]
        out = torch.cat([r[0].squeeze(0) for r in results], dim=0)
        lse = torch.cat([r[1].squeeze(0) for r in results], dim=1) if call.return_lse else None
        return out, lse, None

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
