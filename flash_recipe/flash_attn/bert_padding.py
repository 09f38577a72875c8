"""``flash_attn.bert_padding`` of the stand-in: between padded batches and packed sequences.

``unpad_input``, ``pad_input`` and ``index_put_first_axis`` are ``flash_recipe.padding``'s;
``index_first_axis`` gathers along the first axis (``(batch * seqlen, ...)`` -> ``(total, ...)``).
"""

from __future__ import annotations

import torch

from ..padding import index_put_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices (total,)`` of ``input (first_axis_dim, ...)``: ``(total, ...)``, differentiable."""
    return input[indices]


def __getattr__(name: str):
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn.bert_padding", name, __all__)
