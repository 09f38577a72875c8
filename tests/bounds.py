"""Bounds checking of Triton kernels run by the interpreter (``TRITON_INTERPRET=1``).

Every load, store and atomic a kernel makes must stay inside the storage of one of the tensors
passed to that launch. ``BoundsChecker.install`` wraps the interpreter's memory operations and
its launcher (``triton.runtime.interpreter``):

- ``GridExecutor.__call__`` opens a launch (the kernel's name) and closes it when the grid is done;
- ``GridExecutor._init_args_hst`` gives the tensors the kernel actually addresses (for CPU tensors
  the interpreter uses their storage in place, for device tensors host copies); each one allows
  the bytes ``[storage.data_ptr(), storage.data_ptr() + storage.nbytes())`` of its whole
  untyped storage, so a view may reach the rest of its base tensor, never another allocation;
- ``InterpreterBuilder.create_load`` / ``create_store`` / ``create_masked_load`` /
  ``create_masked_store`` / ``create_atomic_rmw`` / ``create_atomic_cas`` (and the atomic load
  and store where the interpreter has them) receive numpy arrays of raw addresses and masks:
  every active address ``a`` (mask True) of an element of ``n`` bytes must satisfy
  ``start <= a`` and ``a + n <= end`` for one allowed range.

The check runs before the access, so a stray address raises ``OutOfBoundsAccess`` instead of
reading or corrupting memory. The interpreter wraps errors raised inside a kernel in its own
``InterpreterError``; the launch wrapper re-raises the ``OutOfBoundsAccess`` itself. Violations
are also recorded, so ``verify`` fails a test whose code swallowed the exception.

Beside the check, ``loaded`` counts the bytes every kernel loads from each launch argument (the
active addresses of each load, attributed to the argument whose storage holds them): the memory
traffic of a launch as the kernel's code asks for it, which the decode tests compare with the
least a kernel must read.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import numpy as np

# The memory operations of ``InterpreterBuilder``: name -> (what the error calls it, pointer
# parameter names, mask parameter name or None, required). A wrapped operation that calls
# another wrapped one (``create_load`` -> ``create_masked_load``) is checked once, by the outer.
_OPERATIONS = {
    "create_load": ("load", ("ptr", "ptrs"), None, True),
    "create_store": ("store", ("ptr", "ptrs"), None, True),
    "create_masked_load": ("load", ("ptrs", "ptr"), "mask", True),
    "create_masked_store": ("store", ("ptrs", "ptr"), "mask", True),
    "create_atomic_rmw": ("atomic_rmw", ("ptr", "ptrs"), "mask", True),
    "create_atomic_cas": ("atomic_cas", ("ptr", "ptrs"), None, True),
    "create_atomic_load": ("atomic_load", ("ptr", "ptrs"), "mask", False),
    "create_atomic_store": ("atomic_store", ("ptr", "ptrs"), "mask", False),
}


class OutOfBoundsAccess(AssertionError):
    """A kernel addressed memory outside every tensor passed to its launch."""


class HooksUnavailable(RuntimeError):
    """The interpreter's internals are not the ones the checker wraps (a different Triton)."""


@dataclasses.dataclass(frozen=True)
class Region:
    """The bytes ``[start, end)`` of the storage of the launch argument ``name``."""

    name: str
    start: int
    end: int

    def distance(self, address: int, size: int) -> tuple[int, str]:
        """How far the access ``[address, address + size)`` lies outside this region, and where."""
        if address < self.start:
            return self.start - address, f"the access starts {self.start - address} bytes before it"
        return address + size - self.end, f"the access ends {address + size - self.end} bytes past it"

    def __str__(self) -> str:
        return f"{self.name} [{self.start:#x}, {self.end:#x}) ({self.end - self.start} bytes)"


@dataclasses.dataclass
class Launch:
    """One kernel launch: its name and, once the interpreter has its arguments, their regions."""

    kernel: str
    regions: list | None = None
    starts: np.ndarray | None = None  # merged, sorted, non-overlapping allowed ranges
    ends: np.ndarray | None = None

    def allow(self, regions: list) -> None:
        """Set the launch's regions and the merged ranges the check searches."""
        self.regions = regions
        merged: list[list[int]] = []
        for region in sorted(regions, key=lambda r: r.start):
            if merged and region.start < merged[-1][1]:  # overlapping storages (views of one tensor)
                merged[-1][1] = max(merged[-1][1], region.end)
            else:
                merged.append([region.start, region.end])
        self.starts = np.array([m[0] for m in merged], dtype=np.uint64)
        self.ends = np.array([m[1] for m in merged], dtype=np.uint64)


