"""The accuracy rule, the one definition every accuracy check calls.

A result ``got`` is compared with the truth (the reference in fp32, or fp64 for fp32 inputs:
``flash_recipe.reference.compute_dtype(dtype, upcast=True)``) and with ``same``, plain PyTorch
computing the same thing in the input precision::

    max |got - truth|  <=  factor * max |same - truth|  +  1e-5

with ``factor`` 2 for the forward (output, log-sum-exp) and 3 for gradients, as in flash-attn's own
tests. The floor keeps the bound above zero where PyTorch happens to be exact.
"""

from __future__ import annotations

from typing import Any

# The rule's constants: its floor and the factor of each named result.
FLOOR = 1e-5
FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
FACTORS = {
    "out": FORWARD_FACTOR,
    "lse": FORWARD_FACTOR,
    "dq": GRADIENT_FACTOR,
    "dk": GRADIENT_FACTOR,
    "dv": GRADIENT_FACTOR,
    "dsink": GRADIENT_FACTOR,  # attention sinks' gradient
}


def max_error(a: Any, b: Any) -> float:
    """``max |a - b|`` computed in fp64, as a float; 0.0 for empty tensors."""
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def accuracy_bound(torch_error: float, factor: float) -> float:
    """The largest error the rule allows, given PyTorch's own error in the input precision."""
    return factor * torch_error + FLOOR


def assert_accurate(name: str, got: Any, truth: Any, same: Any, factor: float) -> None:
    """Raise AssertionError (naming ``name``, the error and the bound) unless ``got`` meets the rule
    against ``truth``, with ``same`` as PyTorch's input-precision result; all three of one shape."""
    error = max_error(got, truth)
    bound = accuracy_bound(max_error(same, truth), factor)
    if not error <= bound:
        raise AssertionError(
            f"{name}: max error {error:.3g} > {bound:.3g} ({factor:g}x torch in the input dtype + {FLOOR:g})"
        )
