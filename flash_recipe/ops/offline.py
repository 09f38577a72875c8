"""Launches that compile for a named GPU target and run nothing, on a machine without that GPU.

Inside ``offline_launches(target)`` a launcher called with CPU tensors goes through Triton's own
launch path, so each kernel compiles for the arguments it is launched with (16-byte-aligned
pointers and integers divisible by 16 marked ``tt.divisibility``, integers equal to 1 as
constants), exactly as a launch on the GPU compiles it. Two things stand in for the GPU:

- ``OfflineDriver``, the driver Triton asks: it names ``target`` as the current device's and
  launches nothing (Triton compiles as for a warm-up);
- ``targets.target_of``, which answers ``target`` for every device, so the launchers choose that
  target's configurations and features.

Each launch of a kernel of ``jit_kernels()`` is recorded as ``(kernel name, compiled kernel)``;
``compiled.metadata.shared`` is the shared memory the launch needs, ``compiled.asm`` the code.
The compile check (``devtools.compile_check``), the offline warm-up and the doctor's
compile probe make their launcher calls inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from . import backward, backward_one_launch, forward, int8_attention, kvcache, quantize, split_merge, targets


def gpu_target(target: str) -> GPUTarget:
    """Triton's ``GPUTarget`` for ``"sm90"`` (CUDA, warps of 32) or ``"gfx942"`` (HIP, wavefronts of 64)."""
    if target.startswith("gfx"):
        return GPUTarget("hip", target, 64)
    return GPUTarget("cuda", int(target[2:]), 32)


class OfflineDriver:
    """Stands in for the GPU driver: reports ``target`` as the current device and launches nothing.

    The device is named after the target, so that Triton's per-device kernel caches keep each
    target's kernels apart within one process.
    """

    def __init__(self, target: str):
        self.name = target
        self.target = gpu_target(target)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return f"offline-{self.name}"

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def jit_kernels() -> dict:
    """The launchable jit functions of the kernel modules (``forward``, ``backward``,
    ``backward_one_launch``, ``kvcache``, ``split_merge``, ``quantize``, ``int8_attention``), by name."""
    found = {}
    for module in (forward, backward, backward_one_launch, kvcache, split_merge, quantize, int8_attention):
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", obj)  # triton.heuristics wraps the jit function
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                found[name] = fn
    return found


@contextlib.contextmanager
def offline_launches(target: str) -> Iterator[list[tuple[str, Any]]]:
    """Launches compile for ``target`` and run nothing; yields the list of ``(name, compiled)``."""
    compiled: list[tuple[str, Any]] = []
    kernels = jit_kernels()
    original_target_of = targets.target_of

    def capture(name, fn):
        run = type(fn).run

        def offline_run(*args, grid, warmup, **kwargs):
            kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)
            compiled.append((name, kernel))
            return kernel

        return offline_run

    saved = dict(vars(driver))  # the active driver's slot is named differently across Triton releases
    driver.set_active(OfflineDriver(target))
    targets.target_of = lambda device: target
    for name, fn in kernels.items():
        fn.run = capture(name, fn)
    try:
        yield compiled
    finally:
        for fn in kernels.values():
            del fn.run
        targets.target_of = original_target_of
        vars(driver).clear()
        vars(driver).update(saved)
