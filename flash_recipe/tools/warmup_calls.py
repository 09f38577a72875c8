"""The calls each step of ``flash-recipe warmup`` makes (``flash_recipe.tools.warmup``): ``step_calls``
gives them for a step, ``parse_for`` reads ``--for``, ``narrow`` keeps some dtypes and head dims.
Each ``Call`` makes a step's launches through the package's launchers, as the step itself does."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable, Optional

from ..ops import features
from ..ops.configs import head_dim_bucket
from . import gpu_check_cases as gpu_check
from . import verify
from .verify import Case
from .verify_kvcache import _kv_inputs

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (16, 32, 64, 128, 256)
STEPS = ("common", "verify", "tests", "bench", "check", "all")
# test_gpu.py's test_accuracy_at_scale runs its CASES in these dtypes (its parametrize).
TEST_GPU_DTYPES = ("float16", "bfloat16")


# -- the calls each step makes -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a step: ``make(device)`` makes its launches."""

    id: str
    dtype: str
    head_dim: int  # the bucket
    make: Callable[[Any], None]


def _dense(
    step: str, case, dtype: str, descriptors: Optional[bool] = None, no_grad_first: bool = False, both: bool = False
) -> Call:
    """``flash_attn_func`` forward and backward of a ``verify.Case`` on the ``triton`` backend, on
    contiguous tensors as ``verify.check_case`` makes them; ``no_grad_first``: a forward without
    gradients first (bench); ``descriptors`` False: TMA off (bench's ``flash_recipe_pointers``);
    ``both``: the deterministic backward too, as ``verify.check_case`` runs it beside the default."""

    def make(device) -> None:
        import torch

        from ..api import flash_attn_func  # imports torch: importing warmup_calls loads none
        from ..dispatch import use_backend  # imports torch: importing warmup_calls loads none

        sizes = [(case.seqlen_q, case.nheads), (case.seqlen_k, case.nheads_k), (case.seqlen_k, case.nheads_k)]
        q, k, v = (
            torch.empty(case.batch, *s, case.head_dim, dtype=getattr(torch, dtype), device=device) for s in sizes
        )
        options = case.options(device, getattr(torch, dtype))  # sinks, if any, in the input dtype
        forced = contextlib.nullcontext() if descriptors is None else features.using_descriptors(descriptors)
        with use_backend("triton"), forced:
            if no_grad_first:
                with torch.no_grad():
                    flash_attn_func(q, k, v, **options)
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            if options.get("learnable_sink") is not None:  # a leaf too, as verify makes it (dsink)
                options["learnable_sink"] = options["learnable_sink"].clone().requires_grad_(True)
            for deterministic in (True, False) if both else (False,):
                out = flash_attn_func(*leaves, **{**options, "deterministic": deterministic})
                out.backward(torch.empty_like(q))

    suffix = "-pointers" if descriptors is False else ""
    return Call(f"{step}:{case.id}{suffix}:{dtype}", dtype, head_dim_bucket(case.head_dim), make)


def _kv(step: str, case, dtype: str) -> Call:
    """``flash_attn_with_kvcache`` on a ``KVCase``, with the tensors ``check_kvcache_case`` makes."""

    def make(device) -> None:
        import torch

        from ..decoding import flash_attn_with_kvcache  # imports torch: importing warmup_calls loads none
        from ..dispatch import use_backend  # imports torch: importing warmup_calls loads none

        q, k_cache, v_cache, k_new, v_new, kwargs = _kv_inputs(case, getattr(torch, dtype), device, 0)
        with use_backend("triton"):
            flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **kwargs)

    return Call(f"{step}:{case.id}:{dtype}", dtype, head_dim_bucket(case.head_dim), make)


