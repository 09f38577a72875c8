"""Run by ``tests/test_direct_launch.py`` in a process of its own, the interpreter off, on the stub
CUDA driver (``flash_recipe.tools.stub_driver``): what Triton's launcher receives from a plan's
launches through ``JITFunction.run`` and through the direct path (``flash_recipe.ops.direct``).

``python tests/direct_worker.py calls CASE...`` prints one JSON line per case comparing the two;
``python tests/direct_worker.py guards`` one line per planted change (a misaligned tensor, another
stream, a launch hook, a changed global) saying which way the launch went.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from triton.runtime import jit

from flash_recipe.ops import direct, launch
from flash_recipe.tools import host_cost, stub_driver

SCALE = tl.constexpr(2)


@triton.jit
def scale_kernel(X, Y, n, fold_batch, BLOCK: tl.constexpr, GRID_FOLD: tl.constexpr):
    """``Y = X * SCALE`` over ``n`` elements (``fold_batch`` and ``GRID_FOLD``: every planned
    kernel takes them, ``ops.launch``)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.load(X + offsets, mask=offsets < n) * SCALE, mask=offsets < n)


class Recorder:
    """Every call of the active launcher class (``launches``), of the own ``launch`` of each of
    ``launchers`` (``inner``: what the class's ``__call__`` passes it, or a direct launch at INNER),
    and every ``JITFunction.run``."""

    def __init__(self, *launchers):
        self.launchers = [launcher for launcher in launchers if launcher is not None]
        self.launches: list = []
        self.inner: list = []
        self.runs = 0

    def __enter__(self):
        cls = triton.runtime.driver.active.launcher_cls
        self.saved = cls.__call__, jit.JITFunction.run
        real_call, real_run = self.saved
        recorder = self

        def call(launcher, *args):
            recorder.launches.append(args)
            return real_call(launcher, *args)

        def run(fn, *args, **kwargs):
            recorder.runs += 1
            return real_run(fn, *args, **kwargs)

        cls.__call__, jit.JITFunction.run = call, run
        self.own = [vars(launcher).get("launch") for launcher in self.launchers]
        for launcher, own in zip(self.launchers, self.own):
            if own is not None:

                def launch(*values, own=own):
                    recorder.inner.append(values)
                    return own(*values)

                launcher.launch = launch
        return self

    def __exit__(self, *exc):
        cls = triton.runtime.driver.active.launcher_cls
        cls.__call__, jit.JITFunction.run = self.saved
        for launcher, own in zip(self.launchers, self.own):
            if own is not None:
                launcher.launch = own


