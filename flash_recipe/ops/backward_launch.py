"""The backward's launcher: ``attention_backward`` plans the kernels of ``backward`` once per
signature and launches them by keyword, as the forward does (``launch.plan``, ``launch.launch``).

Shapes (legend as in ``forward``)::

    dout, q, out (B, Sq, H, D)   k, v (B, Sk, Hk, D)   lse, delta (B, H, Sq) float32
        ->   dq (B, Sq, H, D)   dk, dv (B, Sk, Hk, D)   dsink (H,)

Varlen: ``(total_q, H, D)``, ``(total_k, Hk, D)`` and ``(H, total_q)``. The buffers a launch
allocates, by name: ``DELTA`` (``rowsum(dout * out)``), ``LSE_FIX`` (fp32 with its own lse:
``log`` of each row's sum of P, ``FIX_LSE``), ``SINK_DELTA`` (with sinks: each row's sum of P dP,
stored by the dQ kernel on the three kernels' path and the dQ programs in one launch, added into by the
dK/dV kernel in one pass)
and ``DQ_ACC`` (one pass: the fp32 workspace dQ is added to).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton

from ..memo_keys import Memo, signature
from . import choose, configs, targets, tiles
from .backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .backward_one_launch import attn_bwd_one_launch_kernel
from .launch import Plan, launch, layout, lse_buffer, packed_rows, plan, score_args
from .options import SCORE_FIELDS, VARLEN_FIELDS, ScoreOptions, Varlen
from .schedule import launch_section


class BackwardPlan(NamedTuple):
    """What a backward launch of one signature does, decided once."""

    delta_shape: tuple  # the shape of DELTA, LSE_FIX and SINK_DELTA: lse's
    preprocess: Plan
    dq: Optional[Plan]  # the three kernels' dQ kernel; None in one pass and in one launch
    dkdv: Plan  # the dK/dV kernel, or the one-launch kernel (dK, dV and dQ)
    renorm: bool  # LSE_FIX is allocated (fp32 with its own lse)
    one_pass: bool  # DQ_ACC is allocated, and becomes dq
    tuned: tuple  # the tuned configurations it took (``choose.tuned_fallback``)


# Signature of a backward launch (``_plan_key``) -> its ``BackwardPlan``.
_PLANS = Memo()


@choose.tuned_fallback
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: ScoreOptions,
    varlen: Optional[Varlen] = None,
    own_lse: bool = True,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the backward: one pass, one launch, or the three kernels of the deterministic path.

    Args:
        dout, q, out: ``(B, Sq, H, D)`` (varlen: ``(total_q, H, D)``); k, v: ``(B, Sk, Hk, D)``
            (varlen: ``(total_k, Hk, D)``); lse as returned by ``attention_forward`` with the same
            ``options`` and ``varlen``. Any strides: where dout's differ from q's, or
            v's from k's, one of the pair is copied (``shared_layout``).
        own_lse: ``out`` and ``lse`` are this attention's own, so a row that sees one key has
            dS = 0 exactly (``sees_one_key``). False: they may be those of a larger attention of
            which k, v are one block (ring attention), where that row's dS is not 0.
        deterministic: the two-pass path (dQ kernel, then dK/dV), bit-identical from run to run,
            dsink included (the dQ kernel stores each row's share; no kernel uses atomics).
            Otherwise, and always but for fp32 with its own lse (``FIX_LSE`` needs dQ's row sums
            first), the dK/dV kernel also adds dQ to an fp32 workspace with atomic adds: 5 matrix
            products per block pair instead of 7, with the last bits of dQ (and with sinks dsink's,
            each row's sum of P dP added per key block) in the order the adds land,
            where the device's path is one pass (``choose.backward_path``: the target's default per
            head dim, ``configs.BACKWARD_PATHS``, or what ``flash-recipe tune`` measured); where
            it is not, or the installed Triton spills the one-pass tile (``choose.one_pass_fits``:
            Hopper at head dim 128 before Triton 3.4), the three kernels run. Where the device's
            path is one launch (``backward_one_launch``: a tuned choice, never a family default),
            that runs, deterministic or not: it uses no atomics either.

    Returns:
        ``dq``, ``dk``, ``dv`` shaped like q, k, v, contiguous, in q's dtype, and with
        ``options.sinks`` the sinks' gradient ``dsink`` shaped and typed like them (else None).
    """
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dout.stride() != q.stride():  # tested here, so that a call whose pairs share strides calls nothing
        q, dout = shared_layout(q, dout)
    if v.stride() != k.stride():
        k, v = shared_layout(k, v)
    key = _plan_key(dout, q, k, v, out, lse, options, varlen, own_lse, deterministic)
    found = _PLANS.get(key) if key is not None else None
    if found is None:  # a planned signature has keys and query rows: only a new one can be empty
        dims = layout(q, k, varlen)
        if q.numel() == 0 or k.numel() == 0 or dims.seqlen_q == 0 or dims.seqlen_k == 0:
            return _no_keys(dout, q, k, v, out, lse, options.sinks)
        found = _PLANS.keep(key, plan_backward(dout, q, k, v, out, lse, options, varlen, own_lse, deterministic))
    elif found.tuned:
        choose.record_tuned(found.tuned)
    return run_backward(found, dout, q, k, v, out, lse, options, varlen)


