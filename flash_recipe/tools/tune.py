"""``flash-recipe tune``: time launch configurations on the local GPU and keep the fastest.

For each kernel (``fwd``, ``fwd_general``, ``bwd_dkdv``, ``bwd_dq``, ``decode``; the general forward
is timed and checked on a softcapped call), head-dim bucket and element size
(2 for fp16 and bf16, which share their tiles; 4 for fp32), the tuner

1. takes the candidates: the table's own configuration, then a small grid (``GRID``);
2. prunes them by the launch-specialised shared-memory fit: each candidate is compiled for the
   GPU's own compile target through the real launchers, as ``flash_recipe.tools.compile_check``
   compiles a launch (``aligned`` and ``ragged`` forms), and dropped when its kernel needs more
   shared memory per block than the architecture offers (``configs.SHARED_MEMORY_LIMIT``) or
   compiles to a trap;
3. checks each remaining candidate's output on small aligned and ragged shapes against the fp32
   reference by the accuracy rule (at most 2x the error of PyTorch in the input precision for
   the output, 3x for the gradients, plus 1e-5), with output buffers filled with NaN first: a
   candidate that computes anything else, or leaves a tile unwritten, is rejected;
4. times it through the real launcher (``ops.forward.attention_forward``,
   ``ops.backward.attention_backward``, ``ops.kvcache.attention_kvcache``) inside
   ``configs.overriding`` (``triton.testing.do_bench``, median, L2 flushed between runs) on the
   timing shapes: each sequence length at about ``tokens`` tokens per batch, causal and not; a
   decoding step (one query row, GQA 4:1) per batch size and cache length. The backward's
   configurations are timed as the whole backward with only the tuned kernel changed;
5. keeps the candidate with the least geometric mean, over the timing shapes and dtypes, of its
   time divided by the table's, if that is at most ``1 - min_gain``; else the table's.

Decoding's split-KV count is tuned after the decode configuration: each of ``splits`` is checked,
then timed per batch size and cache length, and the fastest is kept per bucket of programs
(``batch * nheads``) and cache length when it beats ``kvcache.heuristic_splits`` by ``min_gain``.

The winners are written to the per-device cache (``flash_recipe.ops.tuned``: where it lives, its
format, its key), which ``configs.launch_config`` and ``kvcache.auto_splits`` read from then on. A
run covers what it is asked for and keeps the file's other entries.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Callable, NamedTuple, Optional

from flash_recipe.ops import configs, tuned
from flash_recipe.ops.configs import Config
from flash_recipe.testing import FACTORS, accuracy_bound, max_error

KERNELS = configs.KERNELS
HEAD_DIMS = tuned.HEAD_DIM_BUCKETS
DTYPES = ("float16", "bfloat16", "float32")
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SPLITS = (1, 2, 4, 8, 16, 32, 64)
# The call ``compile_check`` makes to compile each kernel.
COMPILE_CALL = {"fwd": "fwd", "fwd_general": "options", "bwd_dkdv": "bwd", "bwd_dq": "bwd", "decode": "decode"}
# The candidate grid per kernel: block_m, block_n, num_warps, num_stages. Decoding has one to
# sixteen query rows, so its query block is the smallest matrix-unit tile.
GRID = {
    "fwd": ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)),
    "fwd_general": ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)),
    "bwd_dkdv": ((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)),
    "bwd_dq": ((32, 64, 128), (16, 32, 64), (4, 8), (1, 2, 3)),
    "decode": ((16,), (32, 64, 128, 256), (4, 8), (1, 2, 3, 4)),
}
# Eight warps only on tiles of at least this many elements: on smaller ones most of them idle.
EIGHT_WARPS_MIN_TILE = 64 * 64
GENERAL_SOFTCAP = 50.0


class TuneError(RuntimeError):
    """Tuning cannot run as asked (no GPU, no timer, a target without tables)."""


class Shape(NamedTuple):
    """A launch's sizes: q ``(batch, seqlen_q, nheads, head_dim)``, k and v ``(batch, seqlen_k,
    nheads_k, head_dim)``; for ``decode`` a dense cache of ``seqlen_k`` rows per batch entry, of
    which ``lengths`` (one per batch entry; None: all) are filled."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    causal: bool
    lengths: Optional[tuple] = None

    @property
    def id(self) -> str:
        sizes = f"B{self.batch}-H{self.nheads}-Hk{self.nheads_k}-D{self.head_dim}-Sq{self.seqlen_q}"
        if self.lengths is not None:
            return f"{sizes}-cache{self.seqlen_k}-filled{'.'.join(map(str, self.lengths))}"
        return f"{sizes}-Sk{self.seqlen_k}-{'causal' if self.causal else 'full'}"


class Trial(NamedTuple):
    """What a timer is asked to time: ``kernel`` in ``dtype`` on ``shape`` with ``config`` (and,
    for decoding, ``num_splits``)."""

    kernel: str
    dtype: str
    shape: Shape
    config: Config
    num_splits: Optional[int] = None


