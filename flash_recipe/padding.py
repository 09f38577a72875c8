"""Between padded batches and packed variable-length sequences, with flash-attn's signatures.

``unpad_input`` packs the tokens an attention mask keeps; ``pad_input`` scatters them back::

    x (batch, seqlen, ...), attention_mask (batch, seqlen)  ->  x_unpad (total, ...), indices, cu_seqlens, ...
"""

from __future__ import annotations

from typing import Optional

import torch


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Optional[torch.Tensor] = None):
    """Pack the kept tokens of a padded batch.

    Arguments:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or int, nonzero where a token is real.
        unused_mask: optional ``(batch, seqlen)``: tokens that are packed too (they count in the
            offsets) but not in ``seqused``.

    Returns:
        ``hidden_states (total, ...)``, ``indices (total,)`` int64 into the flattened
        ``(batch * seqlen)`` positions, ``cu_seqlens (batch + 1,)`` int32, ``max_seqlen_in_batch``
        (int), ``seqused (batch,)`` int32: the tokens per sequence that ``attention_mask`` keeps.
    """
    if hidden_states.dim() < 2 or attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"attention_mask must have shape (batch, seqlen) = {tuple(hidden_states.shape[:2])}, "
            f"got {tuple(attention_mask.shape)}"
        )
    keep = attention_mask.bool()
    all_masks = keep | unused_mask.bool() if unused_mask is not None else keep
    seqused = keep.sum(dim=-1, dtype=torch.int32)
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, seqused


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """``values (total, ...)`` scattered to rows ``indices`` of zeros ``(first_axis_dim, ...)``, differentiable."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)  # differentiable, unlike an in-place copy


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter packed tokens ``(total, ...)`` back to ``(batch, seqlen, ...)``, zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
