"""Which configuration and which backward a launch on a device runs, and the fall back when a
tuned configuration fails.

``launch_config(device, kernel, head_dim, element_size)`` answers, in order:

1. an ``overriding`` block's configuration (what ``flash-recipe tune`` times, and tests use);
2. on a GPU, the configuration ``flash-recipe tune`` measured fastest on this GPU model
   (``ops.tuned``), unless it failed in this process;
3. the table's for the device's compile target (``ops.configs.get_config`` with
   ``ops.targets.target_of``).

``tuned_fallback`` wraps a launcher so that a tuned configuration that fails to compile or launch
is dropped for the rest of the process and the launcher runs again on the table's, and so that a
warp-specialised forward that fails where the plain one runs falls back to the plain one (for its
target and head dim, for the rest of the process, with one warning). Launchers that
memoize a launch plan key it by ``plan_state()`` and report the tuned entries a reused plan took
with ``record_tuned``.

``backward_path(device, head_dim, element_size)`` answers which backward a launch runs unless it
is deterministic, in the same order: a ``taking_path`` block's, the path ``flash-recipe tune``
measured faster on this GPU model, the target's or its family's (``configs.BACKWARD_PATHS``, where the table's
one-pass tile must also compile cleanly with the installed Triton: ``one_pass_fits``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Iterator
from typing import Callable, Optional, TypeVar

from . import configs, features, targets, tuned
from .configs import KERNELS, ONE_LAUNCH, Config, head_dim_bucket
from .limits import BACKWARD_PATH_NAMES

T = TypeVar("T")

# Launch configurations that replace the table's within a ``with overriding(...)`` block, by
# ``(kernel, head-dim bucket, element size)``.
_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("flash_recipe_config_overrides", default={})

# The backward path that replaces the family's and the tuned one within a ``taking_path`` block.
_PATH: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("flash_recipe_backward_path", default=None)

# The tuned entries the launches of the running ``tuned_fallback`` call took, as ``(target, kernel,
# head-dim bucket, element size)`` (None outside one).
_TUNED_USED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("flash_recipe_tuned_used", default=None)


@contextlib.contextmanager
def overriding(kernel: str, head_dim: int, element_size: int, config: Config) -> Iterator[None]:
    """Launches of ``kernel`` at ``head_dim``'s bucket and ``element_size`` use ``config`` inside the block
    (this thread or asyncio task only)."""
    if kernel not in KERNELS + (ONE_LAUNCH,):
        raise ValueError(f"kernel must be one of {KERNELS + (ONE_LAUNCH,)}, got {kernel!r}")
    token = _OVERRIDES.set({**_OVERRIDES.get(), (kernel, head_dim_bucket(head_dim), element_size): Config(*config)})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


@contextlib.contextmanager
def taking_path(path: str) -> Iterator[None]:
    """Backward launches that are not deterministic take ``path`` (``"one_pass"``,
    ``"three_kernels"`` or ``"one_launch"``; the last where the table has its tiles, else the three
    kernels: ``backward_path``) inside the block (this thread or asyncio task only): what
    ``flash-recipe tune`` times, and tests use."""
    if path not in BACKWARD_PATH_NAMES:
        raise ValueError(f"path must be one of {BACKWARD_PATH_NAMES}, got {path!r}")
    token = _PATH.set(path)
    try:
        yield
    finally:
        _PATH.reset(token)


def tuned_recorded() -> Optional[list]:
    """The tuned entries the running ``tuned_fallback`` call's launches took so far (None outside one)."""
    return _TUNED_USED.get()


def record_tuned(entries: tuple) -> None:
    """Record that a launch took these tuned entries (a memoized plan that ``launch_config`` chose
    them for), so that ``tuned_fallback`` can reject them if the launch fails. Callers skip the
    call where a plan took none (one Python call less per launch)."""
    if entries:
        used = _TUNED_USED.get()
        if used is not None:
            used.extend(entries)


def plan_state() -> Optional[int]:
    """What memoized launch plans are keyed by beside their signature: a count that changes whenever
    ``launch_config`` may answer differently (``tuned.GENERATION``: tuned entries read, forgotten
    or rejected; 0 while nothing tuned was read) or the forward loses warp specialisation somewhere
    (``features.WARP_SPEC_GENERATION``; both only grow, so their sum never repeats), or None inside
    an ``overriding`` block (whose configurations are not memoized), or in a ``taking_path`` block."""
    if _OVERRIDES.get() or _PATH.get() is not None:
        return None
    return tuned.GENERATION[0] + features.WARP_SPEC_GENERATION[0]


