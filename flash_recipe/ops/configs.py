"""Launch configurations (block sizes, warps, pipeline stages) per architecture, as data.

A configuration is chosen by ``(arch, kernel, head-dim bucket, element size)``:

- ``arch``: a family of compile targets (``FAMILIES``): ``"sm80"`` (A100: 163 KiB shared memory
  per block), ``"sm86"`` (sm86/sm89, consumer Ampere and Ada: 99 KiB), ``"sm90"`` (Hopper: 227 KiB,
  wgmma), ``"sm100"`` (B200: 227 KiB, tcgen05), ``"sm120"`` (sm120/sm121, RTX 50xx and DGX Spark:
  99 KiB, no wgmma), ``"amd"`` (CDNA gfx90a/gfx942/gfx950, sized for 64 KiB of LDS) or
  ``"interpreter"`` (``TRITON_INTERPRET=1`` on the CPU, where bigger blocks mean fewer programs and
  so less Python overhead). A GPU without a family of its own gets ``FALLBACK_FAMILY``.
- ``kernel``: ``"fwd"`` (the dense forward with plain scores, masks and windows only, at a head
  dim in ``HEAD_DIM_BUCKETS``), ``"fwd_general"`` (the forward with packed sequences, a KV cache's
  key ranges or pages, a softcap, ALiBi, dropout or masked head-dim columns, whose extra registers
  the dense forward's largest tiles cannot hold),
  ``"bwd_dkdv"``, ``"bwd_dq"`` (the deterministic backward's two kernels), ``"bwd_onepass"`` (the
  dK/dV kernel adding dQ with atomics: the default backward, whose dQ tile needs registers of its
  own), ``"decode"`` (the forward kernel on a KV cache with few query rows).
- head-dim bucket: the padded head dim, a power of two from 16 to 256.
- element size: 2 for fp16/bf16, 4 for fp32 (fp32 tiles need twice the shared memory).

Every entry is compiled for its targets, as a launch compiles it, by ``nox -s compile_check``
(``flash_recipe.tools.compile_check``), which checks each kernel against ``SHARED_MEMORY_LIMIT``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Callable, NamedTuple, Optional, TypeVar

T = TypeVar("T")

# Shared memory one block may use (the opt-in maximum), in bytes, per compile target. Sources:
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (sm80 163 KiB,
# sm86/sm89 99 KiB, sm90 227 KiB); CUTLASS ``sm100_smem_capacity_bytes`` (227 KiB) and
# ``sm120_smem_capacity_bytes`` (99 KiB, also reported by devices in flashinfer#3568 and
# cutlass#2692; the GB10 of DGX Spark, sm121, is the same design); AMD CDNA2/CDNA3 ISA guides (64 KiB
# LDS per workgroup) and the CDNA4 ISA guide (160 KiB LDS on gfx950).
SHARED_MEMORY_LIMIT = {
    "sm80": 166912,
    "sm86": 101376,
    "sm89": 101376,
    "sm90": 232448,
    "sm100": 232448,
    "sm120": 101376,
    "sm121": 101376,
    "gfx90a": 65536,
    "gfx942": 65536,
    "gfx950": 163840,
}


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (arch, kernel) -> list of (max head-dim bucket, max element size, Config); first match wins.
_TABLE: dict[tuple[str, str], list[tuple[int, int, Config]]] = {
    ("sm90", "fwd"): [
        (64, 2, Config(128, 64, 4, 3)),
        (128, 2, Config(128, 128, 8, 3)),  # wgmma m64n128 per warp group; K/V through TMA (ops.features)
        (256, 2, Config(64, 64, 4, 2)),
        (64, 4, Config(64, 64, 4, 2)),
        (128, 4, Config(64, 32, 4, 2)),
        (256, 4, Config(32, 32, 4, 1)),
    ],
    ("sm90", "fwd_general"): [
        (64, 2, Config(128, 64, 8, 3)),  # 4 warps spill 40 B with packed sequences (varlen)
        (128, 2, Config(128, 64, 8, 3)),
        (256, 2, Config(64, 64, 4, 2)),
        (64, 4, Config(64, 64, 4, 2)),
        (128, 4, Config(64, 32, 4, 2)),
        (256, 4, Config(32, 32, 4, 1)),
    ],
    ("sm80", "fwd"): [
        (32, 2, Config(128, 64, 8, 2)),  # 4 warps spill 16 B at head dim 32; 3 stages 8 B (causal, sections)
        (64, 2, Config(128, 64, 4, 3)),
        (128, 2, Config(128, 64, 8, 3)),
        (256, 2, Config(64, 64, 4, 2)),
        (64, 4, Config(64, 64, 4, 2)),
        (128, 4, Config(64, 32, 4, 2)),
        (256, 4, Config(32, 32, 4, 1)),
    ],
    ("sm86", "fwd"): [
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(64, 64, 4, 2)),
        (256, 2, Config(64, 32, 4, 1)),
        (64, 4, Config(64, 32, 4, 2)),
        (128, 4, Config(32, 32, 4, 2)),
        (256, 4, Config(32, 16, 4, 1)),
    ],
    ("sm90", "bwd_dkdv"): [
        (64, 2, Config(64, 128, 8, 2)),
        (128, 2, Config(32, 128, 8, 2)),
        (256, 2, Config(32, 64, 8, 1)),
        (128, 4, Config(32, 64, 4, 1)),
        (256, 4, Config(16, 32, 4, 1)),
    ],
    ("sm80", "bwd_dkdv"): [
        (64, 2, Config(64, 128, 8, 2)),
        (128, 2, Config(64, 64, 8, 2)),
        (256, 2, Config(32, 64, 8, 1)),
        (128, 4, Config(32, 64, 4, 1)),
        (256, 4, Config(16, 32, 4, 1)),
    ],
    ("sm86", "bwd_dkdv"): [
        (64, 2, Config(32, 64, 4, 2)),
        (128, 2, Config(32, 64, 4, 1)),
        (256, 2, Config(16, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ],
    ("sm90", "bwd_dq"): [
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(128, 64, 8, 2)),
        (256, 2, Config(64, 32, 4, 1)),
        (128, 4, Config(64, 32, 4, 1)),
        (256, 4, Config(32, 16, 4, 1)),
    ],
    ("sm80", "bwd_dq"): [
        (64, 2, Config(128, 64, 8, 2)),
        (128, 2, Config(128, 32, 8, 2)),
        (256, 2, Config(64, 32, 4, 1)),
        (128, 4, Config(64, 32, 4, 1)),
        (256, 4, Config(32, 16, 4, 1)),
    ],
    ("sm86", "bwd_dq"): [
        (32, 2, Config(64, 32, 4, 1)),  # 64-key blocks spill 8 B at head dim 16 (causal, sections); 2 stages at 32
        (64, 2, Config(64, 64, 4, 2)),
        (128, 2, Config(64, 32, 4, 1)),
        (256, 2, Config(32, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ],
    # CDNA: 64-wide wavefronts, 64 KiB LDS, no multi-stage software pipelining needed.
    ("amd", "fwd"): [
        (128, 2, Config(64, 64, 4, 1)),
        (256, 2, Config(64, 32, 4, 1)),
        (64, 4, Config(64, 32, 4, 1)),
        (256, 4, Config(32, 16, 4, 1)),
    ],
    ("amd", "bwd_dkdv"): [
        (64, 2, Config(32, 64, 4, 1)),
        (128, 2, Config(32, 32, 4, 1)),
        (256, 2, Config(16, 32, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ],
    ("amd", "bwd_dq"): [
        (64, 2, Config(64, 32, 4, 1)),
        (128, 2, Config(32, 32, 4, 1)),
        (256, 2, Config(32, 16, 4, 1)),
        (64, 4, Config(32, 32, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ],
    # Decoding (a KV cache, a few query rows): 16-row query blocks (the smallest matrix-unit tile)
    # and long key blocks, since the work is streaming the cache.
    ("sm90", "decode"): [
        (64, 2, Config(16, 128, 4, 3)),
        (128, 2, Config(16, 64, 4, 3)),
        (256, 2, Config(16, 64, 4, 2)),
        (64, 4, Config(16, 64, 4, 2)),
        (128, 4, Config(16, 32, 4, 2)),
        (256, 4, Config(16, 32, 4, 1)),
    ],
    ("sm80", "decode"): [
        (64, 2, Config(16, 128, 4, 3)),
        (128, 2, Config(16, 64, 4, 3)),
        (256, 2, Config(16, 64, 4, 2)),
        (64, 4, Config(16, 64, 4, 2)),
        (128, 4, Config(16, 32, 4, 2)),
        (256, 4, Config(16, 32, 4, 1)),
    ],
    ("sm86", "decode"): [
        (16, 2, Config(16, 64, 4, 2)),  # 128-key blocks spill 8 B at head dim 16 (paged)
        (64, 2, Config(16, 128, 4, 2)),
        (128, 2, Config(16, 64, 4, 2)),
        (256, 2, Config(16, 32, 4, 2)),
        (64, 4, Config(16, 64, 4, 2)),
        (128, 4, Config(16, 32, 4, 2)),
        (256, 4, Config(16, 16, 4, 2)),
    ],
    ("amd", "decode"): [
        (128, 2, Config(16, 64, 4, 1)),
        (256, 2, Config(16, 32, 4, 1)),
        (64, 4, Config(16, 64, 4, 1)),
        (256, 4, Config(16, 16, 4, 1)),
    ],
    # The interpreter: large blocks keep the number of (slow, Python-level) programs low.
    ("interpreter", "fwd"): [(256, 4, Config(32, 32, 1, 1))],
    ("interpreter", "bwd_dkdv"): [(256, 4, Config(32, 32, 1, 1))],
    ("interpreter", "bwd_dq"): [(256, 4, Config(32, 32, 1, 1))],
    ("interpreter", "decode"): [(256, 4, Config(16, 32, 1, 1))],
}

KERNELS = ("fwd", "fwd_general", "bwd_dkdv", "bwd_dq", "bwd_onepass", "decode")

# The one-pass backward holds each query block's dQ tile beside dK/dV's accumulators: the dK/dV
# tiles, except where the compile check found them spilling with it (fp16/bf16, head dim <= 128,
# ``compile_check --call bwd``): sm80 at head dims 64 (8 B) and 128 (8 B); sm86 and sm120 at 128
# (16 B and 40 B). The replacements are the tiles that compile there without a spill and with the
# fewest main-loop instructions per block-pair element among those tried; none measured on a GPU.
for _arch in ("sm90", "sm80", "sm86", "amd", "interpreter"):
    _TABLE[(_arch, "bwd_onepass")] = list(_TABLE[(_arch, "bwd_dkdv")])
# sm80 at head dim 128 runs two stages: with one, the packed-sequence (varlen) call spilled 16 B;
# two spill in no call on Triton 3.9 (``compile_check --call bwd --call sinks --call varlen
# --target sm80 --head-dim 128``) nor in the ``bwd`` call on 3.2.
_TABLE[("sm80", "bwd_onepass")][:2] = [(64, 2, Config(32, 128, 8, 2)), (128, 2, Config(64, 64, 8, 2))]
_TABLE[("sm86", "bwd_onepass")][1] = (128, 2, Config(32, 32, 4, 2))
# sm90 at head dim 128: with attention sinks' row sums the 2-stage tile spilled 8 B; one stage keeps
# both variants spill-free, with fewer main-loop instructions per element (787 against 852 per 1000,
# measured before the dK/dV loop walked a GQA group's heads; 0.80 per element now, docs/performance.md).
_TABLE[("sm90", "bwd_onepass")][1] = (128, 2, Config(32, 128, 8, 1))
# Triton releases before these compile that tile with spills (56 to 224 B per thread on 3.2 and 3.3,
# fp16/bf16, MHA, GQA and sinks), and every other wgmma tile tried spilled or crashed the compiler
# (``compile_check --call bwd --call sinks --target sm90 --head-dim 128`` per release): there the
# backward takes the three kernels (``one_pass_fits``). sm100 takes Hopper's tile and so the same
# rule, not compiled per release for sm100 itself.
ONE_PASS_SINCE_TRITON = {("sm90", 128): (3, 4), ("sm100", 128): (3, 4)}

# sm120/sm121 have sm86's 99 KiB of shared memory and its matrix instruction (mma.sync, no wgmma):
# they take its tiles, which the compile check proves for sm120 and sm121 themselves. sm100 takes
# Hopper's tiles except dK/dV at head dim 256, whose 64-key blocks Triton 3.9 compiles to a trap
# on sm100 (ragged form).
# The general forward takes the dense forward's tiles except on Hopper (above).
for _arch in ("sm80", "sm86", "amd", "interpreter"):
    _TABLE[(_arch, "fwd_general")] = _TABLE[(_arch, "fwd")]
# sm86/sm120 at head dim 128 (99 KiB): the dense forward's 64x64 tile spilled with packed sequences
# (sm120 112 B) and paged caches (sm86 56 B, sm120 72 B), and 160-224 B with every score option.
# 32x64 at two stages spills in none of the three on sm86 and sm120; of the spill-free tiles tried
# (64x32 at 4 and 8 warps, 64x64 at one stage, which still spilled with the score options) it issues
# the fewest instructions per score element where it matters most (``compile_check --call varlen
# --call paged --call options --target sm86 --target sm120 --head-dim 128``). None measured on a GPU.
_TABLE[("sm86", "fwd_general")] = list(_TABLE[("sm86", "fwd")])
_TABLE[("sm86", "fwd_general")][1] = (128, 2, Config(32, 64, 4, 2))
for _kernel in KERNELS:
    _TABLE[("sm120", _kernel)] = _TABLE[("sm86", _kernel)]
    _TABLE[("sm100", _kernel)] = _TABLE[("sm90", _kernel)]
_TABLE[("sm100", "bwd_dkdv")] = [
    (bucket, size, Config(32, 32, 4, 1) if (bucket, size) == (256, 2) else config)
    for bucket, size, config in _TABLE[("sm90", "bwd_dkdv")]
]
# sm100's dK/dV at head dim 128: Hopper's tile spilled 8 B (MHA, fp16/bf16); 64-row query blocks
# do not, with fewer main-loop instructions per element (6.70 x 8 / (64 x 128) against 9.72 x 8 /
# (32 x 128)), ``compile_check --call bwd --target sm100 --head-dim 128``.
_TABLE[("sm100", "bwd_dkdv")][1] = (128, 2, Config(64, 128, 8, 1))
_TABLE[("sm100", "bwd_onepass")] = list(_TABLE[("sm100", "bwd_dkdv")])  # the same trap at 256
_TABLE[("sm100", "bwd_onepass")][1] = _TABLE[("sm90", "bwd_onepass")][1]
ARCHS = ("sm80", "sm86", "sm90", "sm100", "sm120", "amd", "interpreter")


# Compile targets with a table of their own, and the table each uses.
FAMILIES = {
    "sm80": "sm80", "sm86": "sm86", "sm89": "sm86", "sm90": "sm90", "sm100": "sm100",
    "sm120": "sm120", "sm121": "sm120", "gfx90a": "amd", "gfx942": "amd", "gfx950": "amd",
}
# The shared memory each family's configurations are sized for (the least among its targets): a GPU
# must offer at least this much per block. An architecture the tables do not know gets the family
# sized for the least memory among its vendor's supported GPUs.
FAMILY_SHARED_MEMORY = {family: min(SHARED_MEMORY_LIMIT[t] for t, f in FAMILIES.items() if f == family)
                        for family in set(FAMILIES.values())}
FALLBACK_FAMILY = {"cuda": "sm86", "hip": "amd"}


def arch_family(target: str) -> str:
    """Map a compile target (``"sm89"``, ``"sm121"``, ``"gfx942"``, ``"interpreter"``) to a table key.

    A target the tables do not know gets the vendor's most conservative family
    (``FALLBACK_FAMILY``), never a neighbour's larger tiles; NVIDIA GPUs below sm80 and AMD GPUs
    other than CDNA (gfx9xx) are refused with a ValueError.
    """
    if target == "interpreter" or target in FAMILIES:
        return FAMILIES.get(target, target)
    if target.startswith("gfx9"):
        return FALLBACK_FAMILY["hip"]
    if target.startswith("gfx"):
        raise ValueError(
            f"target must be an AMD CDNA GPU (gfx9xx, with matrix cores) for the Triton kernels, got {target}")
    if not target.startswith("sm") or not target[2:].isdigit():
        raise ValueError(f"target must look like 'sm80', 'gfx942' or 'interpreter', got {target!r}")
    if int(target[2:]) < 80:
        raise ValueError(
            f"target must be sm80 or newer for the Triton kernels (tensor cores through mma), got {target}")
    return FALLBACK_FAMILY["cuda"]


def shared_memory_problem(target: str, available: int) -> Optional[str]:
    """Why ``target``'s configurations cannot run on a GPU offering ``available`` bytes of shared
    memory per block, or None when they fit."""
    family = arch_family(target)
    needed = FAMILY_SHARED_MEMORY.get(family)
    if needed is None or available >= needed:
        return None
    return (f"{target} offers {available} bytes of shared memory per block; flash_recipe's configurations for it "
            f"({family}) are sized for {needed}")


HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim a kernel is compiled for: the next power of two, at least 16."""
    bucket = 16
    while bucket < head_dim:
        bucket *= 2
    return bucket


