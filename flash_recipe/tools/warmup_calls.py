"""The calls each step of ``flash-recipe warmup`` makes (``flash_recipe.tools.warmup``): ``step_calls``
gives them for a step, ``parse_for`` reads ``--for``, ``narrow`` keeps some dtypes and head dims.
Each ``Call`` makes a step's launches through the package's launchers, as the step itself does.

``STEP_CALLS`` maps each step to the function that lists its calls: the package's own steps are
``common`` and ``verify``; a checkout's ``devtools.warmup`` adds the GPU campaign's steps
(``tests``, ``bench``, ``check``) with ``add_step`` before it runs the command."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..api import flash_attn_func
from ..decoding import flash_attn_with_kvcache
from ..dispatch import use_backend
from ..ops import features
from ..ops.configs import head_dim_bucket
from . import verify
from .verify import Case
from .verify_kvcache import kv_inputs

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (16, 32, 64, 128, 256)


# -- the calls each step makes -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a step: ``make(device)`` makes its launches."""

    id: str
    dtype: str
    head_dim: int  # the bucket
    make: Callable[[Any], None]


def dense_call(
    step: str, case, dtype: str, descriptors: Optional[bool] = None, no_grad_first: bool = False, both: bool = False
) -> Call:
    """``flash_attn_func`` forward and backward of a ``verify.Case`` on the ``triton`` backend, on
    contiguous tensors as ``verify.check_case`` makes them; ``no_grad_first``: a forward without
    gradients first (bench); ``descriptors`` False: TMA off (bench's ``flash_recipe_pointers``);
    ``both``: the deterministic backward too, as ``verify.check_case`` runs it beside the default."""

    def make(device) -> None:
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


def kv_call(step: str, case, dtype: str) -> Call:
    """``flash_attn_with_kvcache`` on a ``KVCase``, with the tensors ``check_kvcache_case`` makes."""

    def make(device) -> None:
        q, k_cache, v_cache, k_new, v_new, kwargs = kv_inputs(case, getattr(torch, dtype), device, 0)
        with use_backend("triton"):
            flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, **kwargs)

    return Call(f"{step}:{case.id}:{dtype}", dtype, head_dim_bucket(case.head_dim), make)


def _common(grid: str, tests: Optional[Path]) -> list[Call]:
    """``common``: ``flash_attn_func`` forward and backward at every dtype, head-dim bucket and
    causal setting, at sequence length 128 (block-aligned) and 127 (ragged)."""
    return [
        dense_call("common", Case(1, seqlen, seqlen, 2, 2, head_dim, causal), dtype)
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for causal in (False, True)
        for seqlen in (128, 127)  # a multiple of every block, and ragged
    ]


def _verify(grid: str, tests: Optional[Path]) -> list[Call]:
    """``verify``: what ``flash-recipe verify --kvcache`` calls in every dtype (``grid`` "small":
    its CPU grids), the dense cases with both backward paths, as ``verify.check_case`` runs them."""
    dense, kv = (
        (verify.SMALL_GRID, verify.KV_SMALL_GRID) if grid == "small" else (verify.FULL_GRID, verify.KV_FULL_GRID)
    )
    return [dense_call("verify", case, dtype, both=True) for case in dense for dtype in DTYPES] + [
        kv_call("verify", case, dtype) for case in kv for dtype in DTYPES
    ]


# step -> the function listing its calls, ``(grid, tests folder) -> [Call]``; "all" is every step.
STEP_CALLS: dict[str, Callable[[str, Optional[Path]], list[Call]]] = {"common": _common, "verify": _verify}


def add_step(name: str, calls: Callable[[str, Optional[Path]], list[Call]]) -> None:
    """Make ``--for name`` list ``calls(grid, tests)`` (a checkout's tools add their steps so)."""
    STEP_CALLS[name] = calls


def steps() -> tuple[str, ...]:
    """The names ``--for`` takes: every step of ``STEP_CALLS``, then "all"."""
    return (*STEP_CALLS, "all")


def step_calls(step: str, grid: str = "full", tests: Optional[Path] = None) -> list[Call]:
    """The calls ``step`` makes (see ``STEP_CALLS``); ``grid`` "small" takes verify's CPU grids;
    ``tests``: the test folder a step reading the checkout's tests reads."""
    if step not in steps():
        raise ValueError(f"step must be one of {steps()}, got {step!r}")
    if step == "all":
        return [call for name in STEP_CALLS for call in STEP_CALLS[name](grid, tests)]
    return STEP_CALLS[step](grid, tests)


def parse_for(text: str) -> list[tuple]:
    """``--for``'s value as ``[(step, dtypes or None)]``: comma-separated ``STEP`` or ``STEP:DTYPE``
    (a step named twice keeps each of its dtypes); raises ValueError naming what is wrong."""
    items: dict[str, Optional[list]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        step, _, dtype = part.partition(":")
        if step not in steps():
            raise ValueError(f"--for takes steps of {', '.join(steps())} (optionally STEP:DTYPE), got {step!r}")
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
        raise ValueError(f"--for needs at least one step of {', '.join(steps())}, got {text!r}")
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
