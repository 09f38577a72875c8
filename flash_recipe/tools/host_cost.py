"""``flash-recipe bench --host``: what one attention call costs the host, beside torch SDPA's.

A decoding step calls attention once per layer, and at batch 1-32 the GPU finishes the kernel
sooner than Python can issue the next one: the host path, not the kernel, sets the speed. This
module measures that path two ways:

- **Python function calls per call** (``count_calls``): every function frame entered, generator
  resumptions included (``sys.setprofile``'s ``call`` events). Deterministic, so CI bounds it
  (``tests/test_host_cost.py``).
- **Microseconds per call** (``time_calls``): wall clock of calls issued back to back, no
  synchronisation inside the timed region (a GPU runs the kernels behind the host; the device is
  synchronised before the clock starts and after it stops, outside the measurement). Rounds of
  flash_recipe's call and of torch SDPA's alternate (``time_beside``), and the ratio is the median
  of the rounds' ratios.

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

import torch
from torch.profiler import ProfilerActivity, profile

from .. import __version__, atomic_json, memo_keys, validate
from ..api import flash_attn_func
from ..decoding import flash_attn_with_kvcache
from ..dispatch import capabilities, use_backend

CASES = ("fwd", "fwd_autograd", "kvcache", "fwd_bwd")
# Shapes: (batch, nheads, nheads_k, head_dim); the cache rows differ on a GPU and on the CPU.
SHAPE = (8, 32, 8, 128)
CACHE_GPU, CACHE_CPU = 8192, 256


@contextlib.contextmanager
def stubbed_launches() -> Iterator[list]:
    """Inside the block no Triton kernel compiles or runs: each launch is recorded as ``(jit
    function, args, kwargs)`` in the list this yields and returns at once. Replaces
    ``JITFunction.run`` (a GPU's launch) and the interpreter's ``InterpretedFunction.run``, the calls
    every launch ends in (``warmup`` lists the variants a step launches with it)."""
    from triton.runtime import interpreter, jit  # on use: bench imports this module where Triton may be absent

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
    counts = calls_by_origin(fn)
    counts.pop("comprehensions", None)  # already counted by origin
    return sum(counts.values())


# Where a frame's code lives, by the first of these path parts its file name holds.
ORIGINS = tuple((name, f"{os.sep}{name}{os.sep}") for name in ("flash_recipe", "triton", "torch"))


# The frames Python 3.11 enters for list, dict and set comprehensions, which 3.12 inlines (PEP 709).
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>")


def calls_by_origin(fn: Callable[[], object]) -> dict[str, int]:
    """``count_calls`` split by where each frame's code lives: ``flash_recipe``, ``triton``,
    ``torch`` or ``other`` (the standard library, the caller); and ``comprehensions``, where any
    were entered: those of the calls that were comprehensions (``COMPREHENSIONS``), which Python
    3.12 and newer would not count."""
    counts = dict.fromkeys((*(name for name, _ in ORIGINS), "other"), 0)
    origin_of: dict = {}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            origin = origin_of.get(code)
            if origin is None:
                name = code.co_filename
                origin = origin_of[code] = next((o for o, part in ORIGINS if part in name), "other")
            counts[origin] += 1
            if code.co_name in COMPREHENSIONS:
                counts["comprehensions"] = counts.get("comprehensions", 0) + 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    counts["other"] -= 1  # fn's own frame
    return counts


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Inside the block each launch still runs, through ``JITFunction.run`` (the direct launch off:
    ``ops.direct.ENABLED``), and is recorded as ``(kernel name, keyword arguments)`` in the list
    this yields (the wrapper's frames are never counted: the block holds no counted or timed
    call). Plans made in the block learn no direct launch: call it after a signature's first two."""
    from triton.runtime import jit  # on use: bench imports this module where Triton may be absent

    from ..ops import direct  # after ``run`` has set TRITON_INTERPRET (read as the kernels are jitted)

    launches: list = []
    run, enabled = jit.JITFunction.run, direct.ENABLED

    def recording(self, *args, **kwargs):
        launches.append((getattr(self, "__name__", repr(self)), len(args) + len(kwargs) - 2))  # less grid, warmup
        return run(self, *args, **kwargs)

    jit.JITFunction.run, direct.ENABLED = recording, False
    try:
        yield launches
    finally:
        jit.JITFunction.run, direct.ENABLED = run, enabled


def time_calls(fn: Callable[[], object], reps: int = 200, rounds: int = 5, device=None, warmup: int = 3) -> float:
    """Median over ``rounds`` of the microseconds per call of ``reps`` calls issued back to back,
    after ``warmup`` calls; a CUDA ``device`` is synchronised before and after each round, outside
    the clock."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
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


def time_beside(
    fn: Callable[[], object],
    peer: Callable[[], object],
    peer_context: Callable,
    reps: int = 200,
    rounds: int = 5,
    device=None,
) -> tuple[float, float, float]:
    """``(fn's, peer's microseconds per call, their ratio)``: each of ``rounds`` rounds times ``reps``
    calls of ``fn`` back to back, then ``reps`` of ``peer`` inside ``peer_context()``, so that both
    see the machine as it is in that round (a shared CPU's speed can change by half between
    seconds); the medians of the rounds, and the median of the rounds' ratios."""
    ours, theirs = [], []
    for _ in range(3):  # warm
        fn()
        with peer_context():
            peer()
    for _ in range(rounds):
        ours.append(time_calls(fn, reps, 1, device, warmup=0))
        with peer_context():
            theirs.append(time_calls(peer, reps, 1, device, warmup=0))
    ratios = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios)


