"""Direct launches: a plan's later launches handed straight to the compiled kernel's launcher.

Triton's ``JITFunction.run`` does, at every launch, what a plan has already fixed: it binds some
75 keyword arguments, specialises each (a divisibility check per integer and per pointer), builds
the cache key and looks the compiled kernel up, then calls that kernel's launcher with the grid,
the stream, the kernel's handles and the argument values. A ``DirectLaunch`` (one per plan,
``launch.Plan.direct``) learns that last call and repeats it:

1. the plan's first launch goes through ``JITFunction.run`` (compiling where needed) and returns
   the compiled kernel;
2. the second goes through ``JITFunction.run`` too, with the launcher wrapped for that one call:
   the arguments it receives are recorded, and each is tied to the parameter it came from (the
   kernel's parameters in order, or its non-constexpr ones, as the Triton release passes them;
   every tensor by identity). Anything not accounted for turns the direct path off for the plan;
3. the third calls the launcher with the recorded values, this call's tensors in their places and
   this call's stream; the launch metadata and the hooks are None, which is what a launch with no
   hook registered means (``JITFunction.run`` passes Triton's empty hook chains and, on 3.5 and
   newer, a metadata dict nobody reads). Where the launcher is Triton's ``CudaLauncher`` of a
   release whose ``__call__`` was read (``INNER_RELEASES``) and the kernel needs no scratch
   memory, the launcher's own ``launch`` (the C launcher, or the wrapper that expands tensor
   descriptors) is wrapped for that call and what it receives is recorded too;
4. from the fourth on, at INNER, that own ``launch`` is called as the launcher would have called
   it, with this call's stream and tensors (a scratch allocation that allocates nothing and the
   frames around it left out); else the launcher, as the third was.

What Triton specialises on and a later call of the same plan can change is guarded: each
tensor's 16-byte alignment (the pointers' ``tt.divisibility``) and its being there (not None);
each tensor descriptor's type, block shape, shape, strides and padding (a plan's descriptors share
their field objects, ``features.rebased``: the same objects as those learnt pass at once, others
are compared). The stream is the active driver's, found as ``driver._active`` where Triton keeps it
there (3.4 on), else through ``driver.active``. Sizes, strides, dtypes and options are the plan's
own (``flash_recipe.memo_keys``). Where a guard fails, where a launch hook is set
(``knobs.runtime.launch_enter_hook`` or, on Triton 3.2 and 3.3,
``CompiledKernel.launch_enter_hook``; profilers such as proton set one), or where the kernel has
pre-run hooks, or a global value it read when compiled has changed, the launch goes through
``JITFunction.run``.
``tests/test_direct_launch.py`` compares, for the kernels CI's calls launch, what the launcher
(or at INNER its own ``launch``) receives each way (on the stub driver, ``tools.stub_driver``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from triton.runtime.driver import driver

from . import targets

# False: every launch through JITFunction.run (the equivalence test's reference).
ENABLED = True

# READY: the launcher is called; INNER: the launcher's own ``launch``, which it would have called.
NEW, RECORD, READY, INNER, OFF = 0, 1, 2, 3, -1
_MISSING = object()
# The Triton releases, first and last, whose ``CudaLauncher.__call__`` does per launch only what
# ``_inner_launchable`` rules out (allocate a kernel's global or profile scratch, run GSan, 3.8 on)
# before it hands its arguments to its ``launch`` (the C launcher, or the wrapper that expands
# tensor descriptors): read in each release's source.
INNER_RELEASES = ((3, 2), (3, 9))
# One recording at a time: a recording swaps a compiled kernel's launcher for the one launch, which
# another thread's launch of the same kernel must neither see nor undo.
_RECORDING = threading.Lock()
_HEADER = 9  # grid x, y, z, stream, function, packed metadata, launch metadata, enter and exit hooks


def _hook_holder() -> Any:
    """Where the installed Triton keeps its launch hooks: ``knobs.runtime`` (3.4 on), else
    ``CompiledKernel`` (3.2, 3.3)."""
    try:
        from triton import knobs

        return knobs.runtime
    except ImportError:
        from triton.compiler.compiler import CompiledKernel

        return CompiledKernel


_HOOKS: Any = None


def hooks_set() -> bool:
    """Whether a launch hook is registered (``launch_enter_hook`` or ``launch_exit_hook``: a function,
    or on Triton 3.5 and newer a ``HookChain`` with calls in it)."""
    global _HOOKS
    if _HOOKS is None:
        _HOOKS = _hook_holder()
    return _registered(_HOOKS.launch_enter_hook) or _registered(_HOOKS.launch_exit_hook)


def _registered(hook: Any) -> bool:
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _descriptor_form(desc: Any) -> tuple:
    """What a tensor descriptor's compiled code and launch depend on besides its base (whose 16-byte
    alignment its constructor asserts): block shape, shape, strides and padding (``launch`` checks
    the same, written out, for a launch's descriptors against the one learnt)."""
    return tuple(desc.block_shape), tuple(desc.shape), tuple(desc.strides), getattr(desc, "padding", None)


def _launcher_slot(compiled: Any) -> str:
    """The attribute holding ``compiled``'s launcher: ``_run`` (Triton 3.4 on), else ``run``."""
    return "_run" if "_run" in vars(compiled) else "run"


class DirectLaunch:
    """One plan's direct launch: ``state`` NEW, RECORD (the next launch records), READY (the
    launcher is called), INNER (its own ``launch`` is) or OFF."""

    __slots__ = ("state", "compiled", "launcher", "header", "template", "slots", "descriptors", "device", "globals",
                 "deeper", "rest", "packed")

    def __init__(self) -> None:
        self.state = NEW
        self.compiled: Any = None
        self.launcher: Any = None
        self.header: tuple = ()
        self.template: list = []
        self.slots: tuple = ()  # (position, name, 16-byte aligned) of each tensor
        # (position, name, type, block shape, shape, strides, padding) of each tensor descriptor: the
        # field objects of the one learnt (a plan's descriptors share them, ``features.rebased``)
        self.descriptors: tuple = ()
        self.device: Any = None
        # (name, value at compile time, the object the module held when learnt, the module's globals)
        self.globals: tuple = ()
        self.deeper = False  # READY, and the next direct launch learns the launcher's own call
        # INNER: what the launcher passes its ``launch`` after grid and stream, and whether it passes
        # the kernel's arguments as one tuple (3.7 on) or one by one
        self.rest: tuple = ()
        self.packed = False

    def launch(self, kernel: Any, grid: tuple, scalars: dict, tensors: dict) -> None:
        """Launch ``kernel`` (a JIT function) on ``grid`` with ``scalars`` and ``tensors``: directly
        when READY and the guards hold, else through ``kernel.run``, learning on the way. The
        guards are written out here, not called: each call's frames are the host cost measured;
        the first that fails sends the launch through ``kernel.run``."""
        if self.state >= READY and ENABLED:
            enter, leave = _HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook  # a HookChain holds its calls
            ready = not (enter is not None and getattr(enter, "calls", enter)) and not (
                leave is not None and getattr(leave, "calls", leave)
            )
            for name, value, held, scope in self.globals:  # JITFunction.run says which changed, and how
                now = scope.get(name, _MISSING)
                ready = ready and (now is held or now == value)  # the object held then: no constexpr __eq__
            args = self.template.copy()
            for position, name, aligned in self.slots:  # a tensor: there, and aligned as when learnt
                found: Any = tensors.get(name)
                if found is None or (found.data_ptr() % 16 == 0) is not aligned:
                    ready = False
                    break
                args[position] = found
            for position, name, kind, block, shape, strides, padding in self.descriptors:
                found = tensors.get(name)
                # Its type and form as when learnt: the same field objects (a plan's), else equal ones.
                if type(found) is not kind or getattr(found, "padding", None) != padding or not (
                    (found.block_shape is block and found.shape is shape and found.strides is strides)
                    or (tuple(found.block_shape), tuple(found.shape), tuple(found.strides))
                    == (tuple(block), tuple(shape), tuple(strides))
                ):
                    ready = False
                    break
                args[position] = found
            if ready:
                x, y, z, _, function, metadata, _, _, _ = self.header
                # The active driver where Triton keeps it (3.4 on; no property's frame), else as it says.
                active = getattr(driver, "_active", None) or driver.active
                stream = active.get_current_stream(self.device)
                if self.state == INNER:  # what the launcher would pass its ``launch``, this call's stream and tensors
                    if self.packed:
                        self.launcher.launch(x, y, z, stream, *self.rest, tuple(args))
                    else:
                        self.launcher.launch(x, y, z, stream, *self.rest, *args)
                elif self.deeper:
                    self._learn_inner(x, y, z, stream, function, metadata, args)
                else:
                    self.launcher(x, y, z, stream, function, metadata, None, None, None, *args)
                return
        if self.state == RECORD and ENABLED:
            self._record(kernel, grid, scalars, tensors)
            return
        compiled = kernel.run(grid=grid, warmup=False, **scalars, **tensors)
        if self.state == NEW:
            self._adopt(kernel, compiled)

    def _adopt(self, kernel: Any, compiled: Any) -> None:
        from triton.compiler.compiler import CompiledKernel

        plain = "run" not in vars(kernel)  # a stand-in's run (the compile check's, a recorder) is never learnt
        if ENABLED and plain and not getattr(kernel, "pre_run_hooks", None) and isinstance(compiled, CompiledKernel):
            self.compiled, self.state = compiled, RECORD
            # The global values the kernel read at compile time, which JITFunction.run checks are unchanged.
            used = getattr(kernel, "used_global_vals", {})
            # Triton keeps a copy of each value: the object the module holds now, equal to it, stands
            # for it (identity is checked first), until the module's name is bound to another.
            learnt = []
            for (name, _), (value, scope) in used.items():
                now = scope.get(name, _MISSING)
                learnt.append((name, value, now if now == value else _MISSING, scope))
            self.globals = tuple(learnt)
        else:
            self.state = OFF

    def _record(self, kernel: Any, grid: tuple, scalars: dict, tensors: dict) -> None:
        with _RECORDING:
            if self.state != RECORD:  # another thread recorded this plan meanwhile
                kernel.run(grid=grid, warmup=False, **scalars, **tensors)
                return
            compiled, slot = self.compiled, _launcher_slot(self.compiled)
            launcher = getattr(compiled, slot)
            calls, returned = _recorded(compiled, slot, lambda: kernel.run(grid=grid, warmup=False, **scalars,
                                                                           **tensors))
            self.state = OFF
            if returned is compiled and len(calls) == 1 and not hooks_set():
                self._learn(kernel, launcher, grid, calls[0], tensors)

    def _learn(self, kernel: Any, launcher: Any, grid: tuple, call: tuple, tensors: dict) -> None:
        """READY with ``call``'s values as the template, if every value is accounted for."""
        header, values = call[:_HEADER], list(call[_HEADER:])
        if tuple(header[:3]) != tuple(grid) + (1,) * (3 - len(grid)):
            return
        params = getattr(kernel, "params", ())
        orders = ([p.name for p in params], [p.name for p in params if not p.is_constexpr])
        names = next((order for order in orders if len(order) == len(values)), None)
        if names is None:
            return
        slots: list[tuple] = []
        descriptors: list[tuple] = []
        for position, (name, value) in enumerate(zip(names, values)):
            if name in tensors:
                found = tensors[name]
                if value is not found:
                    return
                if isinstance(found, torch.Tensor):
                    slots.append((position, name, found.data_ptr() % 16 == 0))
                elif isinstance(getattr(found, "base", None), torch.Tensor) and hasattr(found, "block_shape"):
                    descriptors.append((position, name, type(found), found.block_shape, found.shape, found.strides,
                                        getattr(found, "padding", None)))
                else:
                    return
                values[position] = None
            elif isinstance(value, torch.Tensor) or hasattr(value, "base"):
                return
        if len(slots) + len(descriptors) != len(tensors):
            return
        self.launcher, self.header, self.template = launcher, header, values
        self.slots, self.descriptors = tuple(slots), tuple(descriptors)
        self.device = driver.active.get_current_device()
        hooks_set()  # resolves ``_HOOKS``, which ``launch`` reads
        self.deeper = _inner_launchable(launcher)
        self.state = READY

    def _learn_inner(self, x: int, y: int, z: int, stream: Any, function: Any, metadata: Any, args: list) -> None:
        """Launch through the launcher, its own ``launch`` wrapped for the one call, and go INNER if
        that call held this launch's grid and stream first, then values fixed for the plan, then
        this launch's arguments (the same objects) one by one or as one tuple."""
        launcher = self.launcher
        with _RECORDING:
            calls, _ = _recorded(launcher, "launch",
                                 lambda: launcher(x, y, z, stream, function, metadata, None, None, None, *args))
        self.deeper = False
        if len(calls) != 1 or len(calls[0]) < 5 or calls[0][:4] != (x, y, z, stream):
            return
        call, count = calls[0], len(args)
        tail = call[len(call) - count:]
        if len(call) >= 4 + count and all(a is b for a, b in zip(tail, args)):
            self.rest, self.packed = call[4:len(call) - count], False
        elif type(call[-1]) is tuple and len(call[-1]) == count and all(a is b for a, b in zip(call[-1], args)):
            self.rest, self.packed = call[4:-1], True
        else:
            return
        self.state = INNER


def _recorded(holder: Any, name: str, launch: Callable[[], Any]) -> tuple[list, Any]:
    """``(the calls holder.<name> received, what launch() returned)``: ``launch()`` run with that
    attribute wrapped to record its arguments, and put back after (callers hold ``_RECORDING``)."""
    own, calls = getattr(holder, name), []

    def recording(*values):
        calls.append(values)
        return own(*values)

    setattr(holder, name, recording)
    try:
        returned = launch()
    finally:
        setattr(holder, name, own)
    return calls, returned


def _inner_launchable(launcher: Any) -> bool:
    """Whether a direct launch may call ``launcher``'s own ``launch`` in its place: Triton's
    ``CudaLauncher`` under a release of ``INNER_RELEASES``, whose kernel has no global or profile
    scratch (which ``__call__`` allocates per launch) and runs without GSan."""
    from triton.backends.nvidia.driver import CudaLauncher  # the NVIDIA backend's, read where a plan learns

    first, last = INNER_RELEASES
    return (
        type(launcher) is CudaLauncher
        and first <= targets.triton_release() <= last
        and callable(vars(launcher).get("launch"))
        and getattr(launcher, "global_scratch_size", 0) == 0
        and getattr(launcher, "profile_scratch_size", 0) == 0
        and not getattr(launcher, "gsan_enabled", False)
    )
