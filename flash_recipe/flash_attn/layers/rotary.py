"""``flash_attn.layers.rotary`` of the stand-in: ``apply_rotary_emb`` (flash-attn 2.8.3's signature).

Computed in plain torch through ``flash_recipe.reference.rotary_reference`` (fp32, differentiable).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ... import validate
from ...reference import rotary_reference

__all__ = ["apply_rotary_emb"]


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> torch.Tensor:
    """Rotary embedding of the first ``rotary_dim`` features of each head.

    Arguments:
        x: ``(batch_size, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with
            ``cu_seqlens``.
        cos, sin: ``(seqlen_rotary, rotary_dim / 2)``, ``rotary_dim <= headdim``; token ``t`` of a
            sequence uses row ``t + offset``, which must be below ``seqlen_rotary``.
        interleaved: rotate pairs ``(2j, 2j + 1)`` (GPT-J) instead of ``(j, j + rotary_dim / 2)``
            (GPT-NeoX).
        inplace: write the result into ``x`` and return it.
        seqlen_offsets: an int, or int ``(batch_size,)``: each sequence's first position.
        cu_seqlens: int32 ``(batch_size + 1,)`` offsets of the packed sequences; ``max_seqlen`` is
            accepted for flash-attn's signature and not needed.

    Returns:
        x's shape and dtype; the features past ``rotary_dim`` unchanged.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    validate.check_bool("interleaved", interleaved)
    validate.check_bool("inplace", inplace)
    packed = cu_seqlens is not None
    if x.dim() != (3 if packed else 4):
        layout = (
            "(total_seqlen, nheads, headdim) with cu_seqlens" if packed else "(batch_size, seqlen, nheads, headdim)"
        )
        raise ValueError(f"x must be {layout}, got shape {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor (seqlen_rotary, rotary_dim / 2)")
    if cos.shape != sin.shape or 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(
            f"cos and sin must have one shape (seqlen_rotary, rotary_dim / 2) with rotary_dim <= headdim "
            f"{x.shape[-1]}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if packed:
        cu_seqlens = validate.check_offsets("cu_seqlens", cu_seqlens, x.shape[0], x.device)
        tokens = torch.arange(x.shape[0], device=x.device)
        batch_of = torch.bucketize(tokens, cu_seqlens[1:].long(), right=True)  # (total,)
        positions = tokens - cu_seqlens.long()[batch_of]
    else:
        batch_of = torch.arange(x.shape[0], device=x.device)[:, None]  # (B, 1)
        positions = torch.arange(x.shape[1], device=x.device)[None, :]  # (1, S)
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = cu_seqlens.numel() - 1 if packed else x.shape[0]
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype.is_floating_point:
            raise ValueError(f"seqlen_offsets must be an int or an integer tensor (batch_size,) = ({batch},)")
        positions = positions + seqlen_offsets.to(x.device).long()[batch_of]
    else:
        positions = positions + validate.check_int("seqlen_offsets", seqlen_offsets, 0)
    if not packed and not isinstance(seqlen_offsets, torch.Tensor) and x.shape[1] + seqlen_offsets > cos.shape[0]:
        raise ValueError(
            f"positions reach {x.shape[1] + seqlen_offsets - 1}, past cos/sin's seqlen_rotary {cos.shape[0]} rows"
        )
    if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"positions reach {int(positions.max())}, past cos/sin's seqlen_rotary {cos.shape[0]} rows")
    if packed:
        out = rotary_reference(x.unsqueeze(0), cos, sin, positions.unsqueeze(0), interleaved).squeeze(0)
    else:
        out = rotary_reference(x, cos, sin, positions.expand(x.shape[0], x.shape[1]), interleaved)
    return x.copy_(out) if inplace else out


def __getattr__(name: str):
    from ...alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn.layers.rotary", name, __all__)
