"""Every kernel launch runs on its tensors' device: ``flash_recipe.ops.launch.launch`` makes the
plan's CUDA device current for the launch where it is not (Triton launches on the current device
and stream), and every kernel family reaches it, the 8-bit path's quantizer and kernel included.

What is stubbed, and why (this machine has no GPU, and the guard needs two devices to show):

- the driver side of the guard: ``torch.cuda.current_device`` answers 0, and ``torch.cuda.device``
  is a context manager that records the device index it is entered for;
- Triton's launch (``JITFunction.run`` and the interpreter's ``InterpretedFunction.run``), which
  records the device the recorded guard holds current when it is called, and runs nothing;
- each plan's device index: CPU tensors plan for no CUDA device (``Plan.device`` None), so a
  pass-through wrapper of ``launch.launch``, set in every module that calls it, hands the real
  ``launch.launch`` the launcher's own plan with its index set to 1 (not current) or 0 (current).
  The wrapper also records which kernels reach ``launch.launch``.

Everything else is the package's own code: the launchers, ``plan``, ``launch_once`` and the
guard's decision in ``launch.launch``.
"""

from __future__ import annotations

import pytest
import torch
from test_grid_limits import FAMILIES

from flash_recipe import memo_keys
from flash_recipe.ops import backward_launch, dropout, forward, int8_attention, kvcache, launch, quantize, split_merge

MODULES = (launch, forward, split_merge, backward_launch, kvcache, int8_attention, quantize, dropout)


@pytest.fixture
def driver(monkeypatch):
    """The stubbed driver: yields ``(entered, runs)``, the device indices the guard was entered for
    and ``(kernel, device current at its launch or None)`` per launch."""
    from triton.runtime import interpreter, jit

    entered: list = []
    current: list = []

    class device_guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            current.append(self.index)

        def __exit__(self, *exc):
            current.pop()

    runs: list = []

    def recorded(self, *args, grid, warmup, **kwargs):
        runs.append((self.__name__, current[-1] if current else None))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device_guard)
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        monkeypatch.setattr(cls, "run", recorded)
    memo_keys.forget()
    yield entered, runs
    memo_keys.forget()


def _plans_on(monkeypatch, index: int) -> list:
    """Every plan reaches the real ``launch.launch`` with device ``index``; returns the kernels that reach it."""
    real = launch.launch
    reached: list = []

    def on_device(plan, tensors):
        reached.append(plan.kernel.__name__)
        real(plan._replace(device=index), tensors)

    for module in MODULES:
        if getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", on_device)
    return reached


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_launch_for_another_device_makes_that_device_current(family, driver, monkeypatch):
    entered, runs = driver
    reached = _plans_on(monkeypatch, 1)
    fn, kernels, _ = FAMILIES[family]
    fn(3, 2)
    assert set(reached) == kernels
    assert [name for name, _ in runs] == reached
    assert all(device == 1 for _, device in runs), runs  # every kernel launched with device 1 current
    assert entered == [1] * len(runs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_launch_for_the_current_device_enters_no_guard(family, driver, monkeypatch):
    entered, runs = driver
    reached = _plans_on(monkeypatch, 0)
    fn, kernels, _ = FAMILIES[family]
    fn(3, 2)
    assert set(reached) == kernels
    assert [name for name, _ in runs] == reached
    assert entered == [] and all(device is None for _, device in runs), runs


def test_a_cpu_launch_enters_no_guard(driver):
    entered, runs = driver
    FAMILIES["int8_dense"][0](3, 2)
    assert {name for name, _ in runs} == {"quantize_kernel", "attn_int8_kernel"} and entered == []
