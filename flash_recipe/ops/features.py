"""Compiler features the kernels use where the installed Triton and the GPU offer them, decided here.

- Tensor descriptors (TMA, ``cp.async.bulk.tensor``): the dense forward's unmasked key blocks load
  K and V through host-built ``TensorDescriptor`` objects on Hopper and Blackwell (``sm90``,
  ``sm100`` families) where the installed Triton ships ``triton.tools.tensor_descriptor`` (3.4 and
  newer do; found by looking for the module, not by the version number). A
  descriptor moves a whole tile with one instruction where pointers cost per-thread address
  arithmetic (on sm90 at head dim 128 the main loop drops from 557 to 518 instructions per 128 keys;
  ``python -m devtools.compile_check --target sm90 --call fwd``). Q and O are read and
  written once per program and stay on pointers (a descriptor-loaded Q is held in registers, where
  ptxas serialises the matrix instructions), as do the masked edge blocks and every other launch.

``FLASH_RECIPE_TMA=0`` (or ``false``, ``no``, ``off``) turns descriptors off (the pointer path
everywhere); ``using_descriptors`` forces the choice inside a block, which is how the tests run
the descriptor path under the CPU interpreter and the benchmark compares the two.

- Warp specialisation (``tl.range(..., warp_specialize=True)``): the dense forward's key loops
  split into partitions of warps (TMA loads, matrix products, softmax) that run side by side,
  on Blackwell (``WARP_SPEC_FAMILIES``) at ``WARP_SPEC_HEAD_DIMS``, for calls with tensor
  descriptors, fp16/bf16 and plain scores (no left window, softcap, ALiBi, dropout, sinks or
  packed GQA: ``warp_specialization``), where the installed Triton's ``tl.range`` takes
  ``warp_specialize`` (found in its signature, not from the version number) and its release is one
  whose compile of that forward the compile check passed (``WARP_SPEC_TRITON``, by family and
  head dim: Triton 3.6 fails at head dims 64 and 128). Off unless asked for:
  ``FLASH_RECIPE_WARP_SPEC=1``, or ``using_warp_specialization(True)`` inside a block. It has not
  run on a GPU (docs/performance.md, "Warp specialisation"); ``flash-recipe bench`` compares it
  (``flash_recipe_ws``). Asked for under a Triton without the keyword, a launch raises
  NotImplementedError. A warp-specialised launch that fails where the plain forward does not (a
  compile failure of any kind) falls back to the plain forward for that target and head dim for the
  rest of the process, with one ``WarpSpecializationWarning`` (``choose.tuned_fallback``,
  ``reject_warp_specialization``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import warnings
from collections.abc import Iterator
from typing import Optional

from ..environ import getenv
from . import configs, targets

# The module of host-side tensor descriptors, which Triton ships from 3.4 on.
DESCRIPTOR_MODULE = "triton.tools.tensor_descriptor"
DESCRIPTOR_FAMILIES = ("sm90", "sm100")

FORCED_DESCRIPTORS: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
    "flash_recipe_descriptors", default=None)


@functools.cache
def descriptors_available() -> bool:
    """Whether the installed Triton has host-side tensor descriptors (``DESCRIPTOR_MODULE``)."""
    try:
        return importlib.util.find_spec(DESCRIPTOR_MODULE) is not None
    except ImportError:  # no triton.tools at all
        return False


@contextlib.contextmanager
def using_descriptors(enabled: bool) -> Iterator[None]:
    """Inside the block, launches use tensor descriptors where the tensors allow (``True``) or never
    (``False``), whatever the target; this thread or asyncio task only."""
    if enabled and not descriptors_available():
        raise NotImplementedError(
            f"using_descriptors(True): the installed Triton ({'.'.join(map(str, targets.triton_release()))}) has "
            f"no {DESCRIPTOR_MODULE}; install Triton 3.4 or newer, or use using_descriptors(False)")
    token = FORCED_DESCRIPTORS.set(bool(enabled))
    try:
        yield
    finally:
        FORCED_DESCRIPTORS.reset(token)


def settings() -> tuple:
    """What this module's settings are now, as read (``using_descriptors``' and
    ``using_warp_specialization``'s choices, ``FLASH_RECIPE_TMA``'s and ``FLASH_RECIPE_WARP_SPEC``'s
    values), for keys: forward plans are keyed by it (``forward._plan_key``); ``requested`` and
    ``warp_specialization_requested`` say what they mean when a plan is made."""
    return (FORCED_DESCRIPTORS.get(), FORCED_WARP_SPEC.get(), getenv("FLASH_RECIPE_TMA", "1"),
            getenv(WARP_SPEC_ENV))


def requested() -> Optional[bool]:
    """What this thread asks of tensor descriptors: True or False inside ``using_descriptors``, False
    where ``FLASH_RECIPE_TMA`` turns them off, else None (the target decides)."""
    forced = FORCED_DESCRIPTORS.get()
    if forced is not None:
        return forced
    if getenv("FLASH_RECIPE_TMA", "1").lower() in ("0", "false", "no", "off"):
        return False
    return None


def descriptors_enabled(target: str) -> bool:
    """Whether launches for ``target`` (``"sm90"``, ``"interpreter"``) use tensor descriptors."""
    asked = requested()
    if asked is not None:
        return asked
    if target == "interpreter":
        return False
    return configs.arch_family(target) in DESCRIPTOR_FAMILIES and descriptors_available()


def descriptor_problem(t, block_rows: int) -> Optional[str]:
    """Why TMA cannot read ``t`` ``(B, S, H, D)`` (keys or values) as ``(B * S, H * D)`` rows in
    ``[block_rows, D]`` tiles, or None.

    The row view needs a 2-byte dtype, a 16-byte-aligned base, a contiguous last dim, heads side by
    side (head stride ``D``), batches one after another (batch stride ``S`` rows, or one batch), a
    row stride that is a multiple of 16 bytes, a head dim that is a power of two from 16 to 256 (a
    tile never reaches into the next head) and fewer than 2**31 rows (int32 coordinates).
    """
    if t.dim() != 4 or 0 in t.shape:
        return "needs a non-empty (B, S, H, D) tensor"
    batch, rows, heads, head_dim = t.shape
    stride_b, stride_s, stride_h, stride_d = t.stride()
    if t.element_size() != 2:
        return "needs fp16 or bf16"
    if t.data_ptr() % 16 or stride_s * 2 % 16:
        return "base address or row stride not a multiple of 16 bytes"
    if stride_d != 1 or stride_h != head_dim or (batch > 1 and stride_b != rows * stride_s):
        return "rows are not (B * S, H * D) with contiguous heads"
    if head_dim != configs.head_dim_bucket(head_dim) or block_rows > 256 or batch * rows >= 2**31:
        return "tile outside TMA's box limits"
    return None


def tma_views(k, v, block_rows: int):
    """Tensor descriptors of ``k`` and ``v`` ``(B, Sk, Hk, D)`` as ``(B * Sk, Hk * D)`` rows with
    ``[block_rows, D]`` tiles, or None where descriptors are off for the target (``descriptors_enabled``)
    or either tensor does not allow the view (``descriptor_problem``)."""
    if not descriptors_enabled(targets.target_of(k.device)):
        return None
    if descriptor_problem(k, block_rows) or descriptor_problem(v, block_rows):
        return None
    try:
        return descriptors(k, v, block_rows)
    except ImportError:  # a Triton whose release could not be read and has no descriptors
        return None


def descriptors(k, v, block_rows: int) -> tuple:
    """The tensor descriptors of ``tma_views`` for tensors it accepted, built (and validated) by
    Triton's ``TensorDescriptor``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor(k, [k.shape[0] * k.shape[1], k.shape[2] * k.shape[3]], [k.stride(1), 1],
                             [block_rows, k.shape[3]]),
            TensorDescriptor(v, [v.shape[0] * v.shape[1], v.shape[2] * v.shape[3]], [v.stride(1), 1],
                             [block_rows, v.shape[3]]))


