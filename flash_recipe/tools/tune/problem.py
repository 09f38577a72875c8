"""What tuning runs and checks: the kernels, dtypes and candidate grid (``GRID``), the shapes
(``Shape``, ``CheckSizes``), one launch on fixed inputs (``Problem``) and its accuracy check
(``Check``, by the accuracy rule of ``flash_recipe.testing``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Optional

import torch

from ...ops import choose, configs, limits
from ...ops.configs import Config
from ...ops.options import ScoreOptions
from ...reference import attention_reference, compute_dtype
from ...testing import FACTORS, accuracy_bound, max_error
from ..sizes import Sizes

KERNELS = configs.KERNELS + (configs.ONE_LAUNCH,)  # the last where the target's table offers it
HEAD_DIMS = limits.HEAD_DIM_BUCKETS
DTYPES = ("float16", "bfloat16", "float32")
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SPLITS = (1, 2, 4, 8, 16, 32, 64)
# The call of ``compile_calls.compile_case`` that compiles each kernel.
COMPILE_CALL = {
    "fwd": "fwd",
    "fwd_general": "options",
    "bwd_dkdv": "bwd",
    "bwd_dq": "bwd",
    "bwd_onepass": "bwd",
    "bwd_onelaunch": "one_launch",
    "decode": "decode",
}
# The candidate grid per kernel: block_m, block_n, num_warps, num_stages. Decoding has one to
# sixteen query rows, so its query block is the smallest matrix-unit tile.
GRID = {
    "fwd": ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)),
    "fwd_general": ((64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)),
    "bwd_dkdv": ((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)),
    "bwd_dq": ((32, 64, 128), (16, 32, 64), (4, 8), (1, 2, 3)),
    "bwd_onepass": ((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)),
    "bwd_onelaunch": ((32, 64), (64, 128), (4, 8), (1, 2, 3)),  # key step x key block (= the dQ programs' rows)
    "decode": ((16,), (32, 64, 128, 256), (4, 8), (1, 2, 3, 4)),
}
# The backward's kernels: the deterministic path's two, the one-pass dK/dV kernel adding dQ, and
# the one-launch kernel; and the path each one's problem runs.
BACKWARD = ("bwd_dkdv", "bwd_dq", "bwd_onepass", "bwd_onelaunch")
PATH_OF_KERNEL = {"bwd_onepass": "one_pass", "bwd_onelaunch": "one_launch"}  # else the three kernels
KERNEL_OF_PATH = {"one_pass": "bwd_onepass", "three_kernels": "bwd_dkdv", "one_launch": "bwd_onelaunch"}
# Eight warps only on tiles of at least this many elements: on smaller ones most of them idle.
EIGHT_WARPS_MIN_TILE = 64 * 64
GENERAL_SOFTCAP = 50.0


class TuneError(RuntimeError):
    """Tuning cannot run as asked (no GPU, no timer, a target without tables)."""


@dataclasses.dataclass(frozen=True)
class Shape(Sizes):
    """A launch's sizes (``Sizes``) and mask; for ``decode`` a dense cache of ``seqlen_k`` rows per
    batch entry, of which ``lengths`` (one per batch entry; None: all) are filled."""

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
    for decoding, ``num_splits``; for the backward's path, ``path``, whose main kernel ``kernel`` is)."""

    kernel: str
    dtype: str
    shape: Shape
    config: Config
    num_splits: Optional[int] = None
    path: Optional[str] = None


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


# -- one launch on fixed inputs ---------------------------------------------------------------


@contextlib.contextmanager
def nan_outputs():
    """Kernel outputs start as NaN inside the block (``tiles.output_buffer``), so a tile a
    candidate leaves unwritten shows instead of reusing a previous launch's memory."""
    from ...ops import tiles  # Triton on use: without it ``flash-recipe tune`` says why

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
    ``dq, dk, dv``), and ``reference(upcast)`` the same from ``flash_recipe.reference``. A backward
    kernel's problem runs the path of that kernel, or ``path`` when given (``"one_pass"``,
    ``"three_kernels"``, ``"one_launch"``: the whole backward, timed to choose among them)."""

    def __init__(self, kernel: str, dtype: str, shape: Shape, device, seed: int = 0, path: Optional[str] = None):
        from ...ops import forward, kvcache  # Triton on use: without it ``flash-recipe tune`` says why

        self.kernel, self.dtype, self.shape, self.path = kernel, dtype, shape, path
        gen = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)

        def draw(*size):
            return torch.randn(*size, generator=gen).to(device=device, dtype=dt)

        b, sq, sk, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads_k, shape.head_dim
        self.scale = d**-0.5
        self.q, self.k, self.v = draw(*shape.q_shape), draw(*shape.kv_shape), draw(*shape.kv_shape)
        if kernel == "decode":
            lengths = shape.lengths or (sk,) * b
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
            table = torch.arange(b, dtype=torch.int32, device=device)[:, None]
            self.cache = kvcache.Cache(self.k, self.v, table, seqlens, None)
            self.options = ScoreOptions(
                softmax_scale=self.scale, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
            )  # per-batch ranges align bottom-right
            self.lengths = lengths
            heads, rows = kvcache.program_heads(self.q, hk)  # GQA packs its group: fewer programs
            size = self.q.element_size()
            self.heuristic_splits = kvcache.heuristic_splits(b, heads, rows, sk, self.q.device, d, size)
            return
        self.heuristic_splits = None  # decoding only
        # The general forward is timed on a softcapped call (Gemma 2's 50), one of the options it serves.
        softcap = GENERAL_SOFTCAP if kernel == "fwd_general" else 0.0
        self.options = ScoreOptions(
            softmax_scale=self.scale,
            diag_offset=sk - sq,
            window_left=-1,
            window_right=0 if shape.causal else -1,
            softcap=softcap,
            alibi_slopes=None,
        )
        if kernel in BACKWARD:
            self.dout = draw(*shape.q_shape)
            self.out, self.lse = forward.attention_forward(self.q, self.k, self.v, self.options)

    def launch(self, num_splits: Optional[int] = None) -> tuple:
        from ...ops import backward_launch, forward, kvcache  # Triton on use: without it ``flash-recipe tune`` says why

        if self.kernel in ("fwd", "fwd_general"):
            return (forward.attention_forward(self.q, self.k, self.v, self.options)[0],)
        if self.kernel == "decode":
            splits = self.heuristic_splits if num_splits is None else num_splits
            return (
                kvcache.attention_kvcache(self.q, None, None, self.cache, None, self.options, num_splits=splits)[0],
            )
        path = self.path or PATH_OF_KERNEL.get(self.kernel, "three_kernels")
        with choose.taking_path(path):  # the path timed, else the one whose kernel this tunes
            return backward_launch.attention_backward(
                self.dout, self.q, self.k, self.v, self.out, self.lse, self.options
            )[:3]

    def reference(self, upcast: bool) -> tuple:
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
