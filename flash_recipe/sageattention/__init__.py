"""The stand-in for the ``sageattention`` package that ``flash_recipe.install_as_sageattention()`` installs.

After ``install_as_sageattention()``, ``import sageattention`` gives this module: SageAttention
2.2.0's public functions (``flash_recipe.sage.SAGE_NAMES``), by the same names and arguments,
computed by flash_recipe's 8-bit Triton kernels (``flash_recipe.sage`` documents them). Importing
it installs nothing. ``sageattention.core`` gives the same functions and SageAttention's probes of
the GPU (``get_cuda_arch_versions``, ``SM89_ENABLED``, ...). Its other modules (the compiled
extensions, the quantization helpers) are not provided: importing them raises ImportError naming
what is.
"""

from __future__ import annotations

from ..sage import (
    sageattn,
    sageattn_qk_int8_pv_fp8_cuda,
    sageattn_qk_int8_pv_fp8_cuda_sm90,
    sageattn_qk_int8_pv_fp16_cuda,
    sageattn_qk_int8_pv_fp16_triton,
    sageattn_varlen,
)

# The SageAttention release whose API this stand-in provides: ``importlib.metadata`` answers it
# too while the stand-in is installed (diffusers 0.42 requires 2.1.1 or newer).
__version__ = "2.2.0"
# Marks the stand-in, so that flash_recipe never mistakes it for upstream SageAttention.
__flash_recipe__ = True

__all__ = [
    "__version__",
    "sageattn",
    "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp16_triton",
    "sageattn_qk_int8_pv_fp8_cuda",
    "sageattn_qk_int8_pv_fp8_cuda_sm90",
    "sageattn_varlen",
]


def __getattr__(name: str):
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("sageattention", name, __all__)
