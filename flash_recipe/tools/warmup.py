"""``flash-recipe warmup``: compile ahead, in parallel, the Triton kernel variants a step will launch.

The first launch of each kernel variant compiles it (seconds each, one after another) into Triton's
on-disk cache (``$TRITON_CACHE_DIR``, default ``~/.triton/cache``), which later processes load from.
``warmup --jobs N`` compiles a step's variants in N processes first: a Docker build step on a GPU
builder whose cache is copied into the image, or the campaign before its verify and test steps.

A *variant* is one specialisation Triton compiles: a kernel (forward, decode, the three backward
kernels, the KV-cache append, the split-KV merge) and what Triton specialises it on, which is its
constexpr arguments (the dtype's configuration, the head-dim bucket, and the flags the kernels'
heuristics derive: masks, softcap, ALiBi, dropout, varlen, paging, GQA packing, ragged rows or
head dim), the dtypes of its tensors, which pointers are 16-byte aligned, which integers are 1 or
multiples of 16, and the launch options (warps, stages). Two launches that agree on all of these
share one compiled kernel; the list is deduplicated on that (``Variant.key``, as fine or finer).

How the list is derived: the step's own calls are made (``warmup_calls.step_calls``) with Triton's launch
replaced by a recorder (``recorded_launches``), so nothing compiles or runs; every launch the
package's launchers make is recorded with its arguments, after its heuristics. The calls, per step:

- ``common`` (the default): the forward and backward of ``flash_attn_func`` at every dtype,
  head-dim bucket and causal setting, at sequence length 128 (block-aligned) and 127 (ragged);
- ``verify``: what ``flash-recipe verify --kvcache --grid full`` calls on the ``triton`` backend:
  the forward and backward of each ``FULL_GRID`` case and ``flash_attn_with_kvcache`` on each
  ``KV_FULL_GRID`` case, each in every dtype (narrow with ``--dtype bfloat16`` for the campaign's step);
- ``all``: every step above; a checkout's ``python -m devtools.warmup`` adds the GPU campaign's
  steps (``tests``, ``bench``, ``check``).

``--for`` takes several, comma-separated, each narrowed to its own dtypes with ``STEP:DTYPE``
(``--for common,verify:bfloat16``; the campaign passes ``check,bench,verify:bfloat16``); ``--dtype``
narrows them all.

On a GPU the calls run on it, so the tuned configurations, split counts and tensor descriptors are
the GPU's own. Each worker replays recorded launches through the kernel's own ``JITFunction.run``
with ``warmup=True`` (compile, launch nothing) on tiny tensors of the recorded dtypes and alignment,
with the recorded integers and constexprs: the specialisation, hence the compiled kernel and its
cache entry, is the one the real launch compiles (tests/test_warmup.py checks it for a real launch).

``--offline TARGET`` does the same without a GPU, for measuring the compile part: the calls are
made with CPU tensors on the Triton backend with the target's launch configurations, split-KV
counts from the target's multiprocessor count (``targets.OFFLINE_GPUS``; tuned files are not read),
and the workers compile for the target with the stub driver of ``flash_recipe.ops.offline``, into
a fresh temporary cache, so they measure compiling, not loading. It needs ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from .. import dispatch
from ..dispatch import BackendUnavailableError
from ..ops import splits, targets
from .compile_calls import GENERAL_FLAGS
from .warmup_calls import (
    DTYPES,
    HEAD_DIMS,
    Call,
    calls_for,
    narrow,
    parse_for,
)

MAX_DEFAULT_JOBS = 16
# The kernels' families, as the report sums them; ``attn_fwd_kernel`` is "fwd", "fwd_general" or
# "decode" by its flags (``family``).
FAMILIES = {
    "attn_fwd_kernel": "fwd",
    "attn_bwd_preprocess_kernel": "bwd",
    "attn_bwd_dkdv_kernel": "bwd",
    "attn_bwd_dq_kernel": "bwd",
    "rotary_append_kernel": "kvcache_append",
    "split_combine_kernel": "split_combine",
    "dropout_mask_kernel": "dropout_mask",
}
# The tensor whose dtype names a kernel's variant: its first of these.
_MAIN_TENSORS = ("Q", "X", "O")
# --offline targets: those whose multiprocessor count ``targets.OFFLINE_GPUS`` holds (split-KV counts).
OFFLINE_TARGETS = tuple(sorted(target for _, target in targets.OFFLINE_GPUS))


def cache_dir() -> str:
    """Where Triton keeps compiled kernels."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def default_jobs() -> int:
    """The CPU count, at most ``MAX_DEFAULT_JOBS``."""
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_JOBS))


