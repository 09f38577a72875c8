"""How ``flash-recipe bench`` times a peer, and when a time is not the peer's own speed.

Timing (``Timer``), the way ``triton.testing.do_bench`` does it: warm-up calls first; then on a
GPU the repetitions are issued back to back, each between its own pair of CUDA events, with the L2
cache flushed before each, outside the pair, and one synchronisation after the last; the median of
the per-repetition times is reported, with the host time spent issuing each call beside it. On the
CPU each call is timed with the wall clock.

Verdicts (``judge``, pure functions of what the timer saw): a mode whose timed repetitions made
torch.compile compile anything, a peer that fell back to eager code under torch.compile, and a
mode whose peak memory says the S x S scores were materialised are errors with the reason.
A shape is anything with ``batch``, ``seqlen``, ``nheads``, ``head_dim`` and ``flops(mode)``
(``bench.Shape``).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

# The buffer overwritten before each timed repetition on a GPU, to flush L2: 256 MiB as
# triton.testing.do_bench writes, or twice the L2 torch reports if that is more.
FLUSH_BYTES = 256 * 2**20


class CudaClock:
    """What ``_Timer`` needs from CUDA: timing events, an L2 flush, one synchronisation and the
    allocator's peak. Tests pass a recorder with the same methods instead."""

    def __init__(self) -> None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        self._flush = torch.empty(max(FLUSH_BYTES, 2 * int(l2)), dtype=torch.int8, device="cuda")
        self._base = 0

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def flush(self) -> None:
        self._flush.zero_()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def mark(self) -> None:
        """Start a peak-memory measurement from what is allocated now."""
        torch.cuda.reset_peak_memory_stats()
        self._base = torch.cuda.memory_allocated()

    def peak(self) -> int:
        """The most bytes allocated above the mark since it was set."""
        return torch.cuda.max_memory_allocated() - self._base


def dynamo_counters() -> dict[str, int]:
    """torch.compile's activity so far, from dynamo's counters: frames it compiled, graphs it made,
    and one entry per graph-break or unsupported message (dynamo's recompile limit is one: past it
    dynamo runs the frame's eager code). Empty if dynamo was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    counters = utils.counters
    snapshot = {"frames compiled": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"]}
    for category, label in (("graph_break", "graph break"), ("unimplemented", "unsupported")):
        for message, count in counters[category].items():
            key = f"{label}: {(str(message).strip().splitlines() or ['?'])[0][:120]}"
            snapshot[key] = snapshot.get(key, 0) + count
    return snapshot


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters of ``after`` that are larger than in ``before``, by how much."""
    return {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}


def fresh_dynamo() -> None:
    """Clear dynamo's compiled code (if torch.compile was used at all), so the peer about to be
    measured compiles each shape afresh and never meets dynamo's recompile limit."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@dataclasses.dataclass(frozen=True)
class Timing:
    """One mode of one peer on one shape: ``ms`` median time per repetition (CUDA events on a GPU,
    wall clock on the CPU), ``host_us`` median host time issuing each call, ``peak_bytes`` the most
    allocated during the repetitions above what was allocated before them (None without CUDA),
    ``compiled`` dynamo's counters that grew during the repetitions (``dynamo_counters``)."""

    ms: float
    host_us: float
    peak_bytes: Optional[int]
    compiled: dict[str, int]


class Timer:
    """Times ``fn()`` over ``reps`` repetitions after ``warmup`` calls, like do_bench.

    With a ``clock`` (``CudaClock`` on a GPU): each repetition runs ``setup()``, flushes L2, then
    ``fn()`` between its own pair of events; nothing synchronises until all are issued. Without
    one: the wall clock around each ``fn()``. ``now`` (seconds) times the host's part of each call;
    ``probe`` reads dynamo's counters before and after the repetitions."""

    def __init__(
        self,
        device_type: str,
        warmup: int,
        reps: int,
        clock: Optional[Any] = None,
        now: Callable[[], float] = time.perf_counter,
        probe: Callable[[], dict[str, int]] = dynamo_counters,
    ):
        if reps < 1:
            raise ValueError(f"--reps must be at least 1, got {reps}")
        if warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {warmup}")
        self.warmup, self.reps, self.now, self.probe = warmup, reps, now, probe
        self.clock = clock if clock is not None or device_type != "cuda" else CudaClock()

    def __call__(self, fn: Callable[[], Any], setup: Optional[Callable[[], None]] = None) -> Timing:
        for _ in range(self.warmup):
            if setup:
                setup()
            fn()
        clock, now = self.clock, self.now
        if clock is not None:
            clock.synchronize()  # the warm-up's work is done before the first repetition is issued
            clock.mark()
        before = self.probe()
        host = []
        if clock is None:
            for _ in range(self.reps):
                if setup:
                    setup()
                begin = now()
                fn()
                host.append(now() - begin)
            times = [seconds * 1e3 for seconds in host]
        else:
            pairs = [(clock.event(), clock.event()) for _ in range(self.reps)]
            for start, end in pairs:
                if setup:
                    setup()
                clock.flush()
                start.record()
                begin = now()
                fn()
                host.append(now() - begin)
                end.record()
            clock.synchronize()
            times = [start.elapsed_time(end) for start, end in pairs]
        compiled = grown(before, self.probe())
        peak = clock.peak() if clock is not None else None
        return Timing(statistics.median(times), statistics.median(host) * 1e6, peak, compiled)