def get_config(target: str, kernel: str, head_dim: int, element_size: int) -> Config:
    """Look up the launch configuration; ``head_dim`` may be unpadded (59 uses the 64 bucket)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    bucket = head_dim_bucket(head_dim)
    for max_bucket, max_size, config in _TABLE[(arch_family(target), kernel)]:
        if bucket <= max_bucket and element_size <= max_size:
            return config
    raise ValueError(
        f"no launch configuration for head dim {head_dim} with {element_size}-byte elements on {target}"
    )


# Launch configurations that replace the table's within a ``with overriding(...)`` block, by
# ``(kernel, head-dim bucket, element size)``: what ``flash-recipe tune`` times, and tests use.
_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("flash_recipe_config_overrides", default={})


@contextlib.contextmanager
def overriding(kernel: str, head_dim: int, element_size: int, config: Config) -> Iterator[None]:
    """Launches of ``kernel`` at ``head_dim``'s bucket and ``element_size`` use ``config`` inside the block
    (this thread or asyncio task only)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    token = _OVERRIDES.set({**_OVERRIDES.get(), (kernel, head_dim_bucket(head_dim), element_size): Config(*config)})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


# The tuned entries the launches of the running ``tuned_fallback`` call took, as ``(target, kernel,
# head-dim bucket, element size)`` (None outside one).
_TUNED_USED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("flash_recipe_tuned_used", default=None)


