"""The calls a backend runs, validated by the public layer (``flash_recipe.api``, ``flash_recipe.decoding``).

- ``AttentionCall``: one attention call in flash-attn's layout, dense or varlen;
- ``CacheCall``: ``flash_attn_with_kvcache``: append to a KV cache, then attend over it;
- ``PagedCall``: ``flash_attn_varlen_func`` with keys and values in pages (``block_table``);
- ``CALL_FIELDS``: ``AttentionCall``'s fields as the backend selection's memo key takes them
  (``flash_recipe.memo_keys.Fields``), so a new field reaches the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Optional

import torch

from ..memo_keys import Fields
from ..reference import attention_reference, effective_window


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call in flash-attn's layout.

    ``q (B, Sq, H, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)``; query ``i`` sees key ``j``
    iff ``i + diag_offset - left <= j <= i + diag_offset + right`` for ``window = (left, right)``
    (``-1``: unbounded). ``causal`` is a window whose right edge is the diagonal: the call sets
    ``right = 0`` itself on construction, so ``window`` is always the window that masks.
    ``attn_mask`` (broadcastable to ``(B, H, Sq, Sk)``) comes from the SDPA API only.
    ``return_lse`` asks for the log-sum-exp; ``return_probs``, with dropout, for the dropped-out
    probabilities too (flash-attn's ``return_attn_probs`` asks for both). ``sinks (H,)`` (float):
    query head ``h``'s softmax gains ``exp(sinks[h])`` in its denominator, a logit with no value
    (attention sinks, flash-attn's ``learnable_sink``); the lse includes it.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    causal: bool = False
    diag_offset: int = 0
    window: tuple = (-1, -1)  # (left, right) around the diagonal, -1 unbounded; causal has right 0
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # float32 (H,) or (B, H)
    attn_mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    return_lse: bool = False
    return_probs: bool = False
    # Varlen: q (total_q, H, D), k/v (total_k, Hk, D); int32 (B + 1,) offsets; diagonals bottom-right.
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # int64 (1,): the seed of the dropout mask, for a backend whose backward regenerates it
    # (``Backend.replays_dropout``); None draws a new one.
    seed: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None  # (H,) float, on q's device
    # The backward bit-identical from run to run (flash-attn's ``deterministic``), where a faster
    # backward is not (the Triton kernels' one-pass dQ adds with atomics).
    deterministic: bool = False
    # The token of the public layer's signature of the arguments the call was built from
    # (``memo_keys.TOKENS``), which decides every field but the tensors' data; None where it was not
    # memoized. Set by ``signed``, never an argument, so ``dataclasses.replace`` (a call with other
    # fields) drops it.
    signature: Optional[Hashable] = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", effective_window(self.causal, self.window))

    @classmethod
    def repeated(cls, fields: dict, signature: Hashable, **tensors) -> AttentionCall:
        """The call that ``AttentionCall(**fields, **tensors).signed(signature)`` gives, where ``fields``
        (every field but the tensors and ``signature``) are a constructed call's, as its
        ``__post_init__`` left them: built without running ``__init__`` again (a memo hit of the
        public layer, on every repeated call)."""
        call = object.__new__(cls)
        vars(call).update(fields, signature=signature, **tensors)
        return call

    def signed(self, signature: Optional[Hashable]) -> AttentionCall:
        """This call, marked as built from arguments of the signature ``signature`` stands for (its
        token), which the public layer computes outside torch.compile only: a signed call is never
        being traced (``dispatch.select``)."""
        object.__setattr__(self, "signature", signature)
        return self

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def sequences(self) -> list:
        """A varlen call as one dense call per sequence (for backends without varlen kernels)."""
        starts_q = self.cu_seqlens_q.tolist()
        starts_k = self.cu_seqlens_k.tolist()
        calls = []
        for b in range(len(starts_q) - 1):
            q = self.q[starts_q[b] : starts_q[b + 1]].unsqueeze(0)
            k, v = (t[starts_k[b] : starts_k[b + 1]].unsqueeze(0) for t in (self.k, self.v))
            calls.append(
                dataclasses.replace(
                    self,
                    q=q,
                    k=k,
                    v=v,
                    diag_offset=k.shape[1] - q.shape[1],
                    alibi_slopes=self.slopes_of(b),
                    cu_seqlens_q=None,
                    cu_seqlens_k=None,
                    max_seqlen_q=0,
                    max_seqlen_k=0,
                )
            )
        return calls

    def probabilities(self) -> torch.Tensor:
        """The softmax probabilities ``(B, H, Sq, Sk)`` of a dense call (before dropout), float32 by
        ``flash_recipe.reference`` (float64 for float32 inputs); not differentiable."""
        options = dict(
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
            return_probs=True,
        )
        with torch.no_grad():
            _, probs = attention_reference(
                self.q, self.k, self.v, self.softmax_scale, self.causal, self.diag_offset, **options
            )
        return probs

    def slopes_of(self, b: int) -> Optional[torch.Tensor]:
        """The ALiBi slopes of batch entry ``b`` as a call of its own takes them: ``(1, H)`` from
        per-batch ``(B, H)`` slopes, else the shared ``(H,)`` slopes (or None)."""
        slopes = self.alibi_slopes
        return slopes[b : b + 1] if slopes is not None and slopes.dim() == 2 else slopes


# The fields of a call, tensors and values (``signature`` is no field of it: compare=False).
CALL_FIELDS = Fields(AttentionCall)


@dataclasses.dataclass
class CacheCall:
    """A validated ``flash_attn_with_kvcache`` call; ``table`` int32 ``(B, width)`` addresses the
    cache as pages of ``k_cache.shape[1]`` rows (a dense cache: one page per cache row). Built on
    every decoding step and never changed after: not frozen, whose ``__init__`` would set each of
    its 13 fields through ``object.__setattr__``.

    ``q (B, Sq, H, D)``; ``k_cache, v_cache (num_pages, page_size, Hk, D)``; new ``k, v
    (B, Snew, Hk, D)`` or None; ``seqlens`` and ``leftpad`` int32 ``(B,)``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary: Optional[tuple]  # (cos, sin, interleaved)
    seqlens: torch.Tensor  # int32 (B,)
    leftpad: Optional[torch.Tensor]
    table: torch.Tensor
    paged: bool
    attention: AttentionCall  # the score options; q, k_cache, v_cache stand in for the tensors
    num_splits: int
    user_args: dict  # the arguments for upstream flash-attn: as given, with metadata made contiguous

    @property
    def new_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]


@dataclasses.dataclass(frozen=True)
class PagedCall:
    """``flash_attn_varlen_func`` with ``block_table``: ``attention`` is a varlen call whose ``k, v``
    are pages ``(num_blocks, page_size, Hk, D)``; sequence ``b``'s key ``j`` is row
    ``j % page_size`` of page ``block_table[b, j // page_size]``, and ``cu_seqlens_k`` gives only
    the lengths."""

    attention: AttentionCall
    block_table: torch.Tensor  # int32 (B, width), contiguous

    @property
    def lengths_k(self) -> torch.Tensor:
        """int32 ``(B,)``: each sequence's number of keys."""
        cu_k = self.attention.cu_seqlens_k
        return cu_k[1:] - cu_k[:-1]