def make_case(name: str, device, dtype, cache: int, shape: tuple = SHAPE) -> tuple[Callable, Callable]:
    """``(flash_recipe call, torch SDPA call)`` of case ``name`` on new tensors."""
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
        if name != "fwd":
            q.requires_grad_(True)
        if name == "fwd_bwd":
            k.requires_grad_(True)
            v.requires_grad_(True)
        grad = torch.ones_like(q)

        def ours():
            out = flash_attn_func(q, k, v, causal=True)
            if name == "fwd_bwd":
                out.backward(grad)
            return out

        sdpa_k, sdpa_v = k.transpose(1, 2), v.transpose(1, 2)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, enable_gqa=True)
        if name == "fwd_bwd":
            out.backward(torch.ones_like(out))
        return out

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
        memo_keys.forget()  # verdicts reached without reading host metadata must not outlive the block


def _launch_row(launch) -> tuple[str, int]:
    """``(kernel name, arguments)`` of a launch as ``stubbed_launches`` or ``recorded_launches`` keeps it."""
    if len(launch) == 2:
        return launch
    fn, args, kwargs = launch
    return getattr(fn, "__name__", repr(fn)), len(args) + len(kwargs)


def measure(device, dtype, cache: int, stub: bool, reps: int = 200, cases=CASES) -> list[dict]:
    """One row per case: Python calls (by origin) and microseconds per call of flash_recipe's call on
    the triton backend, the launches of one call and their arguments, and torch SDPA's microseconds
    beside it. ``stub``: Triton's launch replaced by a recorder (this package's own path alone);
    else Triton's launch runs (on a GPU, or on the stub driver: ``stub_driver.stub_cuda``)."""
    rows = []
    for name in cases:
        ours, sdpa = make_case(name, device, dtype, cache)
        if device.type == "cpu":  # torch computes for real there: its host cost is its time on the least work
            sdpa = make_case(name, device, dtype, 1, (1, 1, 1, 16))[1]
        sdpa_context = torch.no_grad if name != "fwd_bwd" else contextlib.nullcontext
        with use_backend("triton"), device_metadata(device):
            if stub:
                with stubbed_launches() as launches:
                    ours()  # the first call of the signature: checks, choices, plans
                    before = len(launches)
                    ours()  # one call recorded: its launches and their arguments
                    launched = [_launch_row(launch) for launch in launches[before:]]
                    by_origin = calls_by_origin(ours)
                    us, sdpa_us, ratio = time_beside(ours, sdpa, sdpa_context, reps, device=device)
            else:
                ours()  # the first call of the signature: checks, choices, plans
                ours()  # the second: each plan learns its direct launch (``ops.direct``)
                ours()  # the third: each plan's first direct launch learns the launcher's own call (INNER)
                with recorded_launches() as launches:
                    ours()  # one call recorded: its launches and their arguments
                launched = [_launch_row(launch) for launch in launches]
                by_origin = calls_by_origin(ours)
                us, sdpa_us, ratio = time_beside(ours, sdpa, sdpa_context, reps, device=device)
        comprehensions = by_origin.pop("comprehensions", 0)
        rows.append(
            dict(
                case=name,
                calls=sum(by_origin.values()),
                comprehensions=comprehensions,
                calls_by_origin=by_origin,
                us=round(us, 1),
                sdpa_us=round(sdpa_us, 1),
                ratio=round(ratio, 2),
                launches=len(launched),
                arguments=[count for _, count in launched],
                kernels=[kernel for kernel, _ in launched],
                stubbed=stub,
            )
        )
    return rows


def profile_case(name: str, device, dtype, cache: int, calls: int = 50, top: int = 12) -> list[dict]:
    """The ``top`` entries by self CPU time of ``calls`` repeated calls of case ``name`` under
    ``torch.profiler`` (CPU activity, and CUDA's on a GPU), after the first three calls of the signature:
    what a call's host time goes to below Python (the autograd graph, allocations, the driver's
    launch), per call. Each entry: ``name``, ``calls`` (per call), ``self_cpu_us`` (per call)."""
    ours, _ = make_case(name, device, dtype, cache)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with use_backend("triton"), device_metadata(device):
        for _ in range(3):  # plans made, direct launches learnt (``measure``)
            ours()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                ours()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {"name": e.key, "calls": round(e.count / calls, 2), "self_cpu_us": round(e.self_cpu_time_total / calls, 2)}
        for e in events
    ]