def gpu_test_tables(tests: Optional[Path] = None) -> list[tuple]:
    """``(file, case, dtype)`` of the accuracy tables ``--for tests`` covers (see the module doc),
    read from the checkout's ``tests`` folder: by default next to the package (where the campaign
    finds it)."""
    tests = Path(tests) if tests else Path(__file__).resolve().parents[2] / "tests"  # the package's parent
    if not (tests / "test_gpu.py").is_file():
        raise FileNotFoundError(
            f"--for tests reads the GPU tests' tables from the checkout's tests/ folder, and {tests} has no "
            "test_gpu.py (an installed wheel has no tests next to it): run it from a checkout or name the "
            "folder with --tests"
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


def step_calls(step: str, grid: str = "full", tests: Optional[Path] = None) -> list[Call]:
    """The calls ``step`` makes (see the module doc); ``grid`` "small" takes verify's CPU grids;
    ``tests``: the test folder ``--for tests`` reads (``gpu_test_tables``)."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    if step == "all":
        return [call for name in STEPS[:-1] for call in step_calls(name, grid, tests)]
    if step == "common":
        return [
            _dense(step, Case(1, seqlen, seqlen, 2, 2, head_dim, causal), dtype)
            for dtype in DTYPES
            for head_dim in HEAD_DIMS
            for causal in (False, True)
            for seqlen in (128, 127)  # a multiple of every block, and ragged
        ]
    if step == "verify":
        dense, kv = (
            (verify.SMALL_GRID, verify.KV_SMALL_GRID) if grid == "small" else (verify.FULL_GRID, verify.KV_FULL_GRID)
        )
        return [_dense(step, case, dtype, both=True) for case in dense for dtype in DTYPES] + [
            _kv(step, case, dtype) for case in kv for dtype in DTYPES
        ]
    if step == "tests":
        # test_kernels checks its cases with ``verify.check_case``: both backward paths.
        return [
            _dense(f"tests:{file}", case, dtype, both=file == "test_kernels")
            for file, case, dtype in gpu_test_tables(tests)
        ]
    if step == "check":
        return _check_calls(grid)
    # a cycle: the campaign package imports gpu_check, which imports warmup and so this module
    from .campaign import plan

    calls = []
    for shape in plan.bench_shapes():
        case = Case(shape.batch, shape.seqlen, shape.seqlen, shape.nheads, shape.nheads_k, shape.head_dim, shape.causal)
        for descriptors in (None, False):  # the flash_recipe and flash_recipe_pointers peers
            calls.append(_dense(step, case, shape.dtype, descriptors, no_grad_first=True))
    return calls


def _check_calls(grid: str) -> list[Call]:
    """The correctness step's calls: ``gpu_check``'s table in its dtypes (``grid`` "small": the
    interpreter's table and dtypes)."""
    small = grid == "small"
    table, dtypes = (
        (gpu_check.TINY_TABLE, gpu_check.INTERPRETER_DTYPES) if small else (gpu_check.GPU_TABLE, gpu_check.GPU_DTYPES)
    )

    def call(case, dtype: str) -> Call:
        def make(device) -> None:
            import torch

            gpu_check.run_subject(case, getattr(torch, dtype), device)

        return Call(f"check:{case.id}:{dtype}", dtype, head_dim_bucket(case.head_dim), make)

    return [call(case, dtype) for case in table for dtype in dtypes]


def parse_for(text: str) -> list[tuple]:
    """``--for``'s value as ``[(step, dtypes or None)]``: comma-separated ``STEP`` or ``STEP:DTYPE``
    (a step named twice keeps each of its dtypes); raises ValueError naming what is wrong."""
    items: dict[str, Optional[list]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        step, _, dtype = part.partition(":")
        if step not in STEPS:
            raise ValueError(f"--for takes steps of {', '.join(STEPS)} (optionally STEP:DTYPE), got {step!r}")
        if dtype and dtype not in DTYPES:
            raise ValueError(f"--for {part}: the dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not dtype:
            items[step] = None  # every dtype
        elif step not in items:
            items[step] = [dtype]
        else:
            known = items[step]
            if known is not None:
                items[step] = [*known, dtype]
    if not items:
        raise ValueError(f"--for needs at least one step of {', '.join(STEPS)}, got {text!r}")
    return list(items.items())


def calls_for(items: list[tuple], tests: Optional[Path] = None) -> list[Call]:
    """The calls of ``parse_for``'s items, each narrowed to its dtypes; duplicates dropped."""
    return narrow([call for step, dtypes in items for call in narrow(step_calls(step, tests=tests), dtypes)])


def narrow(calls: list[Call], dtypes: Optional[list] = None, head_dims: Optional[list] = None) -> list[Call]:
    """The calls in ``dtypes`` and head-dim buckets ``head_dims`` (None: all); duplicates dropped."""
    found: dict[str, Call] = {}
    for call in calls:
        if (not dtypes or call.dtype in dtypes) and (not head_dims or call.head_dim in head_dims):
            found.setdefault(call.id, call)
    return list(found.values())