def launch_config(device, kernel: str, head_dim: int, element_size: int) -> Config:
    """The configuration a launch on ``device`` uses: an ``overriding`` block's, else the one
    ``flash-recipe tune`` measured fastest on this GPU model (``flash_recipe.ops.tuned``: a GPU
    only, never the CPU or the interpreter, and not after it failed, see ``tuned_fallback``),
    else the table's for the device's target (``configs.get_config``)."""
    bucket = head_dim_bucket(head_dim)
    override = _OVERRIDES.get().get((kernel, bucket, element_size))
    if override is not None:
        return override
    target = targets.target_of(device)
    if target != "interpreter" and device.type == "cuda":
        found = tuned.config_for(device, target, kernel, bucket, element_size)
        if found is not None:
            used = _TUNED_USED.get()
            if used is not None:
                used.append((target, kernel, bucket, element_size))
            return Config(*found)
    return configs.get_config(target, kernel, head_dim, element_size)


def backward_path(device, head_dim: int, element_size: int) -> str:
    """The backward a launch on ``device`` runs unless it is deterministic: ``"one_pass"``,
    ``"three_kernels"`` or ``"one_launch"``. A ``taking_path`` block's, else the one ``flash-recipe
    tune`` measured fastest on this GPU model (``tuned.path_for``: a GPU only), else the target's
    (or its family's) default at the head dim's bucket (``configs.BACKWARD_PATHS``). Of the last
    two, one pass only where the installed Triton compiles that tile without spilling
    (``one_pass_fits``); of all three, one launch only where the table has its tiles
    (``configs.has_config``). Where not, the three kernels."""
    target = targets.target_of(device)
    path = _PATH.get()
    if path is None:
        bucket = head_dim_bucket(head_dim)
        if target != "interpreter" and device.type == "cuda":
            path = tuned.path_for(device, target, bucket, element_size)
        if path is None:
            path = configs.backward_path(target, bucket)
        if path == "one_pass" and not one_pass_fits(device, head_dim):
            return "three_kernels"
    if path == "one_launch" and not configs.has_config(target, ONE_LAUNCH, head_dim, element_size):
        return "three_kernels"
    return path


def one_pass_fits(device, head_dim: int) -> bool:
    """Whether the installed Triton compiles the one-pass backward's tile for ``device``'s target
    and head dim without spilling: a (family, head-dim bucket) outside ``configs.ONE_PASS_TRITON``
    does under every release, one in it under the releases it lists and any newer than all of them.
    Where not, ``attention_backward`` runs the three kernels. Reads the release from metadata."""
    return release_takes_one_pass(configs.arch_family(targets.target_of(device)), head_dim_bucket(head_dim))


def release_takes_one_pass(family: str, bucket: int) -> bool:
    """``one_pass_fits`` for a configuration family and head-dim bucket, under the installed Triton."""
    return configs.release_takes_one_pass(family, bucket, targets.triton_release())


def _compile_or_launch_failure(exc: Exception) -> bool:
    """Whether ``exc`` is Triton failing to compile or launch a kernel (out of shared memory or
    registers, a compiler error, ptxas), which another configuration may not hit."""
    # Imported once a launch has failed: this module loads without Triton (the tuner and the
    # lint environment import it before any kernel).
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

    A call whose forward launches were warp-specialised (``features.warp_specialization``) that
    raises anything runs again without warp specialisation; if that run succeeds, the failure was
    the specialised kernel's (a compile failure of any kind: Triton's pass pipeline, ptxas, out of
    resources), and ``features.reject_warp_specialization`` serves its target and head dim with the
    plain forward from then on, with one warning. If the plain run fails too, its error propagates
    and nothing is rejected.
    """

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        token = _TUNED_USED.set([])
        specialised: list = []  # what ``features.warp_specialization`` lets warp-specialise, in this call
        taking = features.WARP_SPEC_TAKEN.set(specialised)  # set and reset inline: no frames per call
        try:
            try:
                try:
                    return launcher(*args, **kwargs)
                finally:
                    features.WARP_SPEC_TAKEN.reset(taking)
            except Exception as exc:
                if specialised:
                    with features.using_warp_specialization(False):
                        result = run(*args, **kwargs)  # raises the plain forward's own failure
                    features.reject_warp_specialization(specialised, exc)
                    return result
                used = _TUNED_USED.get() or []
                if not used or not _compile_or_launch_failure(exc):
                    raise
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