# A timer maps (a function that launches once, what it launches) to milliseconds per launch.
Timer = Callable[[Callable[[], Any], Trial], float]


@dataclasses.dataclass(frozen=True)
class CheckSizes:
    """The shapes every candidate's output is checked on: ``batch`` x ``nheads`` query heads over
    ``nheads_k`` key heads, each ``(seqlen_q, seqlen_k)`` of ``seqlens`` (one a multiple of every
    block, one ragged, aligned bottom-right), and for decoding a cache of ``cache_len`` rows filled
    to ``cache_len``, about two thirds of it and 1 row."""

    batch: int = 2
    nheads: int = 4
    nheads_k: int = 2
    seqlens: tuple = ((256, 256), (113, 203))
    cache_len: int = 256

    def shapes(self, kernel: str, head_dim: int, causal: tuple) -> list[Shape]:
        if kernel == "decode":
            lengths = (self.cache_len, max(1, 2 * self.cache_len // 3 | 1), 1)
            return [Shape(len(lengths), 1, self.cache_len, self.nheads, self.nheads_k, head_dim, True, lengths)]
        return [
            Shape(self.batch, sq, sk, self.nheads, self.nheads_k, head_dim, c)
            for (sq, sk), c in itertools.product(self.seqlens, causal)
        ]


def describe(config) -> str:
    """``Config(128, 64, 8, 3)`` -> ``"128x64 w8 s3"``."""
    return f"{config[0]}x{config[1]} w{config[2]} s{config[3]}"


# -- candidates and pruning -------------------------------------------------------------------


def candidates(kernel: str, table: Config, grid: Optional[dict] = None) -> list[Config]:
    """The table's configuration first, then ``grid[kernel]`` (a list of configs, default ``GRID``'s
    product, with eight warps only on tiles of at least ``EIGHT_WARPS_MIN_TILE`` elements), each once."""
    if grid is not None and kernel in grid:
        found = [Config(*c) for c in grid[kernel]]
    else:
        found = [
            Config(*c) for c in itertools.product(*GRID[kernel]) if c[2] < 8 or c[0] * c[1] >= EIGHT_WARPS_MIN_TILE
        ]
    return list(dict.fromkeys([Config(*table)] + found))


def _compile_one(job: tuple) -> list[dict]:
    """Compile one candidate in one form for a target; one row per compiled launch of the kernel."""
    from flash_recipe.tools import compile_check

    kernel, head_dim, dtype, config, target, form = job
    row = {"kernel": kernel, "config": list(config), "form": form, "target": target}
    try:
        with configs.overriding(kernel, head_dim, ELEMENT_SIZE[dtype], Config(*config)):
            compiled = compile_check.check_case(compile_check.Case(COMPILE_CALL[kernel], dtype, head_dim, form), target)
    except Exception as exc:  # a candidate the compiler refuses is dropped, with the reason
        return [{**row, "fits": False, "problem": f"does not compile: {type(exc).__name__}: {exc}"[:500]}]
    rows = []
    for found in compiled:
        if found["kernel"] != kernel:
            continue
        problems = []
        if found["shared_bytes"] > found["shared_limit"]:
            problems.append(
                f"needs {found['shared_bytes']} B of shared memory, {target} offers {found['shared_limit']} B"
            )
        if not found["stores"]:
            problems.append("compiles to a trap")
        rows.append(
            {
                **row,
                "shared_bytes": found["shared_bytes"],
                "shared_limit": found["shared_limit"],
                "fits": not problems,
                "problem": "; ".join(problems) or None,
            }
        )
    return rows or [{**row, "fits": False, "problem": f"the {COMPILE_CALL[kernel]} call launched no {kernel} kernel"}]


def prune(
    kernel: str,
    head_dim: int,
    dtype: str,
    found: list,
    target: str,
    forms: tuple = ("aligned", "ragged"),
    jobs: int = 1,
) -> tuple[list[Config], list[dict]]:
    """Keep the candidates that fit ``target``: compiled through the real launchers with a launch's
    specialisation (``compile_check.check_case``, in each of ``forms``), none may need more shared
    memory than ``configs.SHARED_MEMORY_LIMIT[target]`` or compile to a trap.

    Returns the kept configurations (in the given order) and one row per compiled kernel:
    ``config``, ``form``, ``shared_bytes``, ``shared_limit``, ``fits``, ``problem``. A candidate
    dropped in one form is not compiled in the next. Needs Triton's compiler (``TRITON_INTERPRET``
    unset); ``jobs > 1`` compiles in that many processes.
    """
    if configs.interpreter_enabled():
        raise TuneError("pruning compiles the kernels for the GPU: unset TRITON_INTERPRET")
    if target not in configs.SHARED_MEMORY_LIMIT:
        raise TuneError(f"no shared-memory limit on record for {target}; known: {sorted(configs.SHARED_MEMORY_LIMIT)}")
    kept, rows = [Config(*c) for c in found], []
    pool = None
    if jobs > 1 and len(found) > 1:
        import concurrent.futures
        import multiprocessing

        # Fresh processes: a forked copy of a process that has used the GPU must not touch it.
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        for form in forms:  # a candidate that fails one form is not compiled in the next
            work = [(kernel, head_dim, dtype, tuple(c), target, form) for c in kept]
            results = list(pool.map(_compile_one, work) if pool else map(_compile_one, work))
            rows += [row for result in results for row in result]
            bad = {tuple(row["config"]) for row in rows if not row["fits"]}
            kept = [c for c in kept if tuple(c) not in bad]
    finally:
        if pool:
            pool.shutdown()
    return kept, rows


# -- one launch on fixed inputs ---------------------------------------------------------------


@contextlib.contextmanager
def nan_outputs():
    """Kernel outputs start as NaN inside the block (``tiles.output_buffer``), so a tile a
    candidate leaves unwritten shows instead of reusing a previous launch's memory."""
    import torch

    from flash_recipe.ops import tiles

    allocate = tiles.output_buffer

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    tiles.output_buffer = nan_buffer
    try:
        yield
    finally:
        tiles.output_buffer = allocate


class Problem:
    """Inputs for one kernel in one dtype on one shape, drawn from ``seed``; ``launch()`` runs the
    launcher and returns the outputs the kernel decides (fwd, decode: ``out``; the backward kernels:
    ``dq, dk, dv``), and ``reference(upcast)`` the same from ``flash_recipe.reference``."""

    def __init__(self, kernel: str, dtype: str, shape: Shape, device, seed: int = 0):
        import torch

        from flash_recipe.ops import forward, kvcache
        from flash_recipe.ops.launch import ScoreOptions

        self.kernel, self.dtype, self.shape = kernel, dtype, shape
        gen = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)

        def draw(*size):
            return torch.randn(*size, generator=gen).to(device=device, dtype=dt)

        b, sq, sk, h, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_k, shape.head_dim
        self.scale = d**-0.5
        self.q, self.k, self.v = draw(b, sq, h, d), draw(b, sk, hk, d), draw(b, sk, hk, d)
        if kernel == "decode":
            lengths = shape.lengths or (sk,) * b
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
            table = torch.arange(b, dtype=torch.int32, device=device)[:, None]
            self.cache = kvcache.Cache(self.k, self.v, table, seqlens, None)
            self.options = ScoreOptions(0, -1, 0, 0.0, None)  # per-batch ranges align bottom-right
            self.lengths = lengths
            self.heuristic_splits = kvcache.heuristic_splits(b, h, sq, sk, self.q.device)
            return
        self.heuristic_splits = None  # decoding only
        # The general forward is timed on a softcapped call (Gemma 2's 50), one of the options it serves.
        softcap = GENERAL_SOFTCAP if kernel == "fwd_general" else 0.0
        self.options = ScoreOptions(sk - sq, -1, 0 if shape.causal else -1, softcap, None)
        if kernel in ("bwd_dkdv", "bwd_dq"):
            self.dout = draw(b, sq, h, d)
            self.out, self.lse = forward.attention_forward(self.q, self.k, self.v, self.scale, self.options)

    def launch(self, num_splits: Optional[int] = None) -> tuple:
        from flash_recipe.ops import backward, forward, kvcache

        if self.kernel in ("fwd", "fwd_general"):
            return (forward.attention_forward(self.q, self.k, self.v, self.scale, self.options)[0],)
        if self.kernel == "decode":
            splits = self.heuristic_splits if num_splits is None else num_splits
            return (
                kvcache.attention_kvcache(
                    self.q, None, None, self.cache, None, self.scale, self.options, num_splits=splits
                )[0],
            )
        return backward.attention_backward(
            self.dout, self.q, self.k, self.v, self.out, self.lse, self.scale, self.options
        )

    def reference(self, upcast: bool) -> tuple:
        import torch

        from flash_recipe.reference import attention_reference, compute_dtype

        if self.kernel == "decode":
            rows = [
                attention_reference(
                    self.q[i : i + 1], self.k[i : i + 1, :n], self.v[i : i + 1, :n], self.scale, True, upcast=upcast
                )[0]
                for i, n in enumerate(self.lengths)
            ]
            return (torch.cat(rows),)
        causal = self.shape.causal
        if self.kernel in ("fwd", "fwd_general"):
            softcap = self.options.softcap
            return (attention_reference(self.q, self.k, self.v, self.scale, causal, upcast=upcast, softcap=softcap)[0],)
        high = compute_dtype(self.q.dtype, upcast)
        leaves = [t.detach().to(high).requires_grad_(True) for t in (self.q, self.k, self.v)]
        out = attention_reference(*leaves, self.scale, causal, upcast=upcast)[0]
        out.backward(self.dout.to(out.dtype))
        return tuple(t.grad.detach() for t in leaves)


class Check:
    """A check shape with its truth (fp32 reference) and the accuracy rule's bounds."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.names = ("out",) if problem.kernel in ("fwd", "fwd_general", "decode") else ("dq", "dk", "dv")
        truth = problem.reference(upcast=True)
        same = problem.reference(upcast=False)
        self.truth = truth
        self.bounds = [accuracy_bound(max_error(s, t), FACTORS[n]) for n, s, t in zip(self.names, same, truth)]

    def problem_with(self, num_splits: Optional[int] = None) -> Optional[str]:
        """Why the launch's outputs break the accuracy rule here, or None."""
        with nan_outputs():
            got = self.problem.launch(num_splits)
        for name, g, t, bound in zip(self.names, got, self.truth, self.bounds):
            if not bool(g.isfinite().all()):
                return f"{name} is not finite on {self.problem.dtype} {self.problem.shape.id}"
            error = max_error(g, t)
            if error > bound:
                return f"{name} error {error:.3g} > {bound:.3g} on {self.problem.dtype} {self.problem.shape.id}"
        return None


# -- timing -----------------------------------------------------------------------------------


def gpu_timer(warmup_ms: int = 25, rep_ms: int = 100) -> Timer:
    """The default timer: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), median ms."""

    def timer(fn: Callable[[], Any], trial: Trial) -> float:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return timer


def timing_shapes(kernel: str, head_dim: int, seqlens, causal, tokens: int, nheads: int, decode_batches) -> list[Shape]:
    """fwd/bwd: each sequence length, batch ``max(1, tokens // seqlen)``, MHA, each of ``causal``;
    decode: one query row per batch entry of each ``decode_batches``, over a full cache of each
    length, with ``nheads // 4`` key heads when ``nheads`` is a multiple of 4 (else MHA)."""
    if kernel == "decode":
        nheads_k = nheads // 4 if nheads % 4 == 0 else nheads
        return [Shape(b, 1, s, nheads, nheads_k, head_dim, True) for s in seqlens for b in decode_batches]
    return [Shape(max(1, tokens // s), s, s, nheads, nheads, head_dim, c) for s in seqlens for c in causal]


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _first_failure(checks: list, splits_options=(None,)) -> Optional[str]:
    """The first check the current launch configuration fails, over ``splits_options``, or None."""
    for check in checks:
        for splits in splits_options:
            problem = check.problem_with(splits)
            if problem is not None:
                return problem
    return None


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _row(kernel: str, head_dim: int, element_size: int, config, status: str, detail: str = "") -> dict:
    """One candidate's row of the report (``ms``: milliseconds per timing shape, filled when timed)."""
    return {
        "kernel": kernel,
        "head_dim": head_dim,
        "element_size": element_size,
        "config": list(config),
        "status": status,
        "detail": detail,
        "ms": {},
    }


@dataclasses.dataclass
class _Tuner:
    """One tuning run's settings (see ``tune``) and where it reports."""

    device: Any
    target: str
    timer: Timer
    grid: Optional[dict]
    prune: bool
    jobs: int
    check: CheckSizes
    causal: tuple
    seqlens: tuple
    tokens: int
    nheads: int
    decode_batches: tuple
    splits: tuple
    min_gain: float
    progress: Optional[Callable[[str], None]]

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def checks(self, kernel: str, head_dim: int, dtypes: list, causal: tuple) -> list[Check]:
        return [
            Check(Problem(kernel, dtype, shape, self.device, seed=i))
            for dtype in dtypes
            for i, shape in enumerate(self.check.shapes(kernel, head_dim, causal))
        ]

    def timed(self, kernel: str, head_dim: int, dtypes: list) -> list[Problem]:
        shapes = timing_shapes(
            kernel, head_dim, self.seqlens, self.causal, self.tokens, self.nheads, self.decode_batches
        )
        return [
            Problem(kernel, dtype, shape, self.device, seed=100 + i)
            for dtype in dtypes
            for i, shape in enumerate(shapes)
        ]

    def pruned(self, kernel: str, head_dim: int, dtype: str, found: list, table: Config) -> tuple[list, list]:
        """The candidates to check and time, and the compile rows (none without pruning)."""
        if not self.prune or self.target not in configs.SHARED_MEMORY_LIMIT:
            return found, []
        kept, rows = prune(kernel, head_dim, dtype, found, self.target, jobs=self.jobs)
        if table not in kept:
            kept.insert(0, table)  # the baseline: what runs untuned (the compile check covers it)
        return kept, rows

    def trial(self, kernel: str, head_dim: int, element_size: int, config: Config, checks: list, timed: list) -> dict:
        """Check ``config`` on ``checks`` and, when it computes the right thing, time it on each of
        ``timed``; one trial row, status ``ok``, ``wrong`` or ``error``."""
        row = _row(kernel, head_dim, element_size, config, "ok")
        splits_checked = (1, 3) if kernel == "decode" else (None,)  # one share, and uneven shares
        try:
            with configs.overriding(kernel, head_dim, element_size, config):
                problem = _first_failure(checks, splits_checked)
                if problem is not None:
                    return {**row, "status": "wrong", "detail": problem}
                for p in timed:
                    trial = Trial(kernel, p.dtype, p.shape, config, p.heuristic_splits)
                    row["ms"][f"{p.dtype} {p.shape.id}"] = float(self.timer(p.launch, trial))
        except Exception as exc:  # a launch that fails (out of resources, a compile error) rejects it
            return {**row, "status": "error", "detail": _failure(exc), "ms": {}}
        return row

    def best_config(self, kernel: str, head_dim: int, element_size: int, dtypes: list) -> dict:
        """Check and time every candidate for one (kernel, head-dim bucket, element size). Returns
        ``table``, ``winner`` (None when the table's configuration itself fails), ``speedup``,
        ``ms`` and ``table_ms`` (per timing shape), ``trials`` (one row per candidate) and
        ``pruned`` (the compile rows)."""
        table = configs.get_config(self.target, kernel, head_dim, element_size)
        found = candidates(kernel, table, self.grid)
        kept, compile_rows = self.pruned(kernel, head_dim, dtypes[0], found, table)
        label = f"{kernel} d{head_dim} {'/'.join(dtypes)}"
        dropped = f", {len(found) - len(kept)} pruned by {self.target}'s shared memory" if compile_rows else ""
        self.say(f"{label}: {len(found)} candidates{dropped}, table {describe(table)}")
        checks, timed = self.checks(kernel, head_dim, dtypes, self.causal), self.timed(kernel, head_dim, dtypes)
        trials = [
            _row(
                kernel,
                head_dim,
                element_size,
                c,
                "pruned",
                next(r["problem"] for r in compile_rows if tuple(r["config"]) == c and not r["fits"]),
            )
            for c in found
            if c not in kept
        ]
        results = {}
        for config in kept:
            trials.append(self.trial(kernel, head_dim, element_size, config, checks, timed))
            if trials[-1]["status"] == "ok":
                results[config] = trials[-1]["ms"]
            shown = (
                f"{_geomean(results[config].values()):.4g} ms (geomean)" if config in results else trials[-1]["detail"]
            )
            mark = "(table)" if config == table else ""
            self.say(f"  {describe(config):<16} {mark:<8} {trials[-1]['status']:<6} {shown}")
        outcome = {"table": table, "winner": None, "trials": trials, "pruned": compile_rows}
        if table not in results:
            failure = next(t["detail"] for t in trials if tuple(t["config"]) == table)
            self.say(f"{label}: the table's configuration {describe(table)} failed ({failure}); nothing kept")
            return outcome
        ratios = {c: _geomean(ms[name] / results[table][name] for name in ms) for c, ms in results.items()}
        best = min(ratios, key=ratios.get)
        if ratios[best] > 1.0 - self.min_gain:
            best = table
        outcome.update(winner=best, speedup=1.0 / ratios[best], ms=results[best], table_ms=results[table])
        self.say(
            f"{label}: {describe(best)}{' (the table)' if best == table else ''}, "
            f"{1.0 / ratios[best]:.3f}x the table's speed"
        )
        return outcome

    def split_counts(self, head_dim: int, element_size: int, dtypes: list, decode_config: Config) -> list[dict]:
        """Check every split count with ``decode_config``, then time the useful ones per batch size
        and cache length; returns one ``tuned.splits_entry`` per bucket of programs and cache length
        (``num_splits`` 0 where none beats the heuristic by ``min_gain``)."""
        label = f"num_splits d{head_dim} {'/'.join(dtypes)}"
        checks = self.checks("decode", head_dim, dtypes, (True,))
        measured: dict = {}  # (programs bucket, cache bucket) -> [(heuristic, {splits: ms})]
        with configs.overriding("decode", head_dim, element_size, decode_config):
            usable = []
            for splits in self.splits:
                try:
                    problem = _first_failure(checks, (splits,))
                except Exception as exc:
                    problem = _failure(exc)
                if problem:
                    self.say(f"{label}: {splits} splits rejected: {problem}")
                else:
                    usable.append(splits)
            for timing in self.timed("decode", head_dim, dtypes):
                shape, heuristic = timing.shape, timing.heuristic_splits
                useful = -(-shape.seqlen_k // decode_config.block_n)  # more shares than key blocks only idle
                ms = {}
                for splits in sorted({s for s in usable if s <= useful} | {heuristic}):
                    try:
                        trial = Trial("decode", timing.dtype, shape, decode_config, splits)
                        ms[splits] = float(self.timer(lambda s=splits, t=timing: t.launch(s), trial))
                    except Exception as exc:
                        self.say(f"{label}: {splits} splits failed on {shape.id}: {_failure(exc)}")
                if heuristic in ms:
                    bucket = (
                        tuned.power_of_two_at_least(shape.batch * shape.nheads * -(-shape.seqlen_q // 16)),
                        tuned.power_of_two_at_least(shape.seqlen_k),
                    )
                    measured.setdefault(bucket, []).append((heuristic, ms))
        entries = []
        for (programs, cache_len), rows in sorted(measured.items()):
            common = set.intersection(*(set(ms) for _, ms in rows))  # measured on every shape of the bucket
            ratios = {s: _geomean(ms[s] / ms[h] for h, ms in rows) for s in common}
            heuristics = sorted({h for h, _ in rows})
            best = min(ratios, key=ratios.get) if ratios else 0
            gain = 1.0 / ratios[best] if ratios else 1.0
            if gain < 1.0 / (1.0 - self.min_gain):
                best, gain = 0, 1.0  # 0: the heuristic stays
            entries.append(
                tuned.splits_entry(
                    head_dim,
                    element_size,
                    programs,
                    cache_len,
                    best,
                    heuristic=heuristics,
                    speedup=round(gain, 4),
                    config=list(decode_config),
                    ms={str(s): [round(ms[s], 5) for _, ms in rows] for s in sorted(common)},
                )
            )
            chosen = f"{best} splits" if best else "the heuristic"
            self.say(
                f"{label}: {programs} programs, cache {cache_len}: {chosen} (heuristic "
                f"{'/'.join(map(str, heuristics))}), {gain:.3f}x the heuristic's speed"
            )
        return entries


def tune(
    kernels=KERNELS,
    head_dims=(64, 128),
    dtypes=("bfloat16",),
    seqlens=(1024, 4096),
    *,
    causal=(False, True),
    tokens: int = 16384,
    nheads: int = 16,
    decode_batches=(1, 8, 32),
    splits=SPLITS,
    device="cuda",
    timer: Optional[Timer] = None,
    grid: Optional[dict] = None,
    prune: bool = True,
    jobs: int = 1,
    check: CheckSizes = CheckSizes(),
    min_gain: float = 0.02,
    save: bool = True,
    key: Optional[dict] = None,
    directory=None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Tune the launch configurations (and decoding's split-KV count) on ``device``; write the winners.

    Args:
        kernels: of ``KERNELS``; ``"decode"`` also tunes ``num_splits`` (over ``splits``).
        head_dims: head-dim buckets (powers of two, 16 to 256).
        dtypes: of ``DTYPES``; fp16 and bf16 share their entries (element size 2).
        seqlens: sequence lengths of the fwd/bwd timing shapes, cache lengths of the decode ones.
        causal: the masks timed and checked (fwd/bwd).
        tokens, nheads, decode_batches: the timing shapes (``timing_shapes``).
        timer: ``timer(fn, trial) -> ms``; default ``gpu_timer()`` (a GPU only). Tests inject one.
        grid: ``{kernel: [Config, ...]}`` replacing ``GRID`` for those kernels (the table's
            configuration is always a candidate).
        prune: compile the candidates for the device's target first and drop those that do not
            fit (``prune()``; only for a GPU target with a limit on record), in ``jobs`` processes.
        check: the sizes every candidate's output is checked on.
        min_gain: a candidate must be this much faster (0.02: 2%) than the table's configuration
            (or the split heuristic) to replace it.
        save: write the winners to the cache file of ``key`` (default: this GPU's, ``tuned.make_key``)
            in ``directory`` (default ``tuned.cache_dir()``).
        progress: called with one line of text per step.

    Returns:
        ``{"key", "path" (None unless saved), "configs" (the ``tuned.config_entry`` rows written),
        "num_splits" (the ``tuned.splits_entry`` rows), "trials" (one row per candidate: kernel,
        head_dim, element_size, config, status ok/pruned/wrong/error, detail, ms per timing
        shape), "pruned" (the compile rows)}``.

    Raises:
        TuneError: no GPU and no timer, a GPU without configuration tables, or nothing to key the
            cache by.
        ValueError: an argument outside its allowed values.
    """
    import torch

    _check_arguments(kernels, head_dims, dtypes, seqlens, causal, decode_batches, splits, tokens, nheads, min_gain)
    device = torch.device(device)
    if timer is None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise TuneError(
                f"flash-recipe tune times the kernels on a GPU, and {device} is not one "
                f"(torch.cuda.is_available() is {torch.cuda.is_available()})"
            )
        timer = gpu_timer()
    target = configs.target_of(device)
    try:
        configs.arch_family(target)
    except ValueError as exc:
        raise TuneError(f"{target} has no configuration tables to tune: {exc}") from None
    if save and key is None:
        if device.type != "cuda" or target == "interpreter":
            raise TuneError("the cache is keyed by the GPU, and this run has none: pass key= or save=False")
        key = tuned.make_key(torch.cuda.get_device_name(device), target)
    run = _Tuner(
        device,
        target,
        timer,
        grid,
        prune,
        jobs,
        check,
        tuple(causal),
        tuple(seqlens),
        tokens,
        nheads,
        tuple(decode_batches),
        tuple(splits),
        min_gain,
        progress,
    )
    if prune and target not in configs.SHARED_MEMORY_LIMIT:
        run.say(
            f"no pruning: no shared-memory limit on record for {target} (a candidate that does not fit fails "
            f"at its launch and is rejected)"
        )
    groups: dict = {}  # element size -> dtypes
    for dtype in dtypes:
        groups.setdefault(ELEMENT_SIZE[dtype], []).append(dtype)
    report = {"key": key, "path": None, "configs": [], "num_splits": [], "trials": [], "pruned": []}
    # The GPU timed is the current device (``do_bench`` records its events there): ``device``'s.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    for kernel, head_dim, (element_size, names) in itertools.product(kernels, head_dims, groups.items()):
        with on_device:
            outcome = run.best_config(kernel, head_dim, element_size, names)
        report["trials"] += outcome["trials"]
        report["pruned"] += outcome["pruned"]
        if outcome["winner"] is not None:
            report["configs"].append(
                tuned.config_entry(
                    kernel,
                    head_dim,
                    element_size,
                    outcome["winner"],
                    table=list(outcome["table"]),
                    speedup=round(outcome["speedup"], 4),
                    dtypes=names,
                    ms={k: round(v, 5) for k, v in outcome["ms"].items()},
                    table_ms={k: round(v, 5) for k, v in outcome["table_ms"].items()},
                )
            )
        if kernel == "decode" and splits:
            decode_config = outcome["winner"] or configs.launch_config(device, "decode", head_dim, element_size)
            with on_device:
                report["num_splits"] += run.split_counts(head_dim, element_size, names, decode_config)
    if save and (report["configs"] or report["num_splits"]):
        report["path"] = str(tuned.save(key, report["configs"], report["num_splits"], directory))
        run.say(f"written: {report['path']}")
    return report


def _check_arguments(kernels, head_dims, dtypes, seqlens, causal, decode_batches, splits, tokens, nheads, min_gain):
    def within(name, values, allowed):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(
                f"{name} must be a non-empty selection of {', '.join(map(str, allowed))}, got "
                f"{', '.join(map(str, values)) or 'nothing'}"
            )

    within("kernels", list(kernels), KERNELS)
    within("head_dims", list(head_dims), HEAD_DIMS)
    within("dtypes", list(dtypes), DTYPES)
    within("causal", list(causal), (False, True))
    for name, values, low in (("seqlens", seqlens, 1), ("decode_batches", decode_batches, 1)):
        if not values or any(not isinstance(v, int) or v < low for v in values):
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if any(not isinstance(s, int) or not 1 <= s <= tuned.MAX_SPLITS for s in splits):
        raise ValueError(f"splits must be integers from 1 to {tuned.MAX_SPLITS}, got {list(splits)}")
    if tokens < 1 or nheads < 1:
        raise ValueError(f"tokens and nheads must be positive, got {tokens} and {nheads}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")


# -- the command line -------------------------------------------------------------------------


def _listed(kind: Callable, allowed: Optional[tuple] = None, low: int = 1) -> Callable[[str], list]:
    """An argparse type: comma-separated values of ``kind``, each in ``allowed`` (or ``>= low``)."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = None
        shown = ",".join(map(str, allowed)) if allowed else f"integers >= {low}"
        if not values or any((v not in allowed) if allowed else (v < low) for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated values from {shown}, got {text!r}")
        return values

    return parse


_CAUSAL = {"both": [False, True], "yes": [True], "no": [False]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time launch configurations on the local GPU and write the fastest to the per-device cache "
        f"(${tuned.ENV_VAR}, else $XDG_CACHE_HOME/flash-recipe/tune or ~/.cache/flash-recipe/tune), "
        "which the kernels then use instead of the built-in table."
    )
    parser.add_argument(
        "--kernel",
        type=_listed(str, KERNELS),
        default=list(KERNELS),
        help=f"comma-separated kernels from {','.join(KERNELS)} (default: all)",
    )
    parser.add_argument(
        "--head-dim",
        type=_listed(int, HEAD_DIMS),
        default=[64, 128],
        help="comma-separated head-dim buckets from 16,32,64,128,256 (default 64,128)",
    )
    parser.add_argument(
        "--dtype",
        type=_listed(str, DTYPES),
        default=["bfloat16"],
        help="comma-separated dtypes from float16,bfloat16,float32 (default bfloat16; float16 and "
        "bfloat16 share their entries)",
    )
    parser.add_argument(
        "--seqlen",
        type=_listed(int),
        default=[1024, 4096],
        help="comma-separated sequence lengths, and cache lengths for decode (default 1024,4096)",
    )
    parser.add_argument(
        "--causal",
        choices=tuple(_CAUSAL),
        default="both",
        help="masks timed and checked: both (default), yes (causal only) or no",
    )
    parser.add_argument(
        "--tokens",
        type=_positive("--tokens"),
        default=16384,
        metavar="N",
        help="batch * seqlen of the fwd/bwd timing shapes (default 16384)",
    )
    parser.add_argument(
        "--nheads",
        type=_positive("--nheads"),
        default=16,
        metavar="N",
        help="query heads (default 16; decode uses nheads/4 key heads when nheads is a multiple of 4)",
    )
    parser.add_argument(
        "--decode-batch",
        type=_listed(int),
        default=[1, 8, 32],
        help="comma-separated batch sizes of the decode timing shapes (default 1,8,32)",
    )
    parser.add_argument(
        "--splits",
        type=_listed(int, SPLITS),
        default=list(SPLITS),
        help=f"comma-separated split-KV counts to time for decode, from {','.join(map(str, SPLITS))}",
    )
    parser.add_argument(
        "--min-gain",
        type=_fraction,
        default=0.02,
        metavar="F",
        help="how much faster than the table (or the split heuristic) a candidate must be to "
        "replace it, in [0, 1) (default 0.02)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive("--jobs"),
        default=min(8, os.cpu_count() or 1),
        metavar="N",
        help="processes compiling candidates for pruning (default: the CPU count, at most 8)",
    )
    parser.add_argument("--no-prune", action="store_true", help="time every candidate without compiling it first")
    parser.add_argument("--device", default="cuda", help="the GPU to tune (default: the current one)")
    parser.add_argument("--no-save", action="store_true", help="measure and print, write nothing")
    parser.add_argument("--json", metavar="FILE", help="write the full report (every candidate's timings) as JSON")
    parser.add_argument("--show", action="store_true", help="print the cache directory and its files, and exit")
    parser.add_argument("--clear", action="store_true", help="delete the cache files (back to the table), and exit")


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be a positive integer, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--min-gain must be a number in [0, 1), got {text!r}")
    return value


def show(directory=None, out=print) -> int:
    """Print the cache directory and, per file, its key and entries."""
    directory = tuned.cache_dir() if directory is None else directory
    files = tuned.cache_files(directory)
    out(f"tuned configurations: {directory} (${tuned.ENV_VAR} overrides it){'' if files else '; no files'}")
    for path in files:
        try:
            found = tuned.read(path)
        except tuned.BadCacheFile as exc:
            out(f"{path.name}: ignored, {exc}")
            continue
        key = found.key
        out(f"{path.name}: {key['gpu']} ({key['target']}), Triton {key['triton']}, flash_recipe {key['flash_recipe']}")
        for (kernel, head_dim, size), config in sorted(found.configs.items()):
            out(f"  {kernel:<8} d{head_dim:<3} {size}-byte  {describe(config)}")
        for (head_dim, size, programs, cache_len), splits in sorted(found.splits.items()):
            out(f"  num_splits d{head_dim:<3} {size}-byte  {programs} programs, cache {cache_len}: {splits}")
    return 0


def clear(directory=None, out=print) -> int:
    """Delete the cache files (``*.tune.json``) in the cache directory."""
    files = tuned.cache_files(directory)
    for path in files:
        path.unlink()
        out(f"deleted {path}")
    if not files:
        out(f"no tuned configurations in {tuned.cache_dir() if directory is None else directory}")
    tuned.forget()
    return 0


def run(args) -> int:
    if args.show:
        return show()
    if args.clear:
        return clear()
    import torch

    if not torch.cuda.is_available():
        print(
            "flash-recipe tune: no CUDA or ROCm GPU is visible; tune times the kernels on the GPU that will run "
            "them, so run it there (`flash-recipe tune --show` lists what is cached).",
            file=sys.stderr,
        )
        return 2

    def progress(line: str) -> None:
        print(line, flush=True)

    begin = time.perf_counter()
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        device = None
    count = torch.cuda.device_count()
    if device is None or device.type != "cuda" or (device.index or 0) >= count:
        print(
            f"flash-recipe tune: --device must be a GPU, cuda or cuda:N with N < {count}, got {args.device!r}",
            file=sys.stderr,
        )
        return 2
    try:
        print(
            f"tuning {torch.cuda.get_device_name(device)} ({configs.target_of(device)}) into {tuned.cache_dir()}",
            flush=True,
        )
        report = tune(
            args.kernel,
            args.head_dim,
            args.dtype,
            args.seqlen,
            causal=_CAUSAL[args.causal],
            tokens=args.tokens,
            nheads=args.nheads,
            decode_batches=args.decode_batch,
            splits=args.splits,
            device=device,
            prune=not args.no_prune,
            jobs=args.jobs,
            min_gain=args.min_gain,
            save=not args.no_save,
            progress=progress,
        )
    except (TuneError, ValueError) as exc:
        print(f"flash-recipe tune: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=list)
    kept = len(report["configs"]) + len(report["num_splits"])
    print(
        f"{kept} entries {'written to ' + report['path'] if report['path'] else 'measured (not saved)'} in "
        f"{time.perf_counter() - begin:.0f} s"
    )
    return 0 if kept else 1
