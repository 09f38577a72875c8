"""One rank of the multi-process tests of ring and Ulysses attention (``test_distributed.py``,
``test_ulysses.py``, ``test_ring_flash_attn.py``, ``test_yunchang.py``) and of diffusers' context
parallelism (``test_diffusers.py``), started by ``multiprocess.run_ranks``.

``python ring_worker.py SPEC``: SPEC is JSON ``{"cases": [...]}``. The rank joins a gloo group
through ``FLASH_RECIPE_INIT`` (a ``file://`` rendezvous), ``RANK`` and ``WORLD_SIZE``; every rank
draws the same full-sequence tensors, runs its shard of each case, and the results are gathered;
rank 0 prints one line ``RESULTS <json>``: per case, the maximum errors against the fp32
reference of the full sequence (fp64 for fp32 inputs) and the accuracy rule's bounds (2x / 3x
PyTorch's error in the input precision, plus 1e-5). The test asserts them.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys

import torch
import torch.distributed as dist

import flash_recipe
from flash_recipe.distributed import ring_attention, shard, unshard
from flash_recipe.reference import attention_reference
from flash_recipe.testing import FACTORS, accuracy_bound, max_error


def inputs(case: dict, varlen: bool = False):
    """The full-sequence q, k, v and dout, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = getattr(torch, case["dtype"])
    rows = (sum(case["seqlens"]),) if varlen else (case["batch"], case["seqlen"])
    shapes = [(*rows, case["nheads"], case["headdim"]), (*rows, case["nheads_k"], case["headdim"])]
    q, k, v, dout = (torch.randn(shapes[i], generator=gen).to(dtype) for i in (0, 1, 1, 0))
    return q, k, v, dout


def oracle(q, k, v, dout, causal: bool, upcast: bool, softcap: float = 0.0, seqlens=None) -> dict:
    """The full-sequence attention (per packed sequence with ``seqlens``) and its gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if seqlens is None:
        out, lse = attention_reference(q, k, v, None, causal, upcast=upcast, softcap=softcap)
    else:
        parts = [
            attention_reference(*(t.unsqueeze(0) for t in ts), None, causal, upcast=upcast)
            for ts in zip(*(t.split(seqlens) for t in (q, k, v)))
        ]
        out = torch.cat([p[0].squeeze(0) for p in parts])
        lse = torch.cat([p[1].squeeze(0) for p in parts], dim=-1)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def judge(result: dict, q, k, v, dout, causal: bool, softcap: float = 0.0, seqlens=None, bound_dtypes=None) -> dict:
    """Errors of ``result`` against the fp32 truth, and the accuracy rule's bounds.

    ``bound_dtypes``: a tensor whose producer rounds it to another dtype than the input's
    (ring-flash-attn returns dq in bfloat16) is bounded by PyTorch computing in that dtype.
    """
    truth = oracle(q, k, v, dout, causal, True, softcap, seqlens)
    torch_errors = {}
    for dtype in {q.dtype, *(bound_dtypes or {}).values()}:
        same = oracle(*(t.to(dtype) for t in (q, k, v, dout)), causal, False, softcap, seqlens)
        torch_errors[dtype] = {n: max_error(same[n], truth[n]) for n in same}
    report = {}
    for name, value in result.items():
        dtype = (bound_dtypes or {}).get(name, q.dtype)
        error = max_error(value, truth[name])
        report[name] = {"error": error, "bound": accuracy_bound(torch_errors[dtype][name], FACTORS[name])}
    return report


def gathered(tensors: dict, layout: str, rows_dim: int = 1, lse_dim: int = 2) -> dict:
    """Every rank's shards joined into the full tensors (sequence rows along ``rows_dim``, the
    log-sum-exp's along ``lse_dim``)."""
    return {
        name: unshard(t.detach().contiguous(), layout=layout, dim=lse_dim if name == "lse" else rows_dim)
        for name, t in tensors.items()
    }


def builtin(case: dict) -> dict:
    """``flash_recipe.distributed.ring_attention`` on this rank's shard."""
    q, k, v, dout = inputs(case)
    layout, causal, softcap = case["layout"], case["causal"], case.get("softcap", 0.0)
    local = [shard(t, layout=layout).clone().requires_grad_() for t in (q, k, v)]
    call_layout = case.get("call_layout", layout)  # another layout than the shards': a test that must fail
    if case.get("sum"):  # out.sum().backward(): an output gradient of stride 0
        dout = torch.ones_like(dout)
    with flash_recipe.use_backend(case.get("backend", "reference")):
        out, lse = ring_attention(*local, causal=causal, layout=call_layout, softcap=softcap, return_lse=True)
        out.sum().backward() if case.get("sum") else out.backward(shard(dout, layout=layout))
    grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in local)))
    result = gathered({"out": out, "lse": lse, **grads}, layout)
    return judge(result, q, k, v, dout, causal, softcap)


