"""Ulysses context parallelism (DeepSpeed-Ulysses): an all-to-all over heads, and with a ring group
too, USP (Ulysses x ring). The entry point is ``flash_recipe.distributed.ulysses_attention``; this
module holds the exchange (``all_to_all_attention``).

Each of the ``U`` ranks of ``group`` holds a contiguous shard of the sequence with every head:
``q (B, S/U, H, D)``, ``k, v (B, S/U, Hk, D)``. An all-to-all gives each rank the whole sequence
for ``H/U`` of the heads, ``(B, S, H/U, D)``; it attends there with flash_recipe's kernels; a second
all-to-all gives every rank its rows back with every head. Two all-to-alls per direction, each
moving ``(U - 1)/U`` of a rank's activations. With U = 2, rank 0 holds rows ``[0, S/2)`` and after
the first all-to-all heads ``[0, H/2)`` of all rows::

    before: rank 0  rows 0..S/2-1, heads 0..H-1        after: rank 0  rows 0..S-1, heads 0..H/2-1
            rank 1  rows S/2..S-1, heads 0..H-1               rank 1  rows 0..S-1, heads H/2..H-1

GQA: query heads map to key heads in contiguous groups, which the head split keeps when
``Hk % U == 0``. When ``U % Hk == 0`` (fewer key heads than ranks) each key head is repeated
``U / Hk`` times first, so every rank gets the one its query heads use; gradients sum back.

USP: with ``ring_group`` the sequence is cut first across the ring (``ring_layout``, see
``flash_recipe.distributed``: each ring rank holds ``S/R`` rows), then each ring shard contiguously
across the Ulysses group; after the all-to-all, ``ring_attention`` over ``ring_group`` replaces
the local attention. With 4 ranks as Ulysses 2 x ring 2: Ulysses groups {0, 1} and {2, 3}, ring
groups {0, 2} and {1, 3}::

    ring_shard = distributed.shard(x, ring_group, layout="zigzag")          # (B, S/2, H, D)
    local = distributed.shard(ring_shard, group, layout="contiguous")       # (B, S/4, H, D)
    out = ulysses_attention(q, k, v, group, ring_group=ring_group, causal=True)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses attention needs torch.distributed initialised (init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must be a process group this rank belongs to")
    return rank, dist.get_world_size(group)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x (U, ...)``: block ``j`` goes to rank ``j``; returns the blocks received, block ``j`` from rank ``j``."""
    x = x.contiguous()
    received = torch.empty_like(x)  # contiguous too: the collective writes raw blocks
    dist.all_to_all_single(received, x, group=group)
    return received


def _sequence_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``(B, S/U, H, D)`` -> ``(B, S, H/U, D)``: this rank's heads for the whole sequence."""
    batch, rows, heads, dim = x.shape
    blocks = x.reshape(batch, rows, world, heads // world, dim).permute(2, 0, 1, 3, 4)  # (U, B, S/U, H/U, D)
    received = _all_to_all(blocks, group)  # block j: rank j's rows
    return received.permute(1, 0, 2, 3, 4).reshape(batch, world * rows, heads // world, dim)


def _heads_to_sequence(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``(B, S, H/U, D)`` -> ``(B, S/U, H, D)``: the inverse of ``_sequence_to_heads``."""
    batch, seqlen, heads, dim = x.shape
    blocks = x.reshape(batch, world, seqlen // world, heads, dim).permute(1, 0, 2, 3, 4)  # (U, B, S/U, H/U, D)
    received = _all_to_all(blocks, group)  # block j: rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seqlen // world, world * heads, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _sequence_to_heads(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group, ctx.world), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _heads_to_sequence(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group, ctx.world), None, None


def all_to_all_attention(q, k, v, group, attend) -> torch.Tensor:
    """The Ulysses exchange around ``attend``: ``q (B, S/U, H, D)``, ``k, v (B, S/U, Hk, D)`` ->
    ``attend(q, k, v)`` on ``(B, S, H/U, D)`` (and ``(B, S, Hk', D)``, ``Hk' = max(Hk, U) / U``) ->
    ``(B, S/U, H, D)``. Differentiable; the checks name what the head counts must be."""
    _, world = _rank_world(group)
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % world:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the Ulysses group size ({world})")
    if nheads_k % world and world % nheads_k:
        raise ValueError(f"nheads_k ({nheads_k}) must be a multiple or a divisor of the Ulysses group size ({world})")
    if nheads_k < world:  # every rank needs the key head its query heads use
        k, v = (t.repeat_interleave(world // nheads_k, dim=2) for t in (k, v))
    q, k, v = (_SequenceToHeads.apply(t, group, world) for t in (q, k, v))
    return _HeadsToSequence.apply(attend(q, k, v), group, world)