def descriptor_form(views: tuple) -> tuple:
    """What a launch plan keeps of ``tma_views``' descriptors: each one's type and fields but its base
    (the plan keeps no tensor), for ``rebased``."""
    return tuple((type(view), {name: value for name, value in vars(view).items() if name != "base"})
                 for view in views)


def rebased(form: tuple, k, v) -> tuple:
    """The descriptors of ``form`` (``descriptor_form``) over this call's ``k`` and ``v``, which have
    the plan's signature (shapes, strides, dtype) and 16-byte-aligned bases (``forward._plan_key``
    keys plans by that): the fields that ``TensorDescriptor`` validated when the plan was made, with
    the new bases, without validating them again on every call."""
    (k_type, k_fields), (v_type, v_fields) = form
    k_view, v_view = object.__new__(k_type), object.__new__(v_type)
    vars(k_view).update(k_fields, base=k)
    vars(v_view).update(v_fields, base=v)
    return k_view, v_view


# Where the forward's warp-specialised loops compile cleanly (Triton 3.9, ``python -m
# devtools.compile_check --call fwd_ws``): sm100, causal or not, at head dims up to 128
# (at 256 the partitions spilled 440-544 bytes per thread). Hopper's partitioner
# takes 4 warps a loop and no second loop beside it, which the three-stage forward cannot offer
# without masking every block (docs/performance.md, "Warp specialisation").
WARP_SPEC_FAMILIES = ("sm100",)
WARP_SPEC_HEAD_DIMS = (16, 32, 64, 128)
# The Triton releases whose compile of the warp-specialised forward at (family, head-dim bucket)
# passes the compile check (``--call fwd_ws``: sm100, bf16, aligned, causal and not; run under
# 3.6.0, 3.7.1, 3.8.0 and 3.9.0); a release newer than the newest listed is taken to compile it
# too (where it does not, the launch falls back: ``choose.tuned_fallback``). 3.6 (torch 2.10 and
# 2.11's pin) fails at head dims 64 and 128 (``nvvm.setmaxregister``: a partition's register count
# outside 24-256, then ``PassManager::run failed``); 3.7 spills 8-40 B per thread at 16 to 64 and
# fails the same way at 128. Under any other release the forward runs unspecialised
# (``warp_specialization_triton_problem``).
_WARP_SPEC_CLEAN = ((3, 8), (3, 9))
WARP_SPEC_TRITON = {
    ("sm100", 16): ((3, 6), *_WARP_SPEC_CLEAN),
    ("sm100", 32): ((3, 6), *_WARP_SPEC_CLEAN),
    ("sm100", 64): _WARP_SPEC_CLEAN,
    ("sm100", 128): _WARP_SPEC_CLEAN,
}
# Pipeline stages of the specialised loops: with the table's 3 (sm100, 128x128 tiles at head dim
# 128) their buffers take 262716 B of shared memory, over the 232448 B an sm100 block has.
WARP_SPEC_STAGES = 2
WARP_SPEC_ENV = "FLASH_RECIPE_WARP_SPEC"

