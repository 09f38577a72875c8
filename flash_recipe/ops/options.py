"""The options of one attention call as the launchers take them; torch only, no Triton.

- ``ScoreOptions``: the scale and every score and mask option (window, softcap, ALiBi, dropout,
  sinks), one object from the dispatch layer (``flash_recipe.dispatch.triton_backend``) down to
  the function that turns it into kernel arguments (``flash_recipe.ops.launch.score_args``);
- ``Varlen``: packed sequences;
- ``KeyRanges``: per-batch key rows of a KV cache, optionally paged;
- ``SCORE_FIELDS``, ``VARLEN_FIELDS``, ``KEY_RANGE_FIELDS``: their fields as the launchers' memo
  keys take them (``flash_recipe.memo_keys.Fields``), so a new field reaches every key.

Shapes (B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim)::

    dense    q (B, Sq, H, D)    k, v (B, Sk, Hk, D)       lse (B, H, Sq)
    varlen   q (total_q, H, D)  k, v (total_k, Hk, D)     lse (H, total_q)
    paged    k, v (num_pages, page_size, Hk, D)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..memo_keys import Fields


class ScoreOptions(NamedTuple):
    """The scale and the masking and score options of one call.

    Query ``i`` sees keys ``[i + diag_offset - window_left, i + diag_offset + window_right]``,
    ``-1`` meaning unbounded on that side (causal: ``window_right = 0``). ``diag_offset`` is
    ``Sk - Sq`` for flash-attn's bottom-right alignment and ``0`` for SDPA's top-left; varlen
    sequences and per-batch key ranges always align bottom-right, each with its own lengths.

    The fields without a default have none on purpose: build it by keyword.
    """

    softmax_scale: float  # the logits are q . k * softmax_scale
    diag_offset: int
    window_left: int
    window_right: int
    softcap: float  # > 0: logits become softcap * tanh(logit / softcap)
    alibi_slopes: Optional[torch.Tensor]  # fp32 (H,) or (B, H): each head's bias slope * -|i + offset - j|
    dropout_p: float = 0.0
    seed: Optional[torch.Tensor] = None  # int64 (1,) on the device: the dropout mask's Philox seed
    # Attention sinks, (H,) float (any float dtype, read as fp32): query head h's softmax denominator
    # gains exp(sinks[h]), a logit with no value; the lse includes it.
    sinks: Optional[torch.Tensor] = None


class Varlen(NamedTuple):
    """Packed sequences: ``cu_seqlens`` int32 ``(B + 1,)`` and the longest length, per side."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class KeyRanges(NamedTuple):
    """Keys of batch ``b`` are rows ``start[b]:end[b]`` (int32 ``(B,)`` each), optionally paged.

    With ``table`` (int32 ``(B, width)``) the key tensors are ``(num_pages, page_size, Hk, D)``
    and row ``r`` of batch ``b`` lives in page ``table[b, r // page_size]``. ``max_len`` bounds
    ``end - start`` (it sizes the split-KV shares, never the reads).
    """

    start: torch.Tensor
    end: torch.Tensor
    max_len: int
    table: Optional[torch.Tensor] = None


# The fields of each record, tensors and values, as every memo key built from one takes them.
SCORE_FIELDS = Fields(ScoreOptions)
VARLEN_FIELDS = Fields(Varlen)
KEY_RANGE_FIELDS = Fields(KeyRanges)
