"""What the accuracy checks share, like ``torch.testing``: verify, tune, the campaign and the tests
import it; nothing in the package's call path does.

- ``accuracy``: the accuracy rule (``accuracy_bound``, ``assert_accurate``, ``max_error``);
- ``oracles``: plain-torch truths in any precision: attention (``attention``), rotary embedding
  (``rotary``) and the precision each one computes in (``compute_dtype``).

It imports only torch and ``flash_recipe.reference``, so every layer may use it.
"""

from __future__ import annotations

from .accuracy import (
    FACTORS,
    FLOOR,
    FORWARD_FACTOR,
    GRADIENT_FACTOR,
    accuracy_bound,
    assert_accurate,
    max_error,
)
from .oracles import attention, compute_dtype, rotary

__all__ = [
    "FACTORS",
    "FLOOR",
    "FORWARD_FACTOR",
    "GRADIENT_FACTOR",
    "accuracy_bound",
    "assert_accurate",
    "attention",
    "compute_dtype",
    "max_error",
    "rotary",
]
