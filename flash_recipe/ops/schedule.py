"""The order a launch's programs start in: the heaviest query blocks first, a few heads at a time.

A GPU starts the programs of a launch in the order of their linear index (axis 0 fastest) as its
multiprocessors free up. Under a causal mask the work of a query block grows with its index
(block ``i`` of ``BLOCK_M`` rows sees about ``(i + 1) * BLOCK_M`` keys), so in the plain order
each head's longest programs start last, and the last head's end the launch running nearly alone:
a tail of up to one longest program. The forward (``attn_fwd_kernel``) and the deterministic dQ
kernel (``attn_bwd_dq_kernel``) therefore map their program ids through ``launch_order``:

- the heads as launched (query heads, or kv heads with GQA packing) of every batch entry, one
  entry after another, are taken ``section`` at a time, the last section also taking the
  remainder (a narrow last section would start its heaviest programs late, alone);
- within a section, the query blocks go from the last (heaviest) to the first, all of the
  section's heads at each block: longest-processing-time-first scheduling, which leaves the
  lightest programs to fill the last wave;
- ``section`` (``section_heads``) is as many heads as fit their keys and values in a share of the
  GPU's L2 cache, so the programs running side by side read keys L2 already holds. Without a
  causal mask (or a right window without a left one) every block does about the same work, and
  ``section`` is 1: each head's blocks in turn, last first, as close to the plain order as the
  mapping gets.

The dK/dV kernel needs none of this: its key block 0, which every query block sees under a
causal mask, already launches first. Which order is faster on a given GPU is for its timings to
say (``python -m devtools.campaign``); the order never changes a result, since every program
computes what it computed before, only at another time. ``launch_sequence`` states the order in
Python (the tests hold the kernels to it); ``python -m devtools.schedule_report`` prints
what a model of a launch says of it for the campaign's causal shapes.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .tiles import grid_id, grid_programs

# The share of the L2 cache a section's keys and values may take; the rest holds the programs'
# queries, outputs and whatever else the GPU is doing.
L2_SHARE = 0.5
# The L2 size assumed where the device cannot say (the CPU, the interpreter): an A100's 40 MiB.
DEFAULT_L2_BYTES = 40 * 2**20


def section_heads(heads: int, query_blocks: int, kv_bytes_per_head: int, l2_bytes: int, grows: bool) -> int:
    """How many heads a section of ``launch_order`` spans (the last one takes the remainder too).

    Args:
        heads: heads as launched (axis 1 of the grid) times the batch (axis 2), >= 1.
        query_blocks: query blocks per head (axis 0 of the grid over the split count), >= 1.
        kv_bytes_per_head: bytes of one head's keys and values that a program may read.
        l2_bytes: the GPU's L2 cache.
        grows: whether a query block's work grows with its index (a right mask without a left).

    Returns:
        1 where the order cannot shorten the launch (no growing work, one query block, one head)
        or the launch has 2**31 programs or more; else the heads whose keys and values fit in
        ``L2_SHARE`` of L2, from 1 to ``heads``.
    """
    if not grows or query_blocks <= 1 or heads <= 1 or query_blocks * heads >= 2**31:
        return 1  # (launch_order counts the programs in int32)
    fit = int(l2_bytes * L2_SHARE) // max(kv_bytes_per_head, 1)
    return max(1, min(heads, fit))


_L2_BYTES: dict[int, int] = {}


def l2_bytes(device: Any) -> int:
    """The L2 cache of CUDA (or ROCm) ``device`` (a ``torch.device``), asked of torch once per device
    index; ``DEFAULT_L2_BYTES`` for any other device or where torch does not say."""
    if getattr(device, "type", None) != "cuda":
        return DEFAULT_L2_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _L2_BYTES.get(index)
    if found is None:
        found = int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)) or DEFAULT_L2_BYTES
        _L2_BYTES[index] = found
    return found


def launch_section(heads: int, query_blocks: int, seqlen_k: int, head_dim: int, element_size: int, device: Any,
                   window_left: int, window_right: int) -> int:
    """``section_heads`` for a launch of ``query_blocks`` per head over ``heads`` heads (all batch
    entries), whose heads read ``seqlen_k`` keys and values of ``head_dim`` elements of
    ``element_size`` bytes on ``device``, with the window a ``ScoreOptions`` gives (-1: unbounded;
    causal: a right window of 0 without a left one makes the work grow with the block)."""
    grows = window_right >= 0 and window_left < 0
    return section_heads(heads, query_blocks, 2 * seqlen_k * head_dim * element_size, l2_bytes(device), grows)


def launch_sequence(query_blocks: int, heads: int, section: int) -> list[tuple[int, int]]:
    """``(query block, head)`` of each program in launch order, as ``launch_order`` maps them (one
    program per block); ``head`` counts the heads of every batch entry, entry after entry."""
    last = max(heads // section - 1, 0)
    order = []
    for which in range(last + 1):
        first = which * section
        width = heads - first if which == last else section
        order += [(m, first + h) for m in reversed(range(query_blocks)) for h in range(width)]
    return order


@triton.jit
def launch_order(group, section, HEAD_SECTIONS: tl.constexpr, GRID_FOLD: tl.constexpr):
    """This program's ``(query block, share, head, batch entry)`` on a grid ``(n * group, heads, batch)``
    whose axis 0 holds ``group`` consecutive programs per query block (split-KV: the shares), in the
    order the module docstring gives: ``section`` heads at a time (a runtime value, 1 or more).
    ``HEAD_SECTIONS`` is ``section > 1``, a compile-time flag: launches of one head at a time (decoding,
    no causal mask) compile without the sections' arithmetic, whose registers spilled the decode
    kernel on sm90 under Triton 3.2. A grid folded for CUDA's limits (``GRID_FOLD > 1``, ids from
    ``tiles.grid_id``; the caller skips the fold's padding) takes each head's blocks in turn, last
    first: its launch position is no longer the one the sections count."""
    if GRID_FOLD > 1:  # (unfolded, the plain ids: the helpers' calls cost the decode kernel's sm90 code 3 registers)
        n_m = grid_programs(0, GRID_FOLD) // group
        i_s = grid_id(0, GRID_FOLD) % group
        i_m = n_m - 1 - grid_id(0, GRID_FOLD) // group
        i_h = grid_id(1, GRID_FOLD)
        i_b = grid_id(2, GRID_FOLD)
        return i_m, i_s, i_h, i_b
    n_m = tl.num_programs(0) // group
    i_s = tl.program_id(0) % group
    if HEAD_SECTIONS:
        heads = tl.num_programs(1)
        count = heads * tl.num_programs(2)  # the heads of every batch entry, one after another
        unit = tl.program_id(0) // group + n_m * (tl.program_id(1) + heads * tl.program_id(2))  # launch position
        last = count // section - 1  # the last section, which takes the remainder too
        which = tl.minimum(unit // (n_m * section), last)
        first = which * section  # the section's first head
        width = tl.where(which == last, count - first, section)
        rank = unit - first * n_m
        i_m = n_m - 1 - rank // width
        flat = first + rank % width
        i_h = flat % heads
        i_b = flat // heads
    else:
        i_m = n_m - 1 - tl.program_id(0) // group
        i_h = tl.program_id(1)
        i_b = tl.program_id(2)
    return i_m, i_s, i_h, i_b