def tuned_taken() -> Optional[list]:
    """The tuned entries the running ``tuned_fallback`` call's launches took so far (None outside one)."""
    return _TUNED_USED.get()


def took_tuned(entries: tuple) -> None:
    """Record that a launch took these tuned entries (a memoized plan that ``launch_config`` chose
    them for), so that ``tuned_fallback`` can reject them if the launch fails."""
    if entries:
        used = _TUNED_USED.get()
        if used is not None:
            used.extend(entries)


def plan_state() -> Optional[int]:
    """What memoized launch plans are keyed by beside their signature: a count that changes whenever
    ``launch_config`` may answer differently (``tuned.GENERATION``: tuned entries read, forgotten
    or rejected; 0 while nothing imported the tuned cache), or None inside an ``overriding`` block
    (whose configurations are not memoized)."""
    if _OVERRIDES.get():
        return None
    tuned = sys.modules.get("flash_recipe.ops.tuned")  # not imported: nothing tuned was read
    return tuned.GENERATION[0] if tuned is not None else 0


def launch_config(device, kernel: str, head_dim: int, element_size: int) -> Config:
    """The configuration a launch on ``device`` uses: an ``overriding`` block's, else the one
    ``flash-recipe tune`` measured fastest on this GPU model (``flash_recipe.ops.tuned``: a GPU
    only, never the CPU or the interpreter, and not after it failed, see ``tuned_fallback``),
    else the table's for the device's target (``get_config``)."""
    bucket = head_dim_bucket(head_dim)
    override = _OVERRIDES.get().get((kernel, bucket, element_size))
    if override is not None:
        return override
    target = target_of(device)
    if target != "interpreter" and device.type == "cuda":
        from flash_recipe.ops import tuned

        found = tuned.config_for(device, target, kernel, bucket, element_size)
        if found is not None:
            used = _TUNED_USED.get()
            if used is not None:
                used.append((target, kernel, bucket, element_size))
            return Config(*found)
    return get_config(target, kernel, head_dim, element_size)