# ----------------------------------------------------------------------------- verdicts (pure)

# Peers that are the unfused path by name: their S x S scores are what they are, not a fallback.
UNFUSED_PEERS = frozenset({"sdpa_math"})

# What a fused kernel may allocate per element of q (batch x seqlen_q x nheads x head_dim) during
# a timed repetition: 32 bytes, sixteen half-precision tensors the size of q. flash-attn 2's
# backward, counted from its source, allocates about 6.5 (the output kept from the forward, dq,
# dk and dv expanded to the query heads under GQA, an fp32 dq accumulator); the rest is room for
# peers with larger workspaces. No GPU run has yet checked every peer against it.
LINEAR_BYTES = 32


def scores_bytes(shape) -> int:
    """One S x S half-precision score matrix per batch and head: ``B * H * Sq * Sk * 2``."""
    return shape.batch * shape.nheads * shape.seqlen_q * shape.seqlen_k * 2


def memory_bound(shape) -> float:
    """The most a fused attention may allocate above its inputs during a repetition, in bytes:
    ``LINEAR_BYTES`` per element of q plus a quarter of ``scores_bytes``.

    An unfused path holds the scores and their softmax at once (softmax is not in place; or the
    scores once in fp32), at least ``2 * scores_bytes``: per row of q and head that is 4 S bytes
    against the bound's 32 D + S / 2, exceeded once S > 9.14 D (S >= 2341 at head dim 256), so at
    every S >= 4096 for head dims up to 256. One half-precision matrix alone exceeds it from
    S > 21.3 D (S >= 4096 up to head dim 128)."""
    elements = shape.batch * shape.seqlen_q * shape.nheads * shape.head_dim
    return LINEAR_BYTES * elements + scores_bytes(shape) / 4


def memory_verdict(peak_bytes: Optional[int], shape) -> Optional[str]:
    """None, or why ``peak_bytes`` (above the inputs, during one mode's repetitions) is not a fused
    kernel's."""
    if peak_bytes is None or peak_bytes <= memory_bound(shape):
        return None
    return (
        f"peak memory {peak_bytes / 2**20:.1f} MiB suggests S^2 scores were materialised (fell back to an "
        f"unfused path): a fused kernel stays under {memory_bound(shape) / 2**20:.1f} MiB at this shape"
    )


def recompile_verdict(compiled: dict[str, int]) -> Optional[str]:
    """None, or the error for dynamo counters that grew during the timed repetitions."""
    if not compiled:
        return None
    return "recompiled during the timed region (" + ", ".join(f"{k} +{n}" for k, n in sorted(compiled.items())) + ")"


def fallback_verdict(since_start: dict[str, int]) -> Optional[str]:
    """None, or the error for graph breaks or unsupported code (such as dynamo's recompile limit)
    met anywhere in a peer's shape: under torch.compile, the code around them ran eagerly."""
    fell = sorted(key for key in since_start if key.startswith(("graph break", "unsupported")))
    if not fell:
        return None
    return "fell back to eager code under torch.compile (" + "; ".join(fell) + ")"


def judge(shape, timings: dict[str, Timing], since_start: dict[str, int], unfused: bool = False) -> dict:
    """The row's figures from its ``timings`` per mode: ms, host us, TFLOP/s and peak MiB, unless a
    verdict says they are not the peer's own speed. Then the mode keeps no figure but its peak,
    and ``error`` gives the reason (per mode), or the fallback for the whole row.
    ``since_start``: dynamo's counters that grew during the whole shape; ``unfused``: the peer is
    an unfused path by name (``UNFUSED_PEERS``), exempt from the memory bound."""
    result: dict = {}
    fallback = fallback_verdict(since_start)
    failures = []
    for mode in timings:
        timing = timings[mode]
        if timing.peak_bytes is not None:
            result[f"{mode}_peak_mb"] = timing.peak_bytes / 2**20
        reason = fallback or recompile_verdict(timing.compiled)
        if reason is None and not unfused:
            reason = memory_verdict(timing.peak_bytes, shape)
        if reason is not None:
            failures.append(f"{mode}: {reason}")
            continue
        result[f"{mode}_ms"] = timing.ms
        result[f"{mode}_host_us"] = timing.host_us
        if timing.ms > 0:
            result[f"{mode}_tflops"] = shape.flops(mode) / (timing.ms * 1e-3) / 1e12
    peaks = [result[f"{m}_peak_mb"] for m in timings if f"{m}_peak_mb" in result]
    if peaks:
        result["peak_mb"] = max(peaks)
    if fallback is not None:
        result["error"] = fallback
    elif failures:
        result["error"] = "; ".join(failures)
    return result