# -- recording the launches --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel specialisation: ``key`` is what Triton specialises on; ``args`` and ``options``
    rebuild a launch of it on tiny tensors (``compile_variant``); ``call`` is the first step call
    that launches it."""

    kernel: str  # "module:function"
    family: str
    dtype: str
    head_dim: int  # BLOCK_D
    flags: tuple
    key: tuple
    args: tuple
    options: tuple
    call: str

    @property
    def id(self) -> str:
        digest = hashlib.sha1(repr(self.key).encode()).hexdigest()[:6]
        flags = "+".join(self.flags) or "plain"
        return f"{self.family}:{self.kernel.split(':')[1]}-{self.dtype}-d{self.head_dim}-{flags}-{digest}"


def _constexprs(fn) -> set:
    """The names of ``fn``'s constexpr parameters (a JIT or interpreted function)."""
    return {name for name, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}


def _describe(value) -> Any:
    """A launch argument as ``compile_variant`` rebuilds it: a tensor by dtype and 16-byte
    alignment, a tensor descriptor by its base dtype, shape, strides and block; others as they are."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _name(value.dtype), value.data_ptr() % 16 == 0)
    if hasattr(value, "base") and isinstance(value.base, torch.Tensor):
        dims = tuple(tuple(int(x) for x in dims) for dims in (value.shape, value.strides, value.block_shape))
        return ("descriptor", _name(value.base.dtype), *dims, getattr(value, "padding", "zero"))
    return value


def _specialisation(value) -> Any:
    """What Triton specialises a non-constexpr argument on, or finer (so two launches with equal
    keys compile one kernel in every Triton release): a tensor's dtype and 16-byte alignment, an
    integer's width and whether it is 1 or divisible by 16, a descriptor's dtype, block and the same
    for its sizes and strides; a float is an fp32 whatever its value."""
    if isinstance(value, torch.Tensor):
        return (_name(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, int) and not isinstance(value, bool):
        width = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
        return (width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    if hasattr(value, "base") and isinstance(value.base, torch.Tensor):
        return ("descriptor", *_describe(value)[1:], *(_specialisation(int(x)) for x in (*value.shape, *value.strides)))
    return (type(value).__name__, value)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def family(kernel: str, constants: dict, seqlen_q: Optional[int]) -> str:
    """The report's family of a launch of ``kernel`` (a function name) with ``constants``: the
    forward is "decode" over a KV cache with at most 16 query rows (as ``kvcache`` launches it),
    "fwd_general" with any flag of ``compile_calls.GENERAL_FLAGS``, else "fwd"."""
    if kernel != "attn_fwd_kernel":
        return FAMILIES.get(kernel, kernel)
    if constants.get("KV_RANGES") and not constants.get("VARLEN") and seqlen_q is not None and seqlen_q <= 16:
        return "decode"
    return "fwd_general" if any(constants.get(flag) for flag in GENERAL_FLAGS) else "fwd"


def to_variant(fn, args: tuple, kwargs: dict, call: str) -> Variant:
    """The ``Variant`` of one recorded launch of ``fn`` (arguments after its heuristics)."""
    names = list(fn.arg_names)
    bound = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    options = tuple((k, v) for k, v in kwargs.items() if k not in names)  # in the launch's order, as Triton keys them
    constexprs = _constexprs(fn)
    # Arguments Triton does not specialise on (``do_not_specialize``) compile one kernel whatever their
    # value: only their integer width counts.
    plain = {names[n] if isinstance(n, int) else n for n in getattr(fn, "do_not_specialize", None) or ()}
    key = tuple(
        ("constexpr", bound.get(n))
        if n in constexprs
        else _specialisation(bound.get(n))[:1]
        if n in plain
        else _specialisation(bound.get(n))
        for n in names
    )
    constants = {name: bound.get(name) for name in constexprs}
    name = fn.fn.__name__
    main = next((bound[t] for t in _MAIN_TENSORS if bound.get(t) is not None), None)
    seqlen_q = bound.get("seqlen_q")
    return Variant(
        kernel=f"{fn.fn.__module__}:{name}",
        family=family(name, constants, seqlen_q if isinstance(seqlen_q, int) else None),
        dtype=_name(main.dtype) if main is not None else "-",
        head_dim=int(constants.get("BLOCK_D") or 0),
        flags=tuple(sorted(k for k, v in constants.items() if v is True)),
        key=(f"{fn.fn.__module__}:{name}", key, tuple(sorted(options))),
        args=tuple((n, _describe(bound.get(n))) for n in names),
        options=options,
        call=call,
    )


def recorded_launches():
    """Inside the block no Triton kernel compiles or runs: each launch is recorded as ``(jit
    function, args, kwargs)`` in the list this yields (``host_cost.stubbed_launches``)."""
    from .host_cost import stubbed_launches  # Triton on use: without a GPU ``run`` says why first

    return stubbed_launches()


@contextlib.contextmanager
def offline_planning(target: str) -> Iterator[None]:
    """CPU tensors planned as for ``target``: its launch configurations and tensor descriptors
    (``targets.target_of``), split-KV counts from its multiprocessor count, and the Triton backend
    for every call (on the CPU the dispatcher would take it only through the interpreter)."""
    import triton  # Triton on use: without a GPU ``run`` says why first

    from ..ops import kvcache  # Triton on use, as above

    sms = dict((t, n) for n, t in targets.OFFLINE_GPUS)[target]
    triton_backend = dispatch.TritonBackend()

    def auto_splits(batch, nheads, seqlen_q, capacity, device, head_dim, element_size):
        query_blocks, block_n = kvcache.launch_blocks(device, seqlen_q, head_dim, element_size)
        return splits.choose_splits(batch * nheads * query_blocks, triton.cdiv(capacity, block_n), sms)

    saved = targets.target_of, kvcache.auto_splits, dispatch.select
    targets.target_of = lambda device: target
    kvcache.auto_splits = auto_splits
    dispatch.select = lambda call, extra=None, extra_key=None: triton_backend
    try:
        yield
    finally:
        targets.target_of, kvcache.auto_splits, dispatch.select = saved


def variants(calls: list[Call], device, target: Optional[str] = None) -> tuple[list[Variant], dict]:
    """The distinct variants ``calls`` launch on ``device`` (offline for ``target`` if given), in
    the order first launched, and ``{call id: reason}`` for the calls the Triton backend refused."""
    found: dict[tuple, Variant] = {}
    skipped = {}
    planning = offline_planning(target) if target else contextlib.nullcontext()
    with planning, recorded_launches() as launches:
        for call in calls:
            del launches[:]
            try:
                call.make(device)
            except BackendUnavailableError as exc:
                skipped[call.id] = str(exc)
                continue
            for fn, args, kwargs in launches:
                variant = to_variant(fn, args, kwargs, call.id)
                found.setdefault(variant.key, variant)
    return list(found.values()), skipped


# -- compiling in worker processes -------------------------------------------------------------

_WORKER: dict = {}  # the worker process's device and, offline, its stub launch context


def init_worker(target: Optional[str], device: str, cache: Optional[str] = None) -> None:
    """Set up a worker: offline, the stub driver (``ops.offline``) for ``target`` for its lifetime;
    on a GPU, ``device`` made current; ``cache``: the Triton cache directory to compile into."""
    if cache:
        os.environ["TRITON_CACHE_DIR"] = cache
    if target:
        from ..ops.offline import offline_launches  # Triton on use, as in ``offline_planning``

        context = offline_launches(target)
        _WORKER.update(context=context, compiled=context.__enter__())  # compiled: (name, kernel) pairs
    elif torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    _WORKER["device"] = torch.device(device)


def _rebuild(description, device):
    if not isinstance(description, tuple) or description[:1] not in (("tensor",), ("descriptor",)):
        return description
    base = torch.empty(64, dtype=getattr(torch, description[1]), device=device)
    if description[0] == "tensor":
        return base if description[2] else base[1:]  # one element off: not 16-byte aligned
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton on use, as in ``offline_planning``

    _, _, shape, strides, block, padding = description
    extra = {} if padding == "zero" else {"padding": padding}  # the default; older releases lack the field
    return TensorDescriptor(base, list(shape), list(strides), list(block), **extra)


def compile_variant(variant: Variant) -> dict:
    """Compile ``variant`` in this worker through its kernel's ``JITFunction.run`` (``warmup=True``:
    nothing is launched) on tiny tensors; returns its report fields."""
    device = _WORKER.get("device", "cpu")
    module, name = variant.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    while hasattr(fn, "values") and hasattr(fn, "arg_names") and hasattr(fn, "fn"):  # triton.heuristics
        fn = fn.fn
    kwargs = {arg: _rebuild(value, device) for arg, value in variant.args}
    fn.run(grid=(1, 1, 1), warmup=True, **kwargs, **dict(variant.options))
    return {"variant": variant.id, "family": variant.family, "call": variant.call}


def _timed(work: Callable[[Any], Optional[dict]], indexed: tuple) -> dict:
    index, job = indexed
    begin = time.perf_counter()
    row: dict = {"index": index}
    try:
        result = work(job)
        row.update(result if isinstance(result, dict) else {})
    except Exception as exc:  # report and go on: one failure must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row.update(seconds=round(time.perf_counter() - begin, 3), worker=os.getpid())
    return row


def run_jobs(
    jobs: list,
    work: Callable[[Any], Optional[dict]],
    n_jobs: int,
    initializer: Optional[Callable] = None,
    initargs: tuple = (),
    progress: Optional[Callable[[dict], None]] = None,
) -> tuple[list[dict], float]:
    """Run ``work(job)`` for every job in ``n_jobs`` worker processes (multiprocessing's "spawn"
    context: a fresh interpreter each, as Triton and CUDA need), each job timed where it runs.

    Returns the rows in job order, each ``work``'s dict with ``index``, ``seconds``, ``worker``
    (its process id) and ``error`` where it raised, and the wall seconds, worker start-up included.
    """
    if not isinstance(n_jobs, int) or isinstance(n_jobs, bool):
        raise TypeError(f"n_jobs must be an int, got {type(n_jobs).__name__}")
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be at least 1, got {n_jobs}")
    begin = time.perf_counter()
    rows = []
    context = multiprocessing.get_context("spawn")
    with context.Pool(n_jobs, initializer, initargs) as pool:
        for row in pool.imap_unordered(functools.partial(_timed, work), enumerate(jobs), chunksize=1):
            rows.append(row)
            if progress is not None:
                progress(row)
    return sorted(rows, key=lambda row: row["index"]), time.perf_counter() - begin


def summary(rows: list[dict], wall: float, n_jobs: int) -> dict:
    """Per family the variants, sum and max of their first-call seconds; the totals, the wall time,
    the speed-up over one process (sum / wall) and the estimate for ``MAX_DEFAULT_JOBS`` jobs."""
    by_family: dict[str, list] = {}
    for row in rows:
        by_family.setdefault(row.get("family", "?"), []).append(row["seconds"])
    families = {k: {"variants": len(v), "sum_s": round(sum(v), 3), "max_s": max(v)} for k, v in by_family.items()}
    seconds = [row["seconds"] for row in rows]
    total = round(sum(seconds), 3)
    return dict(
        families=families, variants=len(rows), errors=sum("error" in row for row in rows), sum_s=total,
        max_s=max(seconds, default=0.0), wall_s=round(wall, 3), jobs=n_jobs,
        speedup=round(total / wall, 2) if wall > 0 else None,
        estimate_16_jobs_s=round(estimated_wall(seconds, MAX_DEFAULT_JOBS), 1),
    )  # fmt: skip


def estimated_wall(seconds: list[float], n_jobs: int) -> float:
    """An estimate, not a measurement: the wall time of compiling variants of these ``seconds`` in
    ``n_jobs`` processes, ``sum / min(n_jobs, variants)``, at least the longest variant (start-up
    and imbalance not counted)."""
    if not seconds:
        return 0.0
    return max(sum(seconds) / min(n_jobs, len(seconds)), max(seconds))


# -- the command -------------------------------------------------------------------------------


def _positive_jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--jobs takes a whole number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be at least 1 (one worker process), got {value}")
    return value


def _for(text: str) -> str:
    try:
        parse_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--for",
        dest="step",
        type=_for,
        default="common",
        metavar="STEP[:DTYPE],...",
        help="whose variants: common (forward and backward per dtype, head dim, causal, aligned/ragged), the "
        "calls of verify (full and KV grids), or all; several comma-separated, each optionally narrowed to a "
        "dtype (verify:bfloat16)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_jobs,
        default=default_jobs(),
        help="compiler processes (default: the CPU count, at most 16)",
    )
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="dtype (repeatable); default: the step's")
    parser.add_argument(
        "--head-dim",
        action="append",
        type=int,
        choices=HEAD_DIMS,
        help="head-dim bucket (repeatable); head dims compile to the next power of two; default: all",
    )
    parser.add_argument("--device", default="cuda", help="CUDA device to compile for (default: the current one)")
    parser.add_argument(
        "--offline",
        metavar="TARGET",
        choices=OFFLINE_TARGETS,
        help="no GPU: compile for TARGET with the compile check's stub driver, into a temporary cache (measures "
        "the compile part)",
    )
    parser.add_argument(
        "--tests", metavar="DIR", help="the tests folder a step that reads a checkout's tests reads (devtools.warmup)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the per-variant rows and the summary to FILE")


def _report(result: dict) -> str:
    lines = [f"{'family':<15} {'variants':>8} {'sum s':>9} {'max s':>8}"]
    for name, entry in sorted(result["families"].items()):
        lines.append(f"{name:<15} {entry['variants']:>8} {entry['sum_s']:>9.1f} {entry['max_s']:>8.2f}")
    lines.append(
        f"{result['variants']} variants: {result['sum_s']:.1f} s of first calls in {result['wall_s']:.1f} s wall "
        f"with {result['jobs']} jobs (speed-up over one process, sum / wall: {result['speedup']}x)"
    )
    lines.append(
        f"estimate for {MAX_DEFAULT_JOBS} jobs: {result['estimate_16_jobs_s']:.1f} s (sum / min({MAX_DEFAULT_JOBS}, "
        "variants), at least the longest variant; an estimate, not a measurement)"
    )
    return "\n".join(lines)


def run(args) -> int:
    if args.offline:
        if targets.interpreter_enabled():
            print("flash-recipe warmup: unset TRITON_INTERPRET: --offline needs Triton's compiler", file=sys.stderr)
            return 2
        device, where = torch.device("cpu"), f"{args.offline} offline (stub driver, nothing launched)"
    else:
        if not torch.cuda.is_available():
            print(
                "flash-recipe warmup: no CUDA or ROCm GPU is visible, so there is nothing to compile for; run it on "
                "a machine with the target GPU, or measure the compile part with --offline sm90",
                file=sys.stderr,
            )
            return 2
        device = torch.device(args.device)
        where = torch.cuda.get_device_name(device)
    try:
        calls = narrow(calls_for(parse_for(args.step), tests=args.tests), args.dtype, args.head_dim)
    except FileNotFoundError as exc:
        print(f"flash-recipe warmup: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not args.dtype and not torch.cuda.is_bf16_supported():
        calls = [call for call in calls if call.dtype != "bfloat16"]
    begin = time.perf_counter()
    found, skipped = variants(calls, device, args.offline)
    counts = collections.Counter(variant.family for variant in found)
    print(
        f"--for {args.step}: {len(calls)} calls -> {len(found)} variants "
        f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) in {time.perf_counter() - begin:.1f} s; "
        f"{len(skipped)} calls the triton backend refused"
    )

    def progress(row: dict) -> None:
        done = f"{row['seconds']:7.2f} s" if "error" not in row else f"failed: {row['error'][:300]}"
        print(f"  {found[row['index']].id:<64} {done}", flush=True)

    # Offline the workers compile into a fresh cache, so they measure compiling, not loading.
    scratch = tempfile.TemporaryDirectory(prefix="flash-recipe-warmup-") if args.offline else contextlib.nullcontext()
    with scratch as cache:
        print(f"compiling for {where} in {args.jobs} processes into {cache or cache_dir()}", flush=True)
        initargs = (args.offline, str(device), cache)
        rows, wall = run_jobs(found, compile_variant, args.jobs, init_worker, initargs, progress)
    for row in rows:
        variant = found[row["index"]]
        row.update(variant=variant.id, family=variant.family, call=variant.call)
    target = args.offline or targets.target_of(device)
    result = {"step": args.step, "device": where, "target": target, **summary(rows, wall, args.jobs)}
    print(_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "calls": len(calls), "skipped": skipped, "rows": rows}, f, indent=2)
    return 1 if result["errors"] else 0
