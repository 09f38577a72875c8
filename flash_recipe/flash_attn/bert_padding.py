"""``flash_attn.bert_padding`` of the stand-in: between padded batches and packed sequences.

``unpad_input`` and ``pad_input`` are ``flash_recipe.padding``'s; the two indexing helpers below
gather and scatter along the first axis (``(batch * seqlen, ...)`` <-> ``(total, ...)``).
"""

from __future__ import annotations

import torch

from flash_recipe.padding import pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices (total,)`` of ``input (first_axis_dim, ...)``: ``(total, ...)``, differentiable."""
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """``values (total, ...)`` scattered to rows ``indices`` of zeros ``(first_axis_dim, ...)``, differentiable."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def __getattr__(name: str):
    from flash_recipe.alias import missing

    raise missing("flash_attn.bert_padding", name, __all__)
