"""``python -m devtools.warmup``: ``flash-recipe warmup`` with the GPU campaign's steps added.

The package's own command warms what users run (``common``, ``verify``). From a checkout this
module adds three steps to its ``--for`` (``warmup_calls.add_step``), then runs the command with the
same options:

- ``tests``: the accuracy tables of the checkout's GPU test files: ``test_gpu.CASES`` in fp16 and
  bf16 and ``test_kernels.CASES`` in its ``DTYPES``, each forward and backward as
  ``verify.check_case`` calls them. The other calls of the GPU test files (test_kvcache,
  test_varlen, test_dropout, test_torch_compile, the one-off tests) are not listed: their variants
  still compile on first use;
- ``bench``: the campaign's bench step (``campaign.plan.bench_shapes``): the forward without
  gradients, then forward and backward, of the ``flash_recipe`` and ``flash_recipe_pointers`` peers;
- ``check``: the campaign's correctness step (``devtools.gpu_check``): each row of its
  ``GPU_TABLE`` in bf16 and fp16, as ``gpu_check.run_subject`` calls it (its fuzz only runs variants
  the table launched).

``--for all`` then takes these too. The campaign's warmup step runs this module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

import torch

from flash_recipe.ops.configs import head_dim_bucket
from flash_recipe.tools import cli, warmup_calls
from flash_recipe.tools.verify import Case
from flash_recipe.tools.warmup_calls import Call, dense_call

from . import gpu_check_cases as gpu_check
from .campaign import plan

# test_gpu.py's test_accuracy_at_scale runs its CASES in these dtypes (its parametrize).
TEST_GPU_DTYPES = ("float16", "bfloat16")
# The checkout's tests, beside this folder.
TESTS = Path(__file__).resolve().parents[1] / "tests"


def gpu_test_tables(tests: Optional[Path] = None) -> list[tuple]:
    """``(file, case, dtype)`` of the accuracy tables ``--for tests`` covers (see the module doc),
    read from ``tests`` (default: the checkout's ``tests`` folder)."""
    tests = Path(tests) if tests else TESTS
    if not (tests / "test_gpu.py").is_file():
        raise FileNotFoundError(
            f"--for tests reads the GPU tests' tables from the checkout's tests/ folder, and {tests} has no "
            "test_gpu.py: name the folder with --tests"
        )
    modules = []
    for name in ("test_gpu", "test_kernels"):
        spec = importlib.util.spec_from_file_location(f"_flash_recipe_warmup_{name}", tests / f"{name}.py")
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {tests / name}.py")
        modules.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(modules[-1])
    gpu, kernels = modules
    rows = [("test_gpu", case, dtype) for case in gpu.CASES for dtype in TEST_GPU_DTYPES]
    dtypes = [str(d).replace("torch.", "") for d in kernels.DTYPES]
    return rows + [("test_kernels", case, dtype) for case in kernels.CASES for dtype in dtypes]


def tests_calls(grid: str, tests: Optional[Path]) -> list[Call]:
    """``tests``: the GPU test files' tables; test_kernels checks its cases with
    ``verify.check_case``, so both backward paths."""
    return [
        dense_call(f"tests:{file}", case, dtype, both=file == "test_kernels")
        for file, case, dtype in gpu_test_tables(tests)
    ]


def bench_calls(grid: str, tests: Optional[Path]) -> list[Call]:
    """``bench``: the campaign's bench shapes, for the ``flash_recipe`` and ``flash_recipe_pointers`` peers."""
    calls = []
    for shape in plan.bench_shapes():
        case = Case(**shape.sizes(), causal=shape.causal)
        for descriptors in (None, False):  # the flash_recipe and flash_recipe_pointers peers
            calls.append(dense_call("bench", case, shape.dtype, descriptors, no_grad_first=True))
    return calls


def check_calls(grid: str, tests: Optional[Path]) -> list[Call]:
    """``check``: ``gpu_check``'s table in its dtypes (``grid`` "small": the interpreter's table
    and dtypes)."""
    small = grid == "small"
    table, dtypes = (
        (gpu_check.TINY_TABLE, gpu_check.INTERPRETER_DTYPES) if small else (gpu_check.GPU_TABLE, gpu_check.GPU_DTYPES)
    )

    def call(case, dtype: str) -> Call:
        def make(device) -> None:
            gpu_check.run_subject(case, getattr(torch, dtype), device)

        return Call(f"check:{case.id}:{dtype}", dtype, head_dim_bucket(case.head_dim), make)

    return [call(case, dtype) for case in table for dtype in dtypes]


def add_steps() -> None:
    """Add ``tests``, ``bench`` and ``check`` to ``flash-recipe warmup --for`` in this process."""
    warmup_calls.add_step("tests", tests_calls)
    warmup_calls.add_step("bench", bench_calls)
    warmup_calls.add_step("check", check_calls)


def main(argv: Optional[list] = None) -> int:
    """``flash-recipe warmup ARGV`` with the campaign's steps added."""
    add_steps()
    return cli.main(["warmup", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
