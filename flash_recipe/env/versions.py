"""The torch and Triton releases flash_recipe supports: the one place the code reads them.

``pyproject.toml`` states the same lower bounds as dependency specifiers; a test checks that the
two agree. Each torch wheel pins one Triton release, so the Triton bound implies the torch one.
Importable without torch or Triton (the doctor reads it on broken installs).
"""

from __future__ import annotations

# The oldest Triton whose compiler, interpreter and launch specialisation the kernels are tested
# with (``nox -s torch_compat``, each torch with the Triton it pins). Triton 3.1's interpreter does
# not see ``tl.constexpr`` parameters annotated as strings (``from __future__ import annotations``,
# which the kernel modules use), so ``tl.arange(0, BLOCK_M)`` fails there; 3.2 and later run and compile the kernels.
TRITON_MIN = (3, 2)
# The oldest torch whose CUDA wheels pin a Triton at or above TRITON_MIN.
TORCH_MIN = (2, 6)
# torch minor release -> the Triton its wheels pin (a wheel's METADATA ``Requires-Dist: triton==``;
# 2.7.0 pins 3.3.0, later 2.7 patch releases 3.3.1; 2.14 and 2.15 pin ``~=3.8`` and ``~=3.9``; the CUDA
# build of 2.13.0 pins 3.7.1, its CPU build none).
TRITON_OF_TORCH = {
    (2, 4): (3, 0),
    (2, 5): (3, 1),
    (2, 6): (3, 2),
    (2, 7): (3, 3),
    (2, 8): (3, 4),
    (2, 9): (3, 5),
    (2, 10): (3, 6),
    (2, 11): (3, 6),
    (2, 12): (3, 7),
    (2, 13): (3, 7),
    (2, 14): (3, 8),
    (2, 15): (3, 9),
}
