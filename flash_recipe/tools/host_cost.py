"""``flash-recipe bench --host``: what one attention call costs the host, beside torch SDPA's.

A decoding step calls attention once per layer, and at batch 1-32 the GPU finishes the kernel
sooner than Python can issue the next one: the host path, not the kernel, sets the speed. This
module measures that path two ways:

- **Python function calls per call** (``count_calls``): every function frame entered, generator
  resumptions included (``sys.setprofile``'s ``call`` events). Deterministic, so CI bounds it
  (``tests/test_host_cost.py``).
- **Microseconds per call** (``time_calls``): wall clock of calls issued back to back, no
  synchronisation inside the timed region (a GPU runs the kernels behind the host; the device is
  synchronised before the clock starts and after it stops, outside the measurement).

With ``stubbed_launches()`` Triton's launch is replaced by a recorder: no kernel is compiled or
run, and what remains is this package's own host work, on a CPU machine as on a GPU one (on the
CPU, through the interpreter's launch entry point). Without it (``--launch real``, GPU only) the
time also holds Triton's launch.

The cases (``CASES``), at Llama-3-8B's attention shape (32 query heads, 8 kv heads, head dim 128):

- ``fwd``: ``flash_attn_func``, one new token per sequence over its keys, no autograd;
- ``fwd_autograd``: the same with ``q`` requiring grad (the forward records its backward);
- ``kvcache``: ``flash_attn_with_kvcache`` appending one token per sequence to a cache of
  ``cache`` rows with ``cache_seqlens`` as a tensor on the device (the decoding step of
  ``generate``); on a CPU machine the metadata stands for device memory (``validate.on_host``),
  so its values are not read, as on a GPU.

torch SDPA's column is ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors
(GQA through ``enable_gqa``), issued back to back like flash_recipe's. On a CPU torch computes
for real, so there SDPA runs on one head of one query and key (its host cost, with a kernel of
next to no work).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Callable, Optional

from .. import __version__, files, signatures, validate

CASES = ("fwd", "fwd_autograd", "kvcache")
# Shapes: (batch, nheads, nheads_k, head_dim); the cache rows differ on a GPU and on the CPU.
SHAPE = (8, 32, 8, 128)
CACHE_GPU, CACHE_CPU = 8192, 256


@contextlib.contextmanager
def stubbed_launches() -> Iterator[list]:
    """Inside the block no Triton kernel compiles or runs: each launch is recorded as ``(jit
    function, args, kwargs)`` in the list this yields and returns at once. Replaces
    ``JITFunction.run`` (a GPU's launch) and the interpreter's ``InterpretedFunction.run``, the calls
    every launch ends in (``warmup`` lists the variants a step launches with it)."""
    from triton.runtime import interpreter, jit

    launches: list = []

    def recorded(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    saved = jit.JITFunction.run, interpreter.InterpretedFunction.run
    jit.JITFunction.run = interpreter.InterpretedFunction.run = recorded
    try:
        yield launches
    finally:
        jit.JITFunction.run, interpreter.InterpretedFunction.run = saved


def count_calls(fn: Callable[[], object]) -> int:
    """Python function calls (frames entered, generator resumptions included) during ``fn()``."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn's own frame


def time_calls(fn: Callable[[], object], reps: int = 200, rounds: int = 5, device=None) -> float:
    """Median over ``rounds`` of the microseconds per call of ``reps`` calls issued back to back;
    a CUDA ``device`` is synchronised before and after each round, outside the clock."""
    import torch

    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = time.perf_counter() - start
        sync()
        per_call.append(elapsed / reps * 1e6)
    return statistics.median(per_call)


def make_case(name: str, device, dtype, cache: int, shape: tuple = SHAPE) -> tuple[Callable, Callable]:
    """``(flash_recipe call, torch SDPA call)`` of case ``name`` on new tensors."""
    import torch

    from ..api import flash_attn_func  # loads the dispatch: importing host_cost does not
    from ..decoding import flash_attn_with_kvcache  # loads the dispatch: importing host_cost does not

    if name not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {name!r}")
    batch, nheads, nheads_k, head_dim = shape
    gen = torch.Generator().manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    q = rand(batch, 1, nheads, head_dim)
    sdpa_q = q.transpose(1, 2)
    if name == "kvcache":
        k_cache, v_cache = rand(batch, cache, nheads_k, head_dim), rand(batch, cache, nheads_k, head_dim)
        k_new, v_new = rand(batch, 1, nheads_k, head_dim), rand(batch, 1, nheads_k, head_dim)
        lengths = torch.full((batch,), cache // 2, dtype=torch.int32, device=device)

        def ours():
            return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)

        sdpa_k, sdpa_v = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    else:
        k, v = rand(batch, cache, nheads_k, head_dim), rand(batch, cache, nheads_k, head_dim)
        if name == "fwd_autograd":
            q.requires_grad_(True)

        def ours():
            return flash_attn_func(q, k, v, causal=True)

        sdpa_k, sdpa_v = k.transpose(1, 2), v.transpose(1, 2)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, enable_gqa=True)

    return ours, sdpa


