"""Context parallelism: ring attention over torch.distributed (NCCL on GPUs, gloo on CPUs; the
tests run gloo).

Each of the ``W`` ranks of a process group holds one shard of the sequence: its queries, keys and
values. The key/value shards travel around the ring of ranks, one step at a time, and each rank
attends its queries to the shard it holds with flash_recipe's kernels (Triton on GPUs, the
plain-torch reference on CPUs); the partial results merge through their log-sum-exp. The send and
receive of the next shard overlap the attention to the current one. The backward runs the same
ring, FlashAttention-2's backward on every block with the merged output and log-sum-exp, and
sends each shard's key/value gradients along with it until they reach their owner.

Layouts of a sequence of length ``S`` cut into shards of ``S / W`` rows::

    contiguous: rank r holds rows [r * S/W, (r + 1) * S/W)
    zigzag:     the sequence is cut into 2W chunks; rank r holds chunks r and 2W - 1 - r
                (W = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)

Causal attention sees more keys towards the end of the sequence; the zigzag layout gives every
rank the same work, the contiguous one leaves rank 0 idle for most of the ring. Without causal
masking the layout changes nothing. ``shard`` and ``unshard`` convert between a full sequence and
the shards.

``ulysses_attention`` (``flash_recipe.ulysses``) splits heads instead of keys, and composes with
the ring into USP.

Run it with one process per GPU, for example ``torchrun --nproc-per-node 8 train.py`` with::

    torch.distributed.init_process_group("nccl")
    q, k, v = (shard(t, layout="zigzag") for t in (q_full, k_full, v_full))  # (B, S/W, H, D)
    out = ring_attention(q, k, v, causal=True)  # this rank's rows of the full attention
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import dispatch, validate
from .api import flash_attn_func
from .call_builder import FlashOptions, build_flash_call
from .ulysses import all_to_all_attention

LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "merge_partial", "ring_attention", "shard", "ulysses_attention", "unshard"]


def _group_size(group) -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring attention needs torch.distributed initialised (init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must be a process group this rank belongs to")
    return rank, dist.get_world_size(group)


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def _chunks(seqlen: int, world: int, layout: str, dim_name: str = "the sequence") -> int:
    parts = 2 * world if layout == "zigzag" else world
    if seqlen % parts:
        raise ValueError(
            f"{dim_name} length {seqlen} must be a multiple of {parts} for the {layout} layout on {world} ranks"
        )
    return seqlen // parts


def shard(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (the same on every rank) along ``dim``: ``S / W`` rows."""
    rank, world = _group_size(group)
    chunk = _chunks(x.shape[dim], world, _check_layout(layout))
    if layout == "contiguous":
        return x.narrow(dim, rank * chunk, chunk)
    return torch.cat((x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * world - 1 - rank) * chunk, chunk)), dim)