def markdown(rows: list[dict], context: str) -> str:
    lines = [
        context,
        "",
        "| case | Python calls (flash_recipe / triton / torch / other) | comprehensions | host us per call | "
        "SDPA us per call | ratio | launches (arguments each) | Triton's launch |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        split = " / ".join(str(n) for n in r["calls_by_origin"].values())
        launches = f"{r['launches']} ({'/'.join(map(str, r['arguments']))})"
        launch = "recorder" if r["stubbed"] else "runs"
        lines.append(
            f"| {r['case']} | {r['calls']} ({split}) | {r['comprehensions']} | {r['us']} | {r['sdpa_us']} "
            f"| {r['ratio']} | {launches} | {launch} |"
        )
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
        choices=("driver", "recorder"),
        default="driver",
        help="driver: Triton's launch runs, on the GPU's driver or, on a CPU, the stub driver "
        "(flash_recipe.tools.stub_driver; default); recorder: Triton's launch replaced by a recorder, "
        "this package's own path alone",
    )
    parser.add_argument(
        "--target", default="sm90", help="on a CPU with --launch driver: the GPU target the stub driver reports"
    )
    parser.add_argument("--case", action="append", choices=CASES, help="case to run (repeatable); default: all")
    parser.add_argument("--reps", type=int, default=200, help="calls per timed round (5 rounds, median)")
    parser.add_argument("--json", help="write the context and rows as JSON to this file")


@contextlib.contextmanager
def gpu_route(target: str) -> Iterator[None]:
    """On a CPU: CPU tensors take the path a GPU's take, down to Triton's own launcher on the stub
    driver (``stub_driver.stub_cuda``). This package is told so at the two decisions it takes by
    device: the compile target (``targets.target_of``) and the triton backend's check of the CPU
    (``capabilities.interpreter_problem``, answered None); a KV-cache step's split count is the
    rule's for the stub's multiprocessors (``kvcache.heuristic_splits``; no tuned table). Metadata
    is treated as device memory (``device_metadata``)."""
    # The kernels after ``run`` has set TRITON_INTERPRET, which Triton reads as they are jitted.
    from ..ops import kvcache, targets
    from .stub_driver import STUB_SMS, stub_cuda  # imports Triton: as the kernels, after TRITON_INTERPRET

    def splits_as_on_the_stub(*args):
        return kvcache.heuristic_splits(*args, sms=STUB_SMS)

    saved = targets.target_of, capabilities.interpreter_problem, kvcache.auto_splits
    targets.target_of = lambda device: target
    capabilities.interpreter_problem = lambda: None
    kvcache.auto_splits = splits_as_on_the_stub
    try:
        with stub_cuda(target):
            yield
    finally:
        targets.target_of, capabilities.interpreter_problem, kvcache.auto_splits = saved


def run(args, command: str = "python -m flash_recipe.tools.host_cost") -> int:
    """Measure and print the table (``command``: how it was invoked, for the context line)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stub_driver = device.type == "cpu" and args.launch == "driver"
    if device.type == "cpu":
        # Chosen before Triton is first imported: the stub driver stands below Triton's compiler;
        # the recorder, on a CPU, replaces the interpreter's launch.
        os.environ["TRITON_INTERPRET"] = "0" if stub_driver else "1"
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float16")
    if dtype_name not in ("float16", "bfloat16"):
        print(f"flash-recipe bench --host: --dtype must be float16 or bfloat16, got {dtype_name!r}", file=sys.stderr)
        return 2
    cache = args.cache or (CACHE_GPU if device.type == "cuda" else CACHE_CPU)
    batch, nheads, nheads_k, head_dim = SHAPE
    import triton  # after TRITON_INTERPRET is set, above

    launch = f"the stub driver as {args.target}" if stub_driver else args.launch
    context = (
        f"host cost per call: device {device}, {time.strftime('%Y-%m-%d')}, flash_recipe {__version__}, "
        f"torch {torch.__version__}, triton {triton.__version__}, Python {sys.version.split()[0]}, "
        f"B{batch} H{nheads} Hk{nheads_k} D{head_dim}, {cache} key rows, {dtype_name}, "
        f"Triton's launch: {launch}; command: {command}".rstrip()
    )
    route = gpu_route(args.target) if stub_driver else contextlib.nullcontext()
    with route:
        rows = measure(
            device, getattr(torch, dtype_name), cache, args.launch == "recorder", args.reps, args.case or CASES
        )
    print(markdown(rows, context), end="")
    if args.json:
        atomic_json.write_json(args.json, {"context": context, "rows": rows})
    return 0


def main(argv: Optional[list] = None, prog: str = "python -m flash_recipe.tools.host_cost") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description="host cost per attention call, beside torch SDPA's")
    add_arguments(parser)
    return run(parser.parse_args(argv), " ".join([prog, *argv]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
