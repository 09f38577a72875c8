"""What the launchers share: the keyword arguments a call's options and tensors become, and the
plan of a launch.

Shapes as in ``flash_recipe.ops.options`` (``ScoreOptions``, ``Varlen``, ``KeyRanges``).

Every kernel is launched by keyword: the helpers here return dicts keyed by the kernels'
parameter names, so a parameter is named once, in the kernel signature and at its launch.

A launcher builds a ``Plan`` on the first call of a signature (``flash_recipe.memo_keys``): the
grid, every argument that is not a tensor, and the compile-time flags the kernel's
``triton.heuristics`` derive, evaluated once. A repeated call passes only its tensors to ``launch``.
Every kernel launch of the package goes through ``plan`` and ``launch`` (or ``launch_once``, the
two in one; a test holds the package to that), so every launch runs on its tensors' device and
within CUDA's grid limits.

Grids: every launcher passes ``(n0, heads, batch)``, the batch on axis 2 (for the dropout mask:
batch * heads). CUDA allows at most ``AXIS0_LIMIT`` programs on axis 0 and ``AXIS_LIMIT`` on axes 1
and 2; window attention that folds its windows into the batch passes 65535 easily. ``plan`` then
folds the batch into axis 0 (``fold_grid``): ``(n0 * F, heads, cdiv(batch, F))`` for the least power
of two ``F`` that fits, and passes the kernel ``GRID_FOLD = F`` (a compile-time flag; 1 unfolded,
so unfolded launches compile as they did) and ``fold_batch = batch`` (1 unfolded). The kernels read
their ids through ``tiles.grid_id``, which undoes the fold; the fold's padding (the fewer than
``F`` batch entries from ``fold_batch`` on) exits at once.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import direct, tiles
from .options import KeyRanges, ScoreOptions, Varlen


class Layout(NamedTuple):
    """The sizes of a launch and how its tensors are strided."""

    batch: int
    seqlen_q: int  # the longest query sequence with varlen
    seqlen_k: int  # the longest key sequence with varlen, the key-range bound with a cache
    nheads: int
    nheads_k: int
    head_dim: int
    strides: Callable[[torch.Tensor], tuple]  # a tensor's (batch, row, head) strides

    def stride_args(self, t: torch.Tensor, prefix: str, row: str) -> dict:
        """``t``'s strides as the kernel parameters ``stride_{prefix}b``, ``stride_{prefix}{row}``
        and ``stride_{prefix}h``."""
        batch, rows, heads = self.strides(t)
        return {f"stride_{prefix}b": batch, f"stride_{prefix}{row}": rows, f"stride_{prefix}h": heads}


def score_args(options: ScoreOptions, seqlen_k: int, forward: bool = False) -> dict:
    """The kernels' arguments for ``options``: the one place an option's meaning becomes kernel
    arguments.

    ``SLOPES`` and ``SEED`` are tensors or None (the kernels' ``ALIBI`` and ``DROPOUT`` follow from
    that); the slopes' batch stride; the scale ``sm_scale``; the softcap (any value serves when
    ``SOFTCAP`` is off); the window's edges and flags; the dropout rate and the rows per head of
    its random stream. ``forward`` adds ``qk_scale``, the forward's multiplier of its base-2 logits:
    ``log2(e)`` times the softcap when softcapping (the logit is then ``softcap * tanh(q . k *
    softmax_scale / softcap)``), else times ``softmax_scale``.
    """
    slopes = options.alibi_slopes
    softcap = options.softcap > 0.0
    if options.dropout_p > 0.0 and options.seed is None:
        raise ValueError("ScoreOptions with dropout_p > 0 needs its seed (an int64 tensor of one element)")
    args = dict(
        SLOPES=slopes,
        SEED=options.seed if options.dropout_p > 0.0 else None,
        stride_sb=slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
        sm_scale=options.softmax_scale,
        softcap=options.softcap if softcap else 1.0,
        diag_offset=options.diag_offset,
        window_left=max(options.window_left, 0),
        window_right=max(options.window_right, 0),
        dropout_p=options.dropout_p,
        rng_stride=seqlen_k,
        MASK_LEFT=options.window_left >= 0,
        MASK_RIGHT=options.window_right >= 0,
        SOFTCAP=softcap,
    )
    if forward:
        args["qk_scale"] = base2_scale(options.softcap if softcap else options.softmax_scale)
    return args


def base2_scale(nat_scale: float) -> float:
    """``nat_scale * log2(e)`` as the fp32 the forward kernel receives: the multiplier of its base-2
    logits, whose sign in fp32 decides ``SCALE_IN_EXP2`` (a positive scale below fp32's range is 0)."""
    scale = nat_scale * math.log2(math.e)
    try:  # rounded to fp32 on the host, without a tensor per launch
        return struct.unpack("f", struct.pack("f", scale))[0]
    except OverflowError:
        return math.copysign(math.inf, scale)


def layout(q: torch.Tensor, k: torch.Tensor, varlen: Optional[Varlen], keys: Optional[KeyRanges] = None) -> Layout:
    """The sizes of a launch and a function giving a tensor's (batch, row, head) strides.

    Varlen tensors ``(total, H, D)`` get batch stride 0 and the longest sequence lengths; paged
    key tensors ``(num_pages, page_size, Hk, D)`` keep their page stride in the batch slot.
    """
    paged = keys is not None and keys.table is not None
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k = keys.max_len if keys is not None else k.shape[1]
        return Layout(batch, seqlen_q, seqlen_k, nheads, k.shape[2], head_dim,
                      lambda t: (t.stride(0), t.stride(1), t.stride(2)))
    nheads_k = k.shape[2] if paged else k.shape[1]
    return Layout(varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k, q.shape[1], nheads_k,
                  q.shape[2],
                  lambda t: (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, t.stride(0), t.stride(1)))


def packed_rows(q: torch.Tensor, k: torch.Tensor, varlen: Optional[Varlen], paged: bool = False) -> dict:
    """``total_q`` and ``total_k``: the rows of packed varlen q and k, which bound every sequence's
    offsets in the kernels (0 where unused: dense tensors, paged keys)."""
    if varlen is None:
        return dict(total_q=0, total_k=0)
    return dict(total_q=q.shape[0], total_k=0 if paged else k.shape[0])


def lse_buffer(q: torch.Tensor, varlen: Optional[Varlen], dims: Layout) -> tuple[torch.Tensor, int, int]:
    """The log-sum-exp buffer, ``(B, H, Sq)`` dense or ``(H, total_q)`` varlen, and its (batch, head) strides."""
    if varlen is None:
        lse = tiles.output_buffer((dims.batch, dims.nheads, dims.seqlen_q), dtype=torch.float32, device=q.device)
        return lse, lse.stride(0), lse.stride(1)
    lse = tiles.output_buffer((dims.nheads, q.shape[0]), dtype=torch.float32, device=q.device)
    return lse, 0, lse.stride(0)


class Plan(NamedTuple):
    """A kernel launch with everything but its tensors decided (see ``plan``)."""

    kernel: Any  # the JIT function under the heuristics (``run`` is looked up at each launch)
    grid: tuple  # within CUDA's limits (``fold_grid``)
    scalars: dict  # every argument that is not a tensor: sizes, strides, flags, absent tensors (None)
    tensors: tuple  # the names of the arguments a launch passes as tensors (``launch``'s ``tensors``)
    device: Optional[int]  # the CUDA device to launch on; None for CPU tensors (the interpreter)
    direct: direct.DirectLaunch  # the later launches' way past JITFunction.run (``ops.direct``)


def _per_call(value: Any) -> bool:
    """An argument that changes from call to call: a tensor, or a tensor descriptor (which holds one)."""
    return isinstance(value, torch.Tensor) or hasattr(value, "base") and isinstance(value.base, torch.Tensor)


# CUDA's grid limits: programs on axis 0, and on axes 1 and 2.
AXIS0_LIMIT = 2**31 - 1
AXIS_LIMIT = 65535


def fold_grid(grid: tuple, kernel: Any = None) -> tuple[tuple, int]:
    """``grid`` ``(n0, heads, batch)`` within CUDA's limits and its fold ``F``: ``grid`` itself and 1
    where it fits, else ``(n0 * F, heads, cdiv(batch, F))`` for the least power of two ``F`` that
    brings the batch's axis within ``AXIS_LIMIT`` (program ``(i0 * F + r, h, j)`` serves batch
    entry ``j * F + r``; ``tiles.grid_id``). ``kernel`` is named in errors.

    Raises:
        ValueError: more than ``AXIS_LIMIT`` heads (axis 1 does not fold), or an axis 0 past
            ``AXIS0_LIMIT`` once folded (``n0 * F`` programs).
    """
    n0, heads, batch = grid
    fold = 1
    while -(-batch // fold) > AXIS_LIMIT:
        fold *= 2
    if heads <= AXIS_LIMIT and n0 * fold <= AXIS0_LIMIT:
        return (grid, 1) if fold == 1 else ((n0 * fold, heads, -(-batch // fold)), fold)
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
    if heads > AXIS_LIMIT:
        raise ValueError(f"{name}: nheads must be at most {AXIS_LIMIT} (CUDA's limit on grid axis 1, where the heads "
                         f"run), got {heads}; fix: split the heads over several calls")
    raise ValueError(f"{name}: grid axis 0 would need {n0} * {fold} programs, CUDA allows at most {AXIS0_LIMIT}; "
                     f"fix: split the batch ({batch} entries) or the sequences over several calls")


def _decide(kernel, grid: tuple, args: dict, device: torch.device) -> Plan:
    """``plan``'s decisions, every argument still in ``scalars``: the JIT function, the grid within
    CUDA's limits, ``args`` with the fold's ``GRID_FOLD`` and ``fold_batch`` and the heuristics'
    flags, and the device."""
    n0, heads, batch = grid
    if n0 <= AXIS0_LIMIT and heads <= AXIS_LIMIT and batch <= AXIS_LIMIT:
        grid, fold = tuple(grid), 1
    else:
        grid, fold = fold_grid(tuple(grid), kernel)
    args = dict(args, GRID_FOLD=fold, fold_batch=batch if fold > 1 else 1)  # an integer 1 compiles as a constant
    while hasattr(kernel, "values") and hasattr(kernel, "arg_names"):  # triton.heuristics
        for name, heuristic in kernel.values.items():
            args[name] = heuristic(args)
        kernel = kernel.fn
    return Plan(kernel, grid, args, (), device.index if device.type == "cuda" else None, direct.DirectLaunch())


def plan(kernel, grid: tuple, args: dict, device: torch.device) -> Plan:
    """The launch of ``kernel`` (a ``triton.jit`` function, possibly under ``triton.heuristics``) on
    ``grid`` ``(n0, heads, batch)`` with keyword ``args``, as a ``Plan``.

    The grid is folded where CUDA's limits need it (``fold_grid``), and ``args`` gain the kernel's
    ``GRID_FOLD`` and ``fold_batch`` (every planned kernel takes both: see the module docstring).
    The heuristics are evaluated here, in order, as Triton evaluates them at each launch: their
    values depend only on what a signature fixes (shapes, strides, dtypes, which tensors are
    present, option values), so one evaluation serves every call of the signature.
    """
    decided = _decide(kernel, grid, args, device)
    tensors = tuple(name for name, value in decided.scalars.items() if _per_call(value))
    scalars = {name: value for name, value in decided.scalars.items() if name not in tensors}
    return decided._replace(scalars=scalars, tensors=tensors)


def launch_once(kernel, grid: tuple, args: dict, device: torch.device) -> None:
    """``plan`` and ``launch`` in one, for a launcher that keeps no plan (the 8-bit path's quantizer
    and kernel, the dropout mask): the same decisions and the same launch, without sorting the
    tensors out of ``args`` (the plan, used once, holds them all in ``scalars``)."""
    launch(_decide(kernel, grid, args, device), {})


def launch(plan: Plan, tensors: dict) -> None:
    """Launch ``plan`` with this call's ``tensors`` (exactly the names in ``plan.tensors``), on the
    plan's device (made current for the launch where it is not)."""
    if plan.device is not None and torch.cuda.current_device() != plan.device:
        with torch.cuda.device(plan.device):
            plan.direct.launch(plan.kernel, plan.grid, plan.scalars, tensors)
    else:
        plan.direct.launch(plan.kernel, plan.grid, plan.scalars, tensors)
