"""Facts about this process that decide whether a backend can run: imports, Triton's release,
GPU capabilities and the interpreter. Each is computed once (imports and device queries are
costly) and is constant under torch.compile.

Triton is found by its module, ``triton``, never by its distribution name: on Windows the module
comes from the ``triton-windows`` distribution, and ``triton.__version__`` gives the Triton
release it builds (``3.8.0`` for ``triton-windows 3.8.0.post29``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from typing import Optional

import torch

from ..env import versions
from ..ops import configs, targets

# Turing (sm75: T4, RTX 20xx) and older. The doctor's gpu-too-old finding says the same.
TURING_ISSUES = "#330, #542, #720, #887"


def constant_under_compile(fn):
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does.

    The probes below are facts about the process, not about a call: torch.compile runs them while
    tracing and keeps their results as constants instead of tracing into imports. The mark is set
    directly because ``torch.compiler.assume_constant_result`` imports torch._dynamo (and with it
    Triton, over a second), which importing flash_recipe must not do. tests/test_torch_compile.py
    fails if torch stops honouring the mark.
    """
    fn._dynamo_marked_constant = True
    return fn


def computed_once(fn):
    """``fn`` with its result kept per argument tuple, and marked ``constant_under_compile``.

    Not ``functools.lru_cache``: Dynamo looks through an lru_cache wrapper, traces the function
    inside it and warns at every call site; a plain function marked constant is called once while
    tracing and its result kept. ``cache_clear()`` forgets the results (tests patch the facts).
    """
    results: dict = {}

    @functools.wraps(fn)
    def probe(*args):
        if args not in results:
            results[args] = fn(*args)
        return results[args]

    probe.cache_clear = results.clear
    return constant_under_compile(probe)


@computed_once
def import_error(module: str) -> Optional[str]:
    """None if ``module`` imports, else the reason as text (cached: imports are costly)."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything from ImportError to OSError
        return f"{type(exc).__name__}: {exc}"
    return None


@computed_once
def triton_too_old() -> Optional[str]:
    """Why the imported Triton is older than the kernels support, or None."""
    import triton

    release = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if release >= versions.TRITON_MIN:
        return None
    oldest = ".".join(map(str, versions.TRITON_MIN))
    return (
        f"Triton {triton.__version__} is older than {oldest}, the oldest these kernels support; Triton comes "
        f"with torch: upgrade torch to {'.'.join(map(str, versions.TORCH_MIN))} or newer "
        f"(flash-recipe doctor prints the command for your installer)"
    )


@computed_once
def capability(index: int) -> tuple[int, int]:
    """The compute capability ``(major, minor)`` of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_capability(device: torch.device) -> tuple[int, int]:
    return capability(device_index(device))


@constant_under_compile
def interpreter_problem() -> Optional[str]:
    """Why the Triton interpreter cannot run CPU tensors now, or None if it can."""
    if not targets.interpreter_enabled():
        return "tensors are on the CPU; Triton runs there only through its interpreter (TRITON_INTERPRET=1)"
    if targets.interpreter_imported_late():
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import of triton"
    return None


@computed_once
def configs_problem(index: int) -> Optional[str]:
    """Why flash_recipe's launch configurations cannot serve GPU ``index``, or None.

    A GPU the configuration tables do not know gets their most conservative family; this refuses
    an architecture no family serves (NVIDIA below sm80, AMD other than CDNA) and a GPU that
    reports less shared memory per block (``shared_memory_per_block_optin``) than its family needs.
    """
    target = targets.gpu_target(index)
    try:
        configs.arch_family(target)
    except ValueError as exc:
        return str(exc)
    available = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    if not available:
        return None  # this torch does not report it; the known targets are checked offline
    return configs.shared_memory_problem(target, available)


def pre_ampere_reason(major: int, minor: int) -> str:
    """Why neither these Triton kernels nor upstream flash-attn 2 run on a GPU below sm80."""
    return (
        f"GPU compute capability {major}.{minor} (sm{major}{minor}) is below 8.0: Triton has no tensor-core path "
        f"there (it lowers tl.dot to FMA instructions on sm75 and older), so these kernels need sm80 or newer; "
        f"upstream flash-attn 2 has no Turing support either (flash-attention issues {TURING_ISSUES}). "
        f"The sdpa backend runs such calls with torch's memory-efficient kernel"
    )


def pre_ampere_nvidia(device: torch.device) -> bool:
    """A CUDA device below sm80 (torch SDPA has no flash kernel there)."""
    return device.type == "cuda" and torch.version.hip is None and device_capability(device) < (8, 0)


def last_dim_strided(call) -> Optional[str]:
    """The reason a kernel backend refuses q, k or v whose last dimension is not contiguous."""
    if any(t.stride(-1) != 1 for t in (call.q, call.k, call.v)):
        return "the last dimension of q, k and v must be contiguous"
    return None