def hooks_empty(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if hasattr(a, "base") and hasattr(a, "block_shape"):  # a tensor descriptor: its base and form
        return a.base is b.base and direct._descriptor_form(a) == direct._descriptor_form(b)
    return type(a) is type(b) and a == b


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype} at {value.data_ptr():#x}"
    return repr(value)[:200]


def compare(through_run: list, through_direct: list) -> list:
    """The differences between two lists of launcher calls (empty: none)."""
    problems = []
    if len(through_run) != len(through_direct):
        return [f"{len(through_run)} launches through JITFunction.run, {len(through_direct)} direct"]
    for i, (a, b) in enumerate(zip(through_run, through_direct)):
        if a[:6] != b[:6]:
            problems.append(f"launch {i}: grid, stream, function or metadata {a[:6]} != {b[:6]}")
        if not all(hooks_empty(h) for h in a[7:9]) or b[6:9] != (None, None, None):
            problems.append(f"launch {i}: hooks {a[7:9]} through run, {b[6:9]} direct")
        if len(a) != len(b):
            problems.append(f"launch {i}: {len(a) - 9} arguments through run, {len(b) - 9} direct")
        problems += [
            f"launch {i}: argument {j}: {describe(x)} != {describe(y)}"
            for j, (x, y) in enumerate(zip(a[9:], b[9:]))
            if not same_value(x, y)
        ]
    return problems


def compare_inner(run_outer: list, run_inner: list, direct_inner: list) -> list:
    """The differences between the launcher's own ``launch`` calls that ``JITFunction.run`` led to
    and those of a direct launch at INNER (empty: none): the same but the launch metadata and hooks
    that the launcher passes on, which ``JITFunction.run`` gives (the hooks empty) and a direct
    launch leaves None, found after the packed metadata the launcher was given (by identity)."""
    if not len(run_outer) == len(run_inner) == len(direct_inner):
        return [
            f"{len(run_outer)} launcher calls, {len(run_inner)} own launches through run, {len(direct_inner)} direct"
        ]
    problems = []
    for i, (outer, a, b) in enumerate(zip(run_outer, run_inner, direct_inner)):
        at = next((j for j in range(4, len(a) - 3) if all(a[j + n] is outer[5 + n] for n in range(4))), None)
        if at is None:
            problems.append(f"launch {i}: the launcher's metadata and hooks not passed to its launch")
            continue
        if not all(hooks_empty(h) for h in a[at + 2 : at + 4]) or b[at + 1 : at + 4] != (None, None, None):
            problems.append(f"launch {i}: hooks {a[at + 2 : at + 4]} through run, {b[at + 1 : at + 4]} direct")
        expected = a[: at + 1] + (None, None, None) + a[at + 4 :]
        if len(expected) != len(b):
            problems.append(f"launch {i}: {len(expected)} values through run, {len(b)} direct")
        for j, (x, y) in enumerate(zip(expected, b)):
            if type(x) is tuple and type(y) is tuple and len(x) == len(y) and j == len(b) - 1:  # packed arguments
                problems += [f"launch {i}: argument {n}: {describe(u)} != {describe(w)}"
                             for n, (u, w) in enumerate(zip(x, y)) if not same_value(u, w)]  # fmt: skip
            elif not same_value(x, y):
                problems.append(f"launch {i}: value {j}: {describe(x)} != {describe(y)}")
    return problems


def calls(cases: list) -> None:
    """For each case, each launch of a READY plan twice with the same tensors: through
    ``JITFunction.run`` (the direct path off), then directly; the two launcher calls compared."""
    cpu = torch.device("cpu")
    pairs: list = []
    learn = direct.DirectLaunch.launch

    def twice(self, kernel, grid, scalars, tensors):
        if self.state < direct.READY:
            return learn(self, kernel, grid, scalars, tensors)
        state = self.state
        direct.ENABLED = False
        try:
            with Recorder(self.launcher) as through_run:
                learn(self, kernel, grid, scalars, tensors)
        finally:
            direct.ENABLED = True
        with Recorder(self.launcher) as through_direct:
            learn(self, kernel, grid, scalars, tensors)
        pairs.append((through_run, through_direct, state))

    from flash_recipe.dispatch import use_backend

    direct.DirectLaunch.launch = twice
    for case in cases:
        ours, _ = host_cost.make_case(case, cpu, torch.float16, 64)
        with use_backend("triton"), host_cost.device_metadata(cpu):
            ours()  # compiles; the plans adopt their kernels
            ours()  # the plans record their launchers' arguments
            ours()  # each plan's first direct launch: the launcher's own call learnt (INNER), where it may be
            del pairs[:]
            ours()
        problems = []
        for a, b, state in pairs:
            if state == direct.INNER:
                problems += [f"at INNER, {len(b.launches)} launcher calls"] if b.launches else []
                problems += compare_inner(a.launches, a.inner, b.inner)
            else:
                problems += compare(a.launches, b.launches)
        row = dict(
            case=case,
            direct_launches=len(pairs),
            inner_launches=sum(state == direct.INNER for _, _, state in pairs),
            runs_through_run=sum(a.runs for a, _, _ in pairs),
            runs_direct=sum(b.runs for _, b, _ in pairs),
            problems=problems,
        )
        print(json.dumps(row), flush=True)
    direct.DirectLaunch.launch = learn


def guards() -> None:
    x = torch.randn(4096)
    y = torch.empty(4096)
    plan = launch.plan(scale_kernel, (4, 1, 1), dict(X=x, Y=y, n=4096, BLOCK=1024), torch.device("cpu"))

    def once(tensors: dict) -> tuple:
        """``(JITFunction.run calls, the last launcher call, or the last of its own launch)``."""
        with Recorder(plan.direct.launcher) as rec:
            launch.launch(plan, tensors)
        return rec.runs, (rec.launches or rec.inner)[-1]

    for _ in range(2):
        once(dict(X=x, Y=y))
    report = {"state": plan.direct.state, "plain": once(dict(X=x, Y=y))[0]}
    report["inner"] = plan.direct.state == direct.INNER  # the first direct launch learnt the launcher's own call
    runs, last = once(dict(X=x, Y=y))
    report["inner_runs"], report["inner_stream"] = runs, last[3]
    misaligned = torch.randn(4100)[1:4097]  # 4 bytes past a 16-byte boundary
    runs, last = once(dict(X=misaligned, Y=y))
    report["misaligned"] = runs
    report["misaligned_pointer"] = last[9] is misaligned
    active = triton.runtime.driver.active
    saved_stream = active.get_current_stream
    active.get_current_stream = {0: 7, None: 7}.get
    runs, last = once(dict(X=x, Y=y))
    report["stream"], report["stream_passed"] = runs, last[3]
    active.get_current_stream = saved_stream
    holder = direct._hook_holder()
    hook = holder.launch_enter_hook
    entered = []
    if hasattr(hook, "add"):  # a HookChain
        hook.add(entered.append)
        report["hook"] = once(dict(X=x, Y=y))[0]
        hook.remove(entered.append)
    else:
        holder.launch_enter_hook = entered.append
        report["hook"] = once(dict(X=x, Y=y))[0]
        holder.launch_enter_hook = hook
    report["hook_entered"] = len(entered)
    try:
        globals()["SCALE"] = tl.constexpr(3)
        report["global"] = once(dict(X=x, Y=y))[0]
    except RuntimeError as error:  # JITFunction.run refuses the changed global
        report["global"] = f"RuntimeError: {error}"[:80]
    finally:
        globals()["SCALE"] = tl.constexpr(2)
    report["back_to_direct"] = once(dict(X=x, Y=y))[0]
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    with host_cost.gpu_route("sm90"):
        stub_driver.launches()
        if sys.argv[1] == "guards":
            guards()
        else:
            calls(sys.argv[2:])