def unshard(x: torch.Tensor, group=None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (an all-gather; not differentiable)."""
    rank, world = _group_size(group)
    _check_layout(layout)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge the attention of the same queries to another block of keys into ``out, lse``, in place.

    ``out (B, S, H, Dv)`` float32 and ``lse (B, H, S)`` float32 accumulate (start: zeros and
    ``-inf``); ``block_out`` and ``block_lse`` are one block's result, ``block_lse = +inf`` for a
    row that saw no key there (flash-attn's convention). The merged output is the softmax-weighted
    mean ``(e^lse out + e^block_lse block_out) / (e^lse + e^block_lse)``.
    """
    block_lse = block_lse.masked_fill(block_lse == float("inf"), float("-inf"))
    merged = torch.logaddexp(lse, block_lse)
    shift = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that have seen no key yet
    old = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    new = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(old).add_(block_out.float() * new)
    lse.copy_(merged)


def _blocks(layout: str, causal: bool, rank: int, source: int, seqlen: int) -> list:
    """The attention this rank's queries owe the key shard of rank ``source``:
    ``[(query rows, key rows, causal), ...]`` as slices of the local shards (rows ``seqlen``)."""
    every = slice(0, seqlen)
    if not causal:
        return [(every, every, False)]
    if source == rank:  # the shard itself: in both layouts its rows are in sequence order
        return [(every, every, True)]
    if layout == "contiguous":
        return [(every, every, False)] if source < rank else []
    half = seqlen // 2
    if source < rank:  # its first chunk precedes both of ours, its second follows both
        return [(every, slice(0, half), False)]
    return [(slice(half, seqlen), every, False)]  # both its chunks precede our second one only


class _Ring:
    """Sends to the next rank of the group and receives from the previous one, asynchronously."""

    def __init__(self, group):
        self.group = group
        rank, self.world = _group_size(group)
        self.next, self.prev = (rank + 1) % self.world, (rank - 1) % self.world
        if group is not None:
            self.next, self.prev = dist.get_global_rank(group, self.next), dist.get_global_rank(group, self.prev)

    def start(self, *tensors: torch.Tensor) -> tuple:
        """Post the exchange of ``tensors``; ``(requests, received)``: wait on the requests before use."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(requests) -> None:
        for request in requests:
            request.wait()


def _block_call(q, k, v, softmax_scale, causal, softcap, deterministic):
    """The call of one block of the ring: the log-sum-exp is asked for, no dropout."""
    options = FlashOptions(
        softmax_scale=softmax_scale, causal=causal, softcap=softcap, deterministic=deterministic, return_lse=True
    )
    return build_flash_call(q, k, v, options)


def _ring_forward(q, k, v, group, causal, softmax_scale, layout, softcap):
    ring = _Ring(group)
    rank = dist.get_rank(group)
    batch, seqlen, nheads, _ = q.shape
    out = q.new_zeros((batch, seqlen, nheads, v.shape[-1]), dtype=torch.float32)
    lse = q.new_full((batch, nheads, seqlen), float("-inf"), dtype=torch.float32)
    for step in range(ring.world):
        pending = ring.start(k, v) if step + 1 < ring.world else None
        for rows_q, rows_k, block_causal in _blocks(layout, causal, rank, (rank - step) % ring.world, seqlen):
            call = _block_call(q[:, rows_q], k[:, rows_k], v[:, rows_k], softmax_scale, block_causal, softcap, False)
            with torch.no_grad():
                block_out, block_lse, _ = dispatch.select(call).run_call(call)
            merge_partial(out[:, rows_q], lse[:, :, rows_q], block_out, block_lse)
        if pending is not None:
            ring.wait(pending[0])
            k, v = pending[1]
    return out.to(q.dtype), lse.masked_fill(lse == float("-inf"), float("inf"))


def _ring_backward(dout, q, k, v, out, lse, group, causal, softmax_scale, layout, softcap, deterministic):
    ring = _Ring(group)
    rank = dist.get_rank(group)
    seqlen = q.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)
    travelling = None  # (requests, (dk, dv)) of the gradients on their way to the next rank
    for step in range(ring.world):
        pending = ring.start(k, v) if step + 1 < ring.world else None
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for rows_q, rows_k, block_causal in _blocks(layout, causal, rank, (rank - step) % ring.world, seqlen):
            call = _block_call(
                q[:, rows_q], k[:, rows_k], v[:, rows_k], softmax_scale, block_causal, softcap, deterministic
            )
            with torch.no_grad():
                grads = dispatch.select(call).grad(
                    call, dout[:, rows_q], out[:, rows_q].contiguous(), lse[:, :, rows_q].contiguous()
                )
            # Each block's gradients are rounded to the input dtype before they add up.
            dq[:, rows_q] += grads[0].to(q.dtype)
            dk[:, rows_k] += grads[1].to(k.dtype)
            dv[:, rows_k] += grads[2].to(v.dtype)
        if travelling is not None:  # the gradients of this key shard from the ranks it has visited
            ring.wait(travelling[0])
            dk += travelling[1][0]
            dv += travelling[1][1]
        if ring.world > 1:
            travelling = ring.start(dk, dv)
        if pending is not None:
            ring.wait(pending[0])
            k, v = pending[1]
    if travelling is not None:  # one more hop brings each shard's gradients home
        ring.wait(travelling[0])
        dk, dv = travelling[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, layout, softcap, deterministic):
        out, lse = _ring_forward(q, k, v, group, causal, softmax_scale, layout, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (group, causal, softmax_scale, layout, softcap, deterministic)
        # The backward may run on another thread (autograd's device threads), where a use_backend
        # choice of this one is not set: it re-enters the forward's.
        ctx.backend = dispatch.forced_backend()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with dispatch.use_backend(ctx.backend):
            dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    Arguments:
        q: ``(batch_size, S / W, nheads, headdim)``, this rank's shard of the queries (module
            docstring: layouts); k, v: ``(batch_size, S / W, nheads_k, headdim)`` its shard of the
            keys and values, in the same layout; ``nheads % nheads_k == 0`` (MQA/GQA).
        causal: each query sees the keys at or before its own position in the full sequence.
        softmax_scale: default ``1 / sqrt(headdim)``.
        layout: ``"zigzag"`` (default; even shard lengths) or ``"contiguous"``.
        softcap: > 0 turns the scores into ``softcap * tanh(scores / softcap)``.
        deterministic: passed to the local backward.
        return_lse: also return this rank's rows of the log-sum-exp ``(batch_size, nheads, S / W)``
            float32.

    Returns:
        ``out (batch_size, S / W, nheads, headdim)``: this rank's rows of the full attention;
        differentiable with respect to q, k and v (the backward runs the ring again).

    Every rank must call it with the same shapes and options.
    """
    validate.check_qkv(q, k, v, ("q", "k", "v"))
    validate.check_bool("causal", causal)
    validate.check_bool("deterministic", deterministic)
    validate.check_bool("return_lse", return_lse)
    _check_layout(layout)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must be shards as long as q's ({q.shape[1]} rows), got {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(
            f"the zigzag layout holds two chunks per rank: the shard length must be even, got {q.shape[1]}"
        )
    softmax_scale = validate.check_scale(softmax_scale, q.shape[-1])
    softcap = validate.check_softcap(softcap)
    _group_size(group)
    k, v = k.contiguous(), v.contiguous()  # the shards are sent as they are
    out, lse = _RingAttention.apply(q, k, v, group, causal, softmax_scale, layout, softcap, deterministic)
    return (out, lse) if return_lse else out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    ring_group: Optional[dist.ProcessGroup] = None,
    ring_layout: str = "zigzag",
) -> torch.Tensor:
    """Attention over a sequence sharded across ``group`` (default: the world), with an all-to-all
    over heads (``flash_recipe.ulysses`` draws it).

    Arguments:
        q: ``(batch_size, S/U, nheads, headdim)``, this rank's contiguous shard of the queries
            (with ``ring_group``: of its ring shard); k, v: ``(batch_size, S/U, nheads_k, headdim)``.
            ``nheads % U == 0``; ``nheads_k % U == 0`` or ``U % nheads_k == 0``.
        causal, softmax_scale, softcap: as ``ring_attention``.
        ring_group: a second group across which the sequence is also cut, first (USP): the
            attention after the all-to-all is ``ring_attention`` over it, in ``ring_layout``.

    Returns:
        ``out (batch_size, S/U, nheads, headdim)``: this rank's rows of the full attention,
        differentiable with respect to q, k and v. Every rank must call it with the same shapes.
    """
    validate.check_qkv(q, k, v, ("q", "k", "v"))
    validate.check_bool("causal", causal)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k and v must be shards as long as q's ({q.shape[1]} rows), got {k.shape[1]}")
    softmax_scale = validate.check_scale(softmax_scale, q.shape[-1])
    softcap = validate.check_softcap(softcap)
    _check_layout(ring_layout)

    def attend(q, k, v):
        if ring_group is None:
            return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, softcap=softcap)
        return ring_attention(
            q, k, v, ring_group, causal=causal, softmax_scale=softmax_scale, layout=ring_layout, softcap=softcap
        )

    return all_to_all_attention(q, k, v, group, attend)
