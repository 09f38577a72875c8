"""The fp64-capable oracles: plain-torch definitions computed in whatever precision they are given.

- ``attention(q, k, v, ...)``: one dense attention call, ``flash_recipe.reference.attention_reference``
  (its docstring gives the shapes, the GQA mapping and the mask alignment);
- ``rotary(x, cos, sin, positions, interleaved, dtype)``: rotary embedding computed in ``dtype``;
- ``compute_dtype(dtype, upcast)``: the truth's precision for inputs of ``dtype``.

These are the definitions the reference backend itself runs, so an oracle and the reference
cannot drift apart.
"""

from __future__ import annotations

from ..reference import attention_reference as attention
from ..reference import compute_dtype
from ..reference import rotate as rotary

__all__ = ["attention", "compute_dtype", "rotary"]