# ``using_warp_specialization``'s choice in this thread or task (None outside one).
FORCED_WARP_SPEC: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar(
    "flash_recipe_warp_spec", default=None)


@functools.cache
def warp_specialization_available() -> bool:
    """Whether the installed Triton's ``tl.range`` takes ``warp_specialize``."""
    import triton.language as tl

    try:
        return "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):  # a signature Python cannot read
        return False


def _no_warp_specialization(asked_by: str) -> NotImplementedError:
    release = ".".join(map(str, targets.triton_release()))
    return NotImplementedError(
        f"{asked_by}: the installed Triton ({release}) has no warp specialisation (tl.range takes no "
        f"warp_specialize); install a Triton whose tl.range has it (3.9 does), or leave it off")


@contextlib.contextmanager
def using_warp_specialization(enabled: bool) -> Iterator[None]:
    """Inside the block, warp specialisation is asked for (as ``FLASH_RECIPE_WARP_SPEC=1`` asks:
    the forward uses it where ``warp_specialization`` allows) or not at all; this thread or asyncio
    task only."""
    if enabled and not warp_specialization_available():
        raise _no_warp_specialization("using_warp_specialization(True)")
    token = FORCED_WARP_SPEC.set(bool(enabled))
    try:
        yield
    finally:
        FORCED_WARP_SPEC.reset(token)


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def warp_specialization_requested() -> Optional[bool]:
    """True or False inside ``using_warp_specialization``; else True where ``FLASH_RECIPE_WARP_SPEC``
    is ``1`` (``true``, ``yes``, ``on``), None where it is unset or off (``0``, ``false``, ``no``,
    ``off``). Forward plans are keyed by it (``forward._plan_key``). Any other value raises
    ValueError."""
    forced = FORCED_WARP_SPEC.get()
    if forced is not None:
        return forced
    value = getenv(WARP_SPEC_ENV).lower()
    if value in _ON:
        return True
    if value not in _OFF:
        raise ValueError(f"{WARP_SPEC_ENV} must be one of {_ON + _OFF[1:]} (or unset), got {value!r}; "
                         f"set {WARP_SPEC_ENV}=1 to ask for warp specialisation, or unset it")
    return None


def warp_specialization(target: str, head_dim: int, plain: bool) -> bool:
    """Whether a forward launch for ``target`` at ``head_dim`` warp-specialises its key loops:
    asked for (``warp_specialization_requested``), a call that allows it (``plain``: tensor
    descriptors, fp16/bf16, no left window, softcap, ALiBi, dropout, sinks or packed GQA), a
    target and head dim where it compiles cleanly (``WARP_SPEC_FAMILIES``, ``WARP_SPEC_HEAD_DIMS``;
    the interpreter runs it too, for the tests), a Triton release that compiles it there
    (``warp_specialization_triton_problem``) and no failed launch of it there in this process
    (``reject_warp_specialization``). Raises NotImplementedError where such a launch asks for it
    and the installed Triton's ``tl.range`` lacks ``warp_specialize``. A True answer is recorded
    for ``choose.tuned_fallback`` (``WARP_SPEC_TAKEN``)."""
    asked = warp_specialization_requested()
    if not asked or not plain or configs.head_dim_bucket(head_dim) not in WARP_SPEC_HEAD_DIMS:
        return False
    if not takes_warp_specialization(target):
        return False
    if not warp_specialization_available():
        raise _no_warp_specialization(f"{WARP_SPEC_ENV}=1")
    key = (target, configs.head_dim_bucket(head_dim))
    if key in _WARP_SPEC_FAILED or warp_specialization_triton_problem(target, head_dim):
        return False
    taken = WARP_SPEC_TAKEN.get()
    if taken is not None:
        taken.append(key)
    return True