@contextlib.contextmanager
def device_metadata(device) -> Iterator[None]:
    """On a CPU, the metadata tensors stand for device memory: ``validate.on_host`` answers False
    (the one decision a GPU call takes differently), so a call reads no metadata value, as on a GPU."""
    if device.type != "cpu":
        yield
        return
    saved = validate.on_host
    validate.on_host = lambda t: False
    try:
        yield
    finally:
        validate.on_host = saved
        signatures.forget()  # verdicts reached without reading host metadata must not outlive the block


def measure(device, dtype, cache: int, stub: bool, reps: int = 200, cases=CASES) -> list[dict]:
    """One row per case: Python calls and microseconds per call of flash_recipe's call (on the
    triton backend, launches stubbed with ``stub``), and torch SDPA's microseconds beside it."""
    import torch

    from ..dispatch import use_backend  # loads the dispatch: importing host_cost does not

    rows = []
    for name in cases:
        ours, sdpa = make_case(name, device, dtype, cache)
        stubbed: contextlib.AbstractContextManager = stubbed_launches() if stub else contextlib.nullcontext([])
        with use_backend("triton"), device_metadata(device), stubbed as launches:
            ours()  # the first call of the signature: checks, choices, plans
            before = len(launches)
            calls = count_calls(ours)
            kernels = len(launches) - before if stub else None
            us = time_calls(ours, reps, device=device)
        if device.type == "cpu":  # torch computes for real there: its host cost is its time on the least work
            sdpa = make_case(name, device, dtype, 1, (1, 1, 1, 16))[1]
        with torch.no_grad():
            sdpa_us = time_calls(sdpa, reps, device=device)
        rows.append(
            dict(
                case=name,
                calls=calls,
                us=round(us, 1),
                sdpa_us=round(sdpa_us, 1),
                ratio=round(us / sdpa_us, 2),
                launches=kernels,
                stubbed=stub,
            )
        )
    return rows


def markdown(rows: list[dict], context: str) -> str:
    lines = [
        context,
        "",
        "| case | Python calls | host us per call | SDPA us per call | ratio | launches stubbed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        stubbed = "yes" if r["stubbed"] else "no"
        lines.append(f"| {r['case']} | {r['calls']} | {r['us']} | {r['sdpa_us']} | {r['ratio']} | {stubbed} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="torch device, default cuda if available else cpu")
    parser.add_argument(
        "--dtype", default=None, help="float16 or bfloat16 (default: bfloat16 on a GPU, float16 on a CPU)"
    )
    parser.add_argument(
        "--cache", type=int, default=None, help=f"key rows (default {CACHE_GPU} on a GPU, {CACHE_CPU} on a CPU)"
    )
    parser.add_argument(
        "--launch",
        choices=("stubbed", "real"),
        default="stubbed",
        help="stubbed: no kernel runs, the host path alone (default); real: Triton launches too (GPU only)",
    )
    parser.add_argument("--case", action="append", choices=CASES, help="case to run (repeatable); default: all")
    parser.add_argument("--reps", type=int, default=200, help="calls per timed round (5 rounds, median)")
    parser.add_argument("--json", help="write the context and rows as JSON to this file")


def run(args, command: str = "python -m flash_recipe.tools.host_cost") -> int:
    """Measure and print the table (``command``: how it was invoked, for the context line)."""
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Without a GPU the Triton path ends in the interpreter's launch (stubbed here), which must
        # be chosen before Triton is first imported; the triton backend says so if it was not.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.launch == "real" and device.type != "cuda":
        print("flash-recipe bench --host: --launch real needs a GPU", file=sys.stderr)
        return 2
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float16")
    if dtype_name not in ("float16", "bfloat16"):
        print(f"flash-recipe bench --host: --dtype must be float16 or bfloat16, got {dtype_name!r}", file=sys.stderr)
        return 2
    cache = args.cache or (CACHE_GPU if device.type == "cuda" else CACHE_CPU)
    batch, nheads, nheads_k, head_dim = SHAPE
    context = (
        f"host cost per call: device {device}, {time.strftime('%Y-%m-%d')}, flash_recipe {__version__}, "
        f"torch {torch.__version__}, B{batch} H{nheads} Hk{nheads_k} D{head_dim}, {cache} key rows, {dtype_name}, "
        f"launches {args.launch}; command: {command}".rstrip()
    )
    rows = measure(device, getattr(torch, dtype_name), cache, args.launch == "stubbed", args.reps, args.case or CASES)
    print(markdown(rows, context), end="")
    if args.json:
        files.write_json(args.json, {"context": context, "rows": rows})
    return 0


def main(argv: Optional[list] = None, prog: str = "python -m flash_recipe.tools.host_cost") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description="host cost per attention call, beside torch SDPA's")
    add_arguments(parser)
    return run(parser.parse_args(argv), " ".join([prog, *argv]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
