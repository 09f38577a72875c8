"""What the kernels compile for here: the GPU's compile target, the Triton release, the interpreter.

- ``target_of(device)``: ``"sm90"``, ``"gfx942"`` or ``"interpreter"`` for tensors on ``device``
  (the key ``ops.configs.arch_family`` maps to a table); ``gpu_target(index)`` for one GPU.
- ``triton_release()``: the installed Triton's ``(major, minor)``, read without importing it.
- ``OFFLINE_GPUS``: the multiprocessor counts of the GPUs that planning without one models;
- ``interpreter_enabled()``: whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter, the
  one reading of that variable in flash_recipe; ``interpreter_imported_late()``: whether Triton
  was imported before it was set.

Callers look these names up on the module (``targets.target_of(...)``), so that the compile
check, the warm-up and the tests can answer for a GPU that is not there by replacing them.
"""

from __future__ import annotations

import functools
import re
import sys
from importlib import metadata

from ..environ import getenv

# The GPUs that planning without one models, as (multiprocessor count, compile target): A100,
# H100/H200 and RTX 4090. The offline warm-up takes its split-KV counts from them.
OFFLINE_GPUS = ((108, "sm80"), (132, "sm90"), (128, "sm89"))


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels through its CPU interpreter, read
    as the installed Triton reads it: from Triton 3.4 on, ``1``, ``true``, ``yes``, ``on`` or ``y``
    in any case; before 3.4, only ``1``. The one definition in flash_recipe."""
    value = getenv("TRITON_INTERPRET")
    if triton_release() < (3, 4):
        return value == "1"
    return value.lower() in ("1", "true", "yes", "on", "y")


@functools.cache
def triton_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton, read from its metadata without importing it
    (the newest rules when no Triton distribution is found)."""
    for name in ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-windows"):
        try:
            found = re.match(r"(\d+)\.(\d+)", metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        if found:
            return int(found.group(1)), int(found.group(2))
    return (99, 0)


def interpreter_imported_late() -> bool:
    """True if Triton was imported before ``TRITON_INTERPRET=1`` was set.

    Triton decides at import whether its own library functions are compiled or interpreted, so
    setting the variable afterwards leaves it half in each mode.
    """
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.cdiv).__name__ != "InterpretedFunction"


@functools.cache
def gpu_target(index: int) -> str:
    """The compile target of GPU ``index``: ``"sm90"``, ``"sm120"``, ``"gfx942"``."""
    # torch is imported only when a GPU is asked about: the doctor reads the interpreter setting
    # from this module where torch may fail to import.
    import torch

    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def target_of(device) -> str:
    """The compile target for tensors on ``device``: ``"sm90"``, ``"gfx942"`` or ``"interpreter"``."""
    if interpreter_enabled() or device.type == "cpu":
        return "interpreter"
    index = device.index
    if index is None:
        import torch  # only for a GPU device (see gpu_target)

        index = torch.cuda.current_device()
    return gpu_target(index)