def one_pass_fits(device, head_dim: int) -> bool:
    """Whether the installed Triton compiles the one-pass backward's tile for ``device``'s target
    and head dim without spilling (``ONE_PASS_SINCE_TRITON``); where not, ``attention_backward``
    runs the three kernels."""
    since = ONE_PASS_SINCE_TRITON.get((arch_family(target_of(device)), head_dim_bucket(head_dim)))
    return since is None or triton_release() >= since


def _compile_or_launch_failure(exc: Exception) -> bool:
    """Whether ``exc`` is Triton failing to compile or launch a kernel (out of shared memory or
    registers, a compiler error, ptxas), which another configuration may not hit."""
    import triton.compiler.errors as compiler_errors
    import triton.runtime.errors as runtime_errors

    kinds = [getattr(runtime_errors, "OutOfResources", None), getattr(runtime_errors, "PTXASError", None),
             getattr(compiler_errors, "CompilationError", None)]
    return isinstance(exc, tuple(kind for kind in kinds if isinstance(kind, type))) or "ptxas" in str(exc)


def tuned_fallback(launcher: Callable[..., T]) -> Callable[..., T]:
    """Decorate a launcher (a function that allocates its outputs and launches kernels) so that a
    tuned configuration that fails to compile or launch falls back to the table's.

    When ``launcher`` raises a Triton compile or launch error after one of its launches took a
    tuned configuration, those tuned entries are rejected for the rest of the process, one
    ``TunedCacheWarning`` names them, and ``launcher`` runs again on the table's configurations.
    Any other error, or one without a tuned configuration, propagates unchanged.
    """

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        token = _TUNED_USED.set([])
        try:
            try:
                return launcher(*args, **kwargs)
            except Exception as exc:
                used = _TUNED_USED.get() or []
                if not used or not _compile_or_launch_failure(exc):
                    raise
                from flash_recipe.ops import tuned

                tuned.reject(used)

                entries = ", ".join(f"{kernel} at head dim {bucket} ({size}-byte elements) on {target}"
                                    for target, kernel, bucket, size in dict.fromkeys(used))
                first_line = (str(exc).strip().splitlines() or [""])[0][:200]
                warnings.warn(
                    f"flash_recipe: the tuned launch configuration for {entries} failed "
                    f"({type(exc).__name__}: {first_line}); the built-in configuration serves it from now on "
                    "in this process. Re-run `flash-recipe tune` on this GPU, or delete the file that "
                    "`flash-recipe tune --show` lists.",
                    tuned.TunedCacheWarning,
                    stacklevel=2,
                )
            return launcher(*args, **kwargs)
        finally:
            _TUNED_USED.reset(token)

    return run


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels through its CPU interpreter, read
    as the installed Triton reads it: from Triton 3.4 on, ``1``, ``true``, ``yes``, ``on`` or ``y``
    in any case; before 3.4, only ``1``. The one definition in flash_recipe."""
    value = os.environ.get("TRITON_INTERPRET", "")
    if triton_release() < (3, 4):
        return value == "1"
    return value.lower() in ("1", "true", "yes", "on", "y")


@functools.cache
def triton_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton, read from its metadata without importing it
    (the newest rules when no Triton distribution is found)."""
    from importlib import metadata

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
        import torch

        index = torch.cuda.current_device()
    return gpu_target(index)
