"""``sageattention.core`` of the stand-in: SageAttention's module of the attention functions,
which code also imports them from (``from sageattention.core import sageattn``), and its probes of
which paths this machine can run.

The functions are the package's (``flash_recipe.sage``). The probes are computed when read, from
the visible GPUs (importing this module initialises nothing):

- ``get_cuda_arch_versions()``: ``["sm80", "sm89", ...]``, one per visible CUDA GPU (none on ROCm
  or without a GPU);
- ``SM80_ENABLED``: a visible NVIDIA GPU runs the 8-bit kernels (sm80 or newer);
- ``SM89_ENABLED``, ``SM90_ENABLED``: a visible NVIDIA GPU runs FP8 P.V, which both
  ``sageattn_qk_int8_pv_fp8_cuda`` and its ``_sm90`` name need (sm89 or newer: one Triton kernel
  serves both names, where SageAttention compiles one extension per architecture).

SageAttention's quantization helpers (``per_block_int8_triton`` and the like) are not provided:
importing them raises ImportError naming what is.
"""

from __future__ import annotations

import torch

from ..sage import (
    sageattn,
    sageattn_qk_int8_pv_fp8_cuda,
    sageattn_qk_int8_pv_fp8_cuda_sm90,
    sageattn_qk_int8_pv_fp16_cuda,
    sageattn_qk_int8_pv_fp16_triton,
    sageattn_varlen,
)

# Each probe and the compute capability from which a visible NVIDIA GPU runs its path.
_PROBES = {"SM80_ENABLED": (8, 0), "SM89_ENABLED": (8, 9), "SM90_ENABLED": (8, 9)}

__all__ = [
    "get_cuda_arch_versions",
    "sageattn",
    "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp16_triton",
    "sageattn_qk_int8_pv_fp8_cuda",
    "sageattn_qk_int8_pv_fp8_cuda_sm90",
    "sageattn_varlen",
    *_PROBES,
]


def _capabilities() -> list[tuple[int, int]]:
    """The compute capability of each visible NVIDIA GPU."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(index) for index in range(torch.cuda.device_count())]


def get_cuda_arch_versions() -> list[str]:
    """``"sm<major><minor>"`` of each visible NVIDIA GPU, in device order (``[]`` without one)."""
    return [f"sm{major}{minor}" for major, minor in _capabilities()]


def __getattr__(name: str):
    if name in _PROBES:
        return any(capability >= _PROBES[name] for capability in _capabilities())
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("sageattention.core", name, __all__)