def _tensors(name: str, value: Any):
    """``(name, tensor)`` for every tensor in a launch argument (tuples and descriptors opened)."""
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)
        return
    base = getattr(value, "base", None)  # triton's TensorWrapper and TensorDescriptor hold a tensor
    if base is not None and hasattr(base, "untyped_storage") and not hasattr(value, "untyped_storage"):
        value = base
    if hasattr(value, "untyped_storage"):
        yield name, value


def _regions(arg_names: list, args: list, kwargs: dict) -> list:
    """The storage regions of the tensors among a launch's host arguments."""
    named = list(zip(arg_names, args)) + list(kwargs.items())
    regions = []
    for name, value in named:
        for label, tensor in _tensors(name, value):
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                regions.append(Region(label, storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return regions


def _element_bytes(ptr) -> int:
    """Bytes of one element behind the pointer handle ``ptr``, as the interpreter's ``create_addptr`` counts them."""
    element = ptr.get_element_ty() if hasattr(ptr, "get_element_ty") else ptr.dtype.element_ty
    return max(1, element.primitive_bitwidth // 8)


def _parameter_index(fn: Callable, names: tuple) -> tuple[int, str]:
    """Position (after ``self``) and name of the first of ``names`` among ``fn``'s parameters."""
    params = list(inspect.signature(fn).parameters)[1:]
    for name in names:
        if name in params:
            return params.index(name), name
    raise HooksUnavailable(f"{fn.__qualname__}{inspect.signature(fn)} has none of the parameters {names}")


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if index < len(args) else kwargs.get(name)


class BoundsChecker:
    """Checks every memory access of interpreted kernel launches against the launch's tensors.

    ``launches`` and ``accesses`` count launches and checked memory operations; ``violations``
    holds the message of every out-of-bounds access seen (each also raised); ``loaded`` maps
    ``(kernel name, argument name)`` to the bytes loaded from that argument's storage.
    """

    def __init__(self) -> None:
        self.launches = 0
        self.accesses = 0
        self.violations: list[str] = []
        self.loaded: dict[tuple[str, str], int] = {}
        self._stack: list[Launch] = []
        self._depth = 0  # nesting of wrapped memory operations: only the outermost checks

    # -- installation ------------------------------------------------------------------------

    def install(self, monkeypatch) -> None:
        """Wrap the interpreter's launcher and memory operations with ``monkeypatch`` (undone by it).

        Raises ``HooksUnavailable`` when Triton's interpreter does not have the methods wrapped
        here; nothing is patched then.
        """
        try:
            from triton.runtime import interpreter
        except ImportError as exc:
            raise HooksUnavailable(f"triton.runtime.interpreter cannot be imported: {exc}") from exc
        builder = getattr(interpreter, "InterpreterBuilder", None)
        executor = getattr(interpreter, "GridExecutor", None)
        if builder is None or executor is None:
            raise HooksUnavailable("triton.runtime.interpreter has no InterpreterBuilder or GridExecutor")
        for cls, name in ((executor, "__call__"), (executor, "_init_args_hst")):
            if not callable(cls.__dict__.get(name)):
                raise HooksUnavailable(f"triton.runtime.interpreter.{cls.__name__}.{name} is missing")
        wrappers = {}
        for name, (kind, ptr_names, mask_name, required) in _OPERATIONS.items():
            original = builder.__dict__.get(name)
            if original is None:
                if required:
                    raise HooksUnavailable(f"triton.runtime.interpreter.InterpreterBuilder.{name} is missing")
                continue
            ptr_at = _parameter_index(original, ptr_names)
            mask_at = _parameter_index(original, (mask_name,)) if mask_name else None
            wrappers[name] = self._wrap_operation(original, kind, ptr_at, mask_at)
        launch_wrapper = self._wrap_launch(executor.__dict__["__call__"])
        args_wrapper = self._wrap_init_args(executor.__dict__["_init_args_hst"])
        for name, wrapper in wrappers.items():
            monkeypatch.setattr(builder, name, wrapper)
        monkeypatch.setattr(executor, "__call__", launch_wrapper)
        monkeypatch.setattr(executor, "_init_args_hst", args_wrapper)

    def _wrap_launch(self, original: Callable) -> Callable:
        checker = self

        def launch(executor, *args, **kwargs):
            fn = getattr(executor, "fn", None)
            checker._stack.append(Launch(getattr(fn, "__name__", repr(fn))))
            checker.launches += 1
            try:
                return original(executor, *args, **kwargs)
            except Exception as exc:
                cause = _out_of_bounds_in(exc)
                if cause is None or cause is exc:
                    raise
                raise cause from None  # the interpreter's InterpreterError only repeats it
            finally:
                checker._stack.pop()

        return launch

    def _wrap_init_args(self, original: Callable) -> Callable:
        checker = self

        def init_args_hst(executor, *args, **kwargs):
            args_hst, kwargs_hst = original(executor, *args, **kwargs)
            if checker._stack:
                checker._stack[-1].allow(_regions(list(executor.arg_names), list(args_hst), dict(kwargs_hst)))
            return args_hst, kwargs_hst

        return init_args_hst

    def _wrap_operation(self, original: Callable, kind: str, ptr_at: tuple, mask_at: tuple | None) -> Callable:
        checker = self

        def operation(builder, *args, **kwargs):
            if checker._depth == 0:
                ptr = _argument(args, kwargs, *ptr_at)
                mask = _argument(args, kwargs, *mask_at) if mask_at is not None else None
                checker.check(kind, ptr, mask, builder)
            checker._depth += 1
            try:
                return original(builder, *args, **kwargs)
            finally:
                checker._depth -= 1

        operation.__name__ = original.__name__
        operation.__qualname__ = original.__qualname__
        return operation

    # -- the check ---------------------------------------------------------------------------

    def check(self, kind: str, ptr, mask, builder=None) -> None:
        """Raise ``OutOfBoundsAccess`` if an active address of ``ptr`` (a pointer ``TensorHandle``)
        lies outside the current launch's regions; ``mask`` (a boolean handle or None) selects the
        active ones."""
        self.accesses += 1
        if not self._stack or self._stack[-1].starts is None:
            where = f"in kernel {self._stack[-1].kernel}" if self._stack else "outside any kernel launch"
            self._fail(
                f"{kind} {where} before the launch's tensor arguments were recorded: "
                "triton.runtime.interpreter no longer matches the bounds checker"
            )
        launch = self._stack[-1]
        addresses = np.asarray(ptr.data)
        if addresses.dtype != np.uint64:
            addresses = addresses.astype(np.uint64)
        if mask is not None:
            active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
            addresses = addresses[active]
        else:
            addresses = addresses.reshape(-1)
        if addresses.size == 0:
            return
        size = _element_bytes(ptr)
        index = np.searchsorted(launch.starts, addresses, side="right").astype(np.int64) - 1
        inside = index >= 0
        ends = launch.ends[np.maximum(index, 0)]
        # ``a <= end - size``, not ``a + size <= end``: an address near 2**64 must not wrap around.
        inside &= addresses <= ends - np.uint64(size)
        if inside.all():
            if kind == "load":
                self._count(launch, addresses, size)
            return
        bad = addresses[~inside]
        self._fail(self._describe(kind, launch, int(bad[0]), size, bad.size, addresses.size, builder))

    def _count(self, launch: Launch, addresses: np.ndarray, size: int) -> None:
        """Add the bytes of ``addresses`` to the argument whose storage holds each (the first
        listed, where views of one storage overlap)."""
        left = np.ones(addresses.shape, dtype=bool)
        for region in launch.regions or ():
            hit = left & (addresses >= np.uint64(region.start)) & (addresses < np.uint64(region.end))
            n = int(hit.sum())
            if n:
                key = (launch.kernel, region.name)
                self.loaded[key] = self.loaded.get(key, 0) + n * size
                left &= ~hit

    def _describe(self, kind, launch: Launch, address: int, size: int, n_bad: int, n_active: int, builder) -> str:
        program = getattr(builder, "grid_idx", None)
        where = f"kernel {launch.kernel}" + (f", program {tuple(int(i) for i in program)}" if program else "")
        text = (
            f"out-of-bounds {kind} in {where}: address {address:#x} ({size} bytes) lies outside every tensor "
            f"passed to the launch ({n_bad} of {n_active} active addresses)"
        )
        if launch.regions:
            nearest = min(launch.regions, key=lambda r: r.distance(address, size)[0])
            text += f"; nearest: {nearest}, {nearest.distance(address, size)[1]}"
        else:
            text += "; the launch has no tensor arguments"
        return text

    def _fail(self, message: str) -> None:
        self.violations.append(message)
        raise OutOfBoundsAccess(message)

    # -- results -----------------------------------------------------------------------------

    def take_violations(self) -> list[str]:
        """The violations seen so far, forgotten by the checker (for tests that provoke them)."""
        taken, self.violations = self.violations, []
        return taken

    def verify(self) -> None:
        """Raise ``OutOfBoundsAccess`` if a violation was seen (even one the caller swallowed), and
        ``HooksUnavailable`` if kernels ran but no memory access reached the hooks."""
        if self.violations:
            raise OutOfBoundsAccess(f"{len(self.violations)} out-of-bounds access(es); the first: {self.violations[0]}")
        if self.launches and not self.accesses:
            raise HooksUnavailable(
                f"{self.launches} kernel launch(es) made no memory access the checker saw: "
                "triton.runtime.interpreter no longer routes accesses through the wrapped methods"
            )


def _out_of_bounds_in(exc: BaseException) -> OutOfBoundsAccess | None:
    """The ``OutOfBoundsAccess`` that ``exc`` is or was raised from, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OutOfBoundsAccess):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