def takes_warp_specialization(target: str) -> bool:
    """Whether ``target``'s family is one the warp-specialised forward compiles cleanly for
    (``WARP_SPEC_FAMILIES``); the interpreter runs it too, for the tests."""
    return target == "interpreter" or configs.arch_family(target) in WARP_SPEC_FAMILIES


def took_warp_specialization(pair: tuple) -> None:
    """Record that a reused forward plan warp-specialises at ``pair`` (target, head-dim bucket), as
    ``warp_specialization`` records a new one: its launch may compile again (a specialisation its
    plan key does not hold) and fail (``choose.tuned_fallback``)."""
    taken = WARP_SPEC_TAKEN.get()
    if taken is not None:
        taken.append(pair)


def warp_specialization_triton_problem(target: str, head_dim: int) -> Optional[str]:
    """Why the installed Triton does not compile the warp-specialised forward for ``target``
    (``"sm100"``) at ``head_dim``'s bucket cleanly, or None where it does: ``tl.range`` without
    ``warp_specialize``, or a release neither in ``WARP_SPEC_TRITON``'s list for the pair nor newer
    than all of it (or a pair outside it). None for the interpreter, which runs every release's
    warp-specialised loop. Reads the release from metadata (no compile)."""
    if target == "interpreter":
        return None
    release = targets.triton_release()
    if not warp_specialization_available():
        return f"Triton {release[0]}.{release[1]}'s tl.range takes no warp_specialize"
    family, bucket = configs.arch_family(target), configs.head_dim_bucket(head_dim)
    releases = WARP_SPEC_TRITON.get((family, bucket))
    if not releases:
        return f"no Triton release compiles it cleanly for {family} at head dim {bucket} (WARP_SPEC_TRITON)"
    if release in releases or release > max(releases):
        return None
    clean = ", ".join(f"{major}.{minor}" for major, minor in releases)
    return (f"Triton {release[0]}.{release[1]} is not one of the releases that compile it cleanly for {family} "
            f"at head dim {bucket}: {clean} and newer (WARP_SPEC_TRITON)")


class WarpSpecializationWarning(RuntimeWarning):
    """A warp-specialised forward failed where the plain one runs; the plain forward serves its
    target and head dim from then on in this process (``reject_warp_specialization``)."""


# (target, head-dim bucket) -> the failure of a warp-specialised launch there, in this process.
_WARP_SPEC_FAILED: dict[tuple[str, int], str] = {}
# The (target, head-dim bucket) pairs ``warp_specialization`` answered True for in the running
# ``choose.tuned_fallback`` call, which sets it (None outside one).
WARP_SPEC_TAKEN: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar(
    "flash_recipe_warp_spec_taken", default=None)


# Counts the changes to ``_WARP_SPEC_FAILED``: launch plans are keyed by it (``choose.plan_state``).
WARP_SPEC_GENERATION = [0]


def reject_warp_specialization(taken, exc: BaseException) -> None:
    """Serve ``taken``'s ``(target, head-dim bucket)`` pairs with the plain forward for the rest of
    the process: their warp-specialised launch failed with ``exc`` where the plain one ran. Warns
    once per pair (``WarpSpecializationWarning``, naming ``FLASH_RECIPE_WARP_SPEC`` and ``exc``)."""
    first_line = (str(exc).strip().splitlines() or [""])[0][:200]
    failure = f"{type(exc).__name__}: {first_line}"
    release = ".".join(map(str, targets.triton_release()))
    for target, bucket in dict.fromkeys(taken):
        if (target, bucket) in _WARP_SPEC_FAILED:
            continue
        _WARP_SPEC_FAILED[target, bucket] = failure
        WARP_SPEC_GENERATION[0] += 1
        warnings.warn(
            f"flash_recipe: the warp-specialised forward ({WARP_SPEC_ENV}=1 or using_warp_specialization(True)) "
            f"failed for {target} at head dim {bucket} under Triton {release} ({failure}); the plain forward "
            f"serves it from now on in this process. Unset {WARP_SPEC_ENV}, or install a Triton release that "
            "compiles it (docs/performance.md, \"Warp specialisation\").",
            WarpSpecializationWarning,
            stacklevel=3,
        )


def forget_warp_specialization_failures() -> None:
    """Forget the pairs ``reject_warp_specialization`` took warp specialisation from (tests, the
    compile check): the next launch there tries it again."""
    _WARP_SPEC_FAILED.clear()
    WARP_SPEC_GENERATION[0] += 1