def shared_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (one shape) with one set of strides, as the backward kernels read them (q's
    for dout, k's for v: ``backward``): as given where they share strides (no copy); else ``b``
    copied into ``a``'s layout where ``a`` is dense (its elements fill its span, in any order);
    else (``a`` a view into a larger tensor, as q of a packed qkv) ``b`` copied into a dense
    layout of ``a``'s dimension order, and ``a`` copied into that layout too."""
    if a.stride() == b.stride():
        return a, b
    b = torch.empty_like(a, dtype=b.dtype).copy_(b)  # a's strides where a is dense, else dense in a's order
    if b.stride() != a.stride():
        a = torch.empty_like(b, dtype=a.dtype).copy_(a)  # b is dense: its strides kept
    return a, b


def _no_keys(dout, q, k, v, out, lse, sinks):
    """No key or no element: P = 0 and dS = 0, zero gradients; the sinks still see delta (0 where
    out is, as a row with no key's)."""
    dq = tiles.output_buffer(q.shape, dtype=q.dtype, device=q.device).zero_()
    dk = tiles.output_buffer(k.shape, dtype=k.dtype, device=k.device).zero_()
    dv = tiles.output_buffer(v.shape, dtype=v.dtype, device=v.device).zero_()
    if sinks is None:
        return dq, dk, dv, None
    if q.numel() == 0:
        return dq, dk, dv, torch.zeros_like(sinks)
    delta = (dout.float() * out.float()).sum(-1).movedim(-1, -2)
    return dq, dk, dv, _sink_grad(sinks, lse, delta, None)


def _plan_key(dout, q, k, v, out, lse, options, varlen, own_lse, deterministic) -> Optional[tuple]:
    """The signature that decides a backward launch: tensors, options, the path, and the settings
    that can change at run time (the interpreter, the tuned configurations); None: not memoized."""
    state = choose.plan_state()
    if state is None:
        return None
    # Every field of the records (``options.SCORE_FIELDS``...), none by hand; a dense call's key is the shorter.
    tensors = (dout, q, k, v, out, lse) + SCORE_FIELDS.tensors_of(options)
    values = SCORE_FIELDS.values_of(options) + (own_lse, deterministic)
    if varlen is not None:
        tensors += VARLEN_FIELDS.tensors_of(varlen)
        values += VARLEN_FIELDS.values_of(varlen)
    found = signature(tensors, values)
    return None if found is None else (found, state, targets.target_of(q.device))


def plan_backward(dout, q, k, v, out, lse, options: ScoreOptions, varlen: Optional[Varlen], own_lse: bool,
                  deterministic: bool) -> BackwardPlan:
    """Decide a backward launch (the first call of its signature): path, configurations, grids and
    arguments; the buffers it allocates stand here as meta tensors, for their strides."""
    used = choose.tuned_recorded()
    before = len(used) if used is not None else 0
    dims = layout(q, k, varlen)
    block_d = configs.head_dim_bucket(dims.head_dim)
    meta = torch.empty(q.shape, dtype=q.dtype, device="meta")
    delta, stride_lb, stride_lh = lse_buffer(meta, varlen, dims)
    sinks = options.sinks
    renorm = own_lse and q.element_size() == 4  # fp32: dK/dV renormalise P by dQ's row sums
    lse_fix = delta if renorm else None
    own_lse = own_lse and sinks is None  # the one-key rules assume P sums to 1 (see ``backward``)
    path = "three_kernels" if renorm else choose.backward_path(q.device, dims.head_dim, q.element_size())
    if deterministic and path == "one_pass":  # the other two use no atomics
        path = "three_kernels"
    one_pass = path == "one_pass"
    # The sinks' gradient weighs each row's sum of P dP (``_sink_grad``): stored once per row by the
    # dQ kernel on the three kernels' path (no atomics), added per key block by the dK/dV kernel's
    # atomics in one pass.
    sink_delta = delta if sinks is not None else None
    dq_acc = torch.empty(q.shape, dtype=torch.float32, device="meta") if one_pass else None
    cu_q, cu_k = (varlen.cu_seqlens_q, varlen.cu_seqlens_k) if varlen is not None else (None, None)
    rows = packed_rows(q, k, varlen)
    # What the dK/dV and dQ kernels share: inputs, sizes and score options.
    common = dict(
        Q=q, K=k, V=v, DO=dout, LSE=lse, DELTA=delta, LSE_FIX=lse_fix, CU_Q=cu_q, CU_K=cu_k,
        **dims.stride_args(q, "q", "m"), **dims.stride_args(k, "k", "n"), stride_lb=stride_lb, stride_lh=stride_lh,
        nheads=dims.nheads, group_size=dims.nheads // dims.nheads_k, seqlen_q=dims.seqlen_q, seqlen_k=dims.seqlen_k,
        **rows, head_dim=dims.head_dim, **score_args(options, dims.seqlen_k),
        BLOCK_D=block_d, OWN_LSE=own_lse,
    )
    pre_m = 64
    preprocess = plan(attn_bwd_preprocess_kernel, (triton.cdiv(dims.seqlen_q, pre_m), dims.nheads, dims.batch), dict(
        O=out, DO=dout, DELTA=delta, CU_Q=cu_q if cu_q is not None else delta, **dims.stride_args(out, "o", "m"),
        **dims.stride_args(dout, "do", "m"), stride_lb=stride_lb, stride_lh=stride_lh,
        seqlen_q=dims.seqlen_q, total_q=rows["total_q"], head_dim=dims.head_dim,
        VARLEN=varlen is not None, BLOCK_M=pre_m, BLOCK_D=block_d,
    ), q.device)
    if path == "one_launch":
        fused = _one_launch_plan(q, k, v, dims, common, sink_delta)
        taken = tuple(used[before:]) if used is not None else ()
        return BackwardPlan(tuple(delta.shape), preprocess, None, fused, renorm, False, taken)
    dq_plan = None
    if not one_pass:  # dQ first: with FIX_LSE it writes the row sums dK/dV divide out.
        cfg = choose.launch_config(q.device, "bwd_dq", dims.head_dim, q.element_size())
        blocks = triton.cdiv(dims.seqlen_q, cfg.block_m)
        dq = torch.empty(q.shape, dtype=q.dtype, device="meta")
        dq_plan = plan(attn_bwd_dq_kernel, (blocks, dims.nheads, dims.batch), dict(
            head_section=launch_section(dims.nheads * dims.batch, blocks, dims.seqlen_k, dims.head_dim,
                                        k.element_size(), q.device, options.window_left, options.window_right),
            DQ=dq, **dims.stride_args(dq, "dq", "m"), **common, SINKS=sinks if renorm else None, SINK_DELTA=sink_delta,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ), q.device)
    workspace = dims.stride_args(dq_acc, "dqa", "m") if dq_acc is not None else dict.fromkeys(
        ("stride_dqab", "stride_dqam", "stride_dqah"), 0)
    cfg = choose.launch_config(q.device, "bwd_onepass" if one_pass else "bwd_dkdv", dims.head_dim, q.element_size())
    # dQ's product transposed where the query tile has fewer rows than the family's fast matrix
    # instruction takes and the head dim has enough (Hopper's wgmma, Blackwell's tcgen05: 64), up
    # to head dim 128 (at 256, sm100's 32x32 tile spilled 256-280 B transposed, 48-56 B direct).
    least_rows = configs.MMA_MIN_ROWS.get(configs.arch_family(targets.target_of(q.device)), 1)
    dq_transposed = one_pass and cfg.block_m < least_rows <= block_d <= 128
    dk = torch.empty(k.shape, dtype=k.dtype, device="meta")
    dv = torch.empty(v.shape, dtype=v.dtype, device="meta")
    dkdv = plan(attn_bwd_dkdv_kernel, (triton.cdiv(dims.seqlen_k, cfg.block_n), dims.nheads_k, dims.batch), dict(
        DK=dk, DV=dv, DQ_ACC=dq_acc, SINK_DELTA=sink_delta if one_pass else None, **dims.stride_args(dk, "dk", "n"),
        **dims.stride_args(dv, "dv", "n"), **workspace, **common,
        DQ_TRANSPOSED=dq_transposed, STAGES=cfg.num_stages,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ), q.device)
    taken = tuple(used[before:]) if used is not None else ()
    return BackwardPlan(tuple(delta.shape), preprocess, dq_plan, dkdv, renorm, one_pass, taken)


def _one_launch_plan(q, k, v, dims, common: dict, sink_delta) -> Plan:
    """The one-launch kernel's plan (``backward_one_launch``): ``cdiv(Sk, BLOCK_N)`` key-block
    programs, then ``group_size`` query-block programs of ``BLOCK_N`` rows per block, per kv head."""
    cfg = choose.launch_config(q.device, configs.ONE_LAUNCH, dims.head_dim, q.element_size())
    key_programs = triton.cdiv(dims.seqlen_k, cfg.block_n)
    query_programs = common["group_size"] * triton.cdiv(dims.seqlen_q, cfg.block_n)
    dq = torch.empty(q.shape, dtype=q.dtype, device="meta")
    dk = torch.empty(k.shape, dtype=k.dtype, device="meta")
    dv = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return plan(attn_bwd_one_launch_kernel, (key_programs + query_programs, dims.nheads_k, dims.batch), dict(
        DQ=dq, DK=dk, DV=dv, SINK_DELTA=sink_delta, **dims.stride_args(dq, "dq", "m"),
        **dims.stride_args(dk, "dk", "n"), **dims.stride_args(dv, "dv", "n"), **common, key_programs=key_programs,
        STAGES=cfg.num_stages, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    ), q.device)


def run_backward(p: BackwardPlan, dout, q, k, v, out, lse, options: ScoreOptions, varlen: Optional[Varlen]):
    """Allocate the gradients and buffers and launch a planned backward with this call's tensors."""
    delta = tiles.output_buffer(p.delta_shape, dtype=torch.float32, device=q.device)
    lse_fix = tiles.output_buffer(p.delta_shape, dtype=torch.float32, device=q.device) if p.renorm else None
    sink_delta = None
    if options.sinks is not None:  # one pass adds into it; the dQ kernel writes every row
        sink_delta = (torch.zeros(p.delta_shape, dtype=torch.float32, device=q.device) if p.one_pass
                      else tiles.output_buffer(p.delta_shape, dtype=torch.float32, device=q.device))
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if p.one_pass else None
    dq = None if p.one_pass else tiles.output_buffer(q.shape, dtype=q.dtype, device=q.device)
    dk = tiles.output_buffer(k.shape, dtype=k.dtype, device=k.device)
    dv = tiles.output_buffer(v.shape, dtype=v.dtype, device=v.device)
    cu_q, cu_k = (varlen.cu_seqlens_q, varlen.cu_seqlens_k) if varlen is not None else (None, None)
    given = dict(
        O=out, DO=dout, Q=q, K=k, V=v, LSE=lse, DELTA=delta, LSE_FIX=lse_fix, SINK_DELTA=sink_delta, DQ_ACC=dq_acc,
        DQ=dq, DK=dk, DV=dv, CU_Q=cu_q, CU_K=cu_k, SLOPES=options.alibi_slopes, SEED=options.seed,
        SINKS=options.sinks,
    )
    preprocess = {**given, "CU_Q": cu_q if cu_q is not None else delta}  # DELTA stands in for an absent CU_Q
    launch(p.preprocess, {name: preprocess[name] for name in p.preprocess.tensors})
    if p.dq is not None:
        launch(p.dq, {name: given[name] for name in p.dq.tensors})
    launch(p.dkdv, {name: given[name] for name in p.dkdv.tensors})
    if dq_acc is not None:
        dq = dq_acc.to(q.dtype)  # the workspace in q's dtype: one elementwise kernel
    dsink = _sink_grad(options.sinks, lse, sink_delta, lse_fix) if sink_delta is not None else None
    return dq, dk, dv, dsink


def _sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, lse_fix: Optional[torch.Tensor]):
    """``dsink[h] = -sum over rows of p_sink * delta``, with ``p_sink = exp(sink[h] - lse)`` (over
    ``exp(lse_fix)`` with ``FIX_LSE``, as dK/dV's P) and ``delta`` each row's ``sum_j P dP`` (the
    kernels' ``SINK_ROWS``: ``rowsum(dO * O)`` without O's rounding to its dtype, which in fp16
    moved dsink past the accuracy rule). ``lse``, ``delta``, ``lse_fix``: ``(B, H, Sq)`` or varlen
    ``(H, total_q)`` float32; returns ``(H,)`` in the sinks' dtype. The sum is torch's, in the
    same order every run: bit-identical where ``delta`` is (the three kernels' dQ kernel)."""
    logits = sinks.float()[:, None] - lse  # broadcasts over (B, H, Sq) and (H, total_q)
    if lse_fix is not None:
        logits = logits - lse_fix
    rows = tuple(d for d in range(lse.dim()) if d != lse.dim() - 2)  # every dim but the head's
    return (-(torch.exp(logits) * delta).sum(dim=rows)).to(sinks.dtype)