def _zigzag_packed(t: torch.Tensor, seqlens: list, rank: int, world: int) -> torch.Tensor:
    """Each packed sequence's zigzag shard (chunks r and 2W - 1 - r of 2W), one after another."""
    parts = []
    for seq in t.split(seqlens):
        chunks = seq.chunk(2 * world)
        parts += [chunks[rank], chunks[2 * world - 1 - rank]]
    return torch.cat(parts)


def _zigzag_unpack(t: torch.Tensor, seqlens: list, world: int, dim: int = 0) -> torch.Tensor:
    """The inverse of ``_zigzag_packed`` over all ranks' shards (gathered)."""
    shards = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(shards, t.contiguous())
    local = [n // world for n in seqlens]
    pieces = [s.split(local, dim) for s in shards]  # [rank][sequence]
    sequences = []
    for i in range(len(seqlens)):
        halves = [p[i].chunk(2, dim) for p in pieces]
        sequences += [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(sequences, dim)


def ring_flash_attn_client(case: dict) -> dict:
    """ring-flash-attn, unchanged, on flash_recipe's stand-in for flash-attn."""
    if not flash_recipe.install_as_flash_attn():
        raise RuntimeError("install_as_flash_attn() left an upstream flash-attn in place")
    import ring_flash_attn

    rank, world = dist.get_rank(), dist.get_world_size()
    function, causal = case["function"], case["causal"]
    bound_dtypes = {"dq": torch.bfloat16} if function == "ring" else None  # it returns dq in bfloat16
    if function in ("ring", "zigzag"):
        q, k, v, dout = inputs(case)
        layout = "contiguous" if function == "ring" else "zigzag"
        local = [shard(t, layout=layout).clone().requires_grad_() for t in (q, k, v)]
        fn = ring_flash_attn.ring_flash_attn_func if function == "ring" else ring_flash_attn.zigzag_ring_flash_attn_func
        out, lse, _ = fn(*local, causal=causal, return_attn_probs=True)
        out.backward(shard(dout, layout=layout))
        grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in local)))
        result = gathered({"out": out, "lse": lse, **grads}, layout)
        return judge(result, q, k, v, dout, causal, bound_dtypes=bound_dtypes)
    seqlens = case["seqlens"]
    q, k, v, dout = inputs(case, varlen=True)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    if function == "zigzag_varlen":
        local = [_zigzag_packed(t, seqlens, rank, world).requires_grad_() for t in (q, k, v)]
        out = ring_flash_attn.zigzag_ring_flash_attn_varlen_func(
            *local, cu // world, max(seqlens) // world, causal=causal
        )
        out.backward(_zigzag_packed(dout, seqlens, rank, world))
        tensors = {"out": out, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
        result = {name: _zigzag_unpack(t.detach(), seqlens, world) for name, t in tensors.items()}
        return judge(result, q, k, v, dout, causal, seqlens=seqlens)
    if function == "llama3_varlen":
        cu_q, cu_k, max_q, max_k, k_slice = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens(
            cu, causal, rank, world
        )
        rows = q.shape[0] // world
        local = [t[rank * rows : (rank + 1) * rows].clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = ring_flash_attn.llama3_flash_attn_varlen_func(
            *local,
            cu_q,
            cu_k,
            max_q,
            max_k,
            heads_k_stride=case["nheads_k"],
            local_k_slice=k_slice,
            causal=causal,
            return_attn_probs=True,
        )
        out.backward(dout[rank * rows : (rank + 1) * rows])
        tensors = {"out": out, "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
        result = gathered(tensors, "contiguous", rows_dim=0, lse_dim=1)
        return judge(result, q, k, v, dout, causal, seqlens=seqlens)
    raise ValueError(f"unknown function {function!r}")


def _groups(ulysses: int):
    """``(ulysses group, ring group)`` of this rank for Ulysses degree ``ulysses`` x ring degree
    ``world / ulysses``: Ulysses groups are runs of consecutive ranks, ring groups strided (every
    rank creates every group, as torch.distributed requires)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if ulysses == world:
        return None, None
    mine = {}
    for start in range(0, world, ulysses):
        ranks = list(range(start, start + ulysses))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ulysses"] = group
    for offset in range(ulysses):
        ranks = list(range(offset, world, ulysses))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["ring"] = group
    return mine["ulysses"], mine["ring"]


def ulysses(case: dict) -> dict:
    """``flash_recipe.distributed.ulysses_attention``, alone or over a ring (USP)."""
    from flash_recipe.distributed import ulysses_attention

    q, k, v, dout = inputs(case)
    causal, layout = case["causal"], case.get("ring_layout", "zigzag")
    group, ring_group = _groups(case["ulysses"])

    def local(t):
        if ring_group is not None:
            t = shard(t, ring_group, layout=layout)
        return shard(t, group, layout="contiguous")

    def full(t):
        t = unshard(t.detach().contiguous(), group, layout="contiguous")
        return t if ring_group is None else unshard(t, ring_group, layout=layout)

    leaves = [local(t).clone().requires_grad_() for t in (q, k, v)]
    with flash_recipe.use_backend(case.get("backend", "reference")):
        call_causal = case.get("call_causal", causal)  # another mask than the oracle's: a test that must fail
        out = ulysses_attention(*leaves, group, causal=call_causal, ring_group=ring_group, ring_layout=layout)
        out.backward(local(dout))
    result = {"out": full(out), **{name: full(t.grad) for name, t in zip(("dq", "dk", "dv"), leaves)}}
    return judge(result, q, k, v, dout, causal)


def yunchang_client(case: dict) -> dict:
    """yunchang, unchanged, on flash_recipe's stand-in: ``UlyssesAttention`` over the world, or
    ``LongContextAttention`` (Ulysses x ring) with the shards yunchang's own extract functions cut."""
    if not flash_recipe.install_as_flash_attn():
        raise RuntimeError("install_as_flash_attn() left an upstream flash-attn in place")
    import yunchang
    from yunchang.kernels import AttnType

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = inputs(case)
    causal, seqlen = case["causal"], case["seqlen"]
    if case["function"] == "ulysses":
        attention = yunchang.UlyssesAttention(None, attn_type=AttnType.FA)

        def extract(t):
            return yunchang.basic_extract_local(t, rank, world)
    else:
        ring_impl, ulysses_degree = case["ring_impl"], case["ulysses"]
        yunchang.set_seq_parallel_pg(ulysses_degree, world // ulysses_degree, rank, world)
        attention = yunchang.LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType.FA)

        def extract(t):
            return yunchang.EXTRACT_FUNC_DICT[ring_impl](t, rank, world, world // ulysses_degree, ulysses_degree)

    local = [extract(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local, causal=causal)
    out.backward(extract(dout))
    # Which rows of the full sequence this rank holds: yunchang's own cut of the row numbers.
    rows = extract(torch.arange(seqlen, dtype=torch.float64).view(1, seqlen, 1, 1)).flatten().long()
    every_rows = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(every_rows, rows)

    def full(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        whole = t.new_empty((t.shape[0], seqlen, *t.shape[2:]))
        for part, where in zip(parts, every_rows):
            whole[:, where] = part
        return whole

    result = {"out": full(out), **{name: full(t.grad) for name, t in zip(("dq", "dk", "dv"), local)}}
    return judge(result, q, k, v, dout, causal)


def diffusers_client(case: dict) -> dict:
    """diffusers' own context parallelism on its ``flash`` backend, served by the stand-in: the
    small Flux transformer (``diffusers_model``) with ``enable_parallelism`` over the world, as
    ring (``ring_degree``) or Ulysses (``ulysses_degree``). Rank 0 compares its gathered output,
    and the input gradients summed over the ranks, with the single-process model in float64 and
    the rule's bound from ``native`` in the same dtype."""
    if not flash_recipe.install_as_flash_attn():
        raise RuntimeError("install_as_flash_attn() left an upstream flash-attn in place")
    # Mocked, because this machine cannot have it: an accelerator. diffusers 0.42.1 places each
    # rank on ``rank % torch.accelerator.device_count()`` (0 here: a division by zero) before it
    # asks for ``torch._C._get_accelerator()``, which is the CPU here; with a count of 1 every rank
    # runs on the CPU, and the collectives are gloo's.
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    from diffusers import ContextParallelConfig
    from diffusers.models import attention_dispatch
    from diffusers_model import errors_and_bounds, flux_model, run_model

    from flash_recipe.ops import forward

    dtype = getattr(torch, case["dtype"])
    degree = dist.get_world_size()
    parallel = ContextParallelConfig(**{f"{case['parallel']}_degree": degree})
    if case.get("shift_lse"):  # the negative test: a wrong log-sum-exp must fail the comparison
        wrapped = attention_dispatch._wrapped_flash_attn_forward

        def shifted(*args, **kwargs):
            out, lse, *rest = wrapped(*args, **kwargs)
            return (out, lse + math.log(2), *rest)

        attention_dispatch._wrapped_flash_attn_forward = shifted
    launches = []
    kernel = forward.attn_fwd_kernel.fn  # the jit function under the heuristics: every launch ends in its run
    run = kernel.run
    kernel.run = lambda *a, **k: launches.append(1) or run(*a, **k)
    model = flux_model()
    got = run_model(model, "flash", dtype, parallel=parallel)
    if dtype == torch.float16 and not launches:
        raise RuntimeError("flash_recipe's Triton forward never ran under context parallelism")
    for name in ("d_hidden", "d_encoder"):  # each rank holds the gradients of its own rows
        dist.all_reduce(got[name])
    truth = run_model(model, "native", torch.float64)
    same = run_model(model, "native", dtype)
    return errors_and_bounds(got, truth, same)


KINDS = {
    "builtin": builtin,
    "diffusers": diffusers_client,
    "ring_flash_attn": ring_flash_attn_client,
    "ulysses": ulysses,
    "yunchang": yunchang_client,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group(
        "gloo",
        init_method=os.environ["FLASH_RECIPE_INIT"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=spec.get("collective_timeout", 60)),
    )
    results = [KINDS[case["kind"]](case) for case in spec["cases"]]
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # The results are out; leave without running C++ static destructors, where gloo's threads
    # now and then abort a finished process ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
