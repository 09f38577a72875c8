"""Compile the kernels for GPU architectures without a GPU, as a launch would, and check resources.

A Triton kernel is compiled for the arguments it is launched with: 16-byte-aligned pointers and
integers divisible by 16 get ``tt.divisibility`` hints (which enable vectorised, multi-buffered
loads and so decide the shared memory a launch needs), and integers equal to 1 become constants.
This check therefore does not build signatures by hand: it calls the real launchers
(``attention_forward``, ``attention_backward``, ``attention_kvcache``) with CPU tensors shaped
like a real call, and lets Triton's own launch path specialise and compile each kernel for the
chosen target. The only stand-ins are for the GPU itself (``flash_recipe.ops.offline``): an
offline driver that names the target and launches nothing (Triton then compiles as for a warm-up),
and ``targets.target_of``, which answers with that target instead of asking a device.

Each call is made in two forms:

- ``aligned``: what most users run: head dim equal to its bucket, sequence lengths multiples of
  the blocks, separate contiguous q/k/v, MHA, causal (the ``options`` call: every score option);
- ``ragged``: the worst case the dispatcher can launch: head dim below its bucket (masked
  columns), ragged lengths, GQA, every score option (window, softcap, ALiBi, dropout), and q/k/v
  as strided views of one packed ``qkv`` tensor with odd row strides; the ``fwd`` call, whose
  plain-score configuration the options and a masked head dim do not use, has the window alone
  and every column of its bucket.

For every compiled kernel it reports shared memory against the architecture's opt-in limit
(``configs.SHARED_MEMORY_LIMIT``), registers and spilled bytes per thread (the cubin's resource
usage on NVIDIA, the code object's metadata on AMD), the matrix instruction its dots use, and on
NVIDIA the SASS instructions of one main-loop iteration per row it advances (``compiled_code.main_loop``: per key
for the forward). A kernel fails when its compiled code stores nothing (Triton lowers what it cannot
lower properly to a trap), when it exceeds the shared-memory limit, when any of its fp16/bf16 dots
is lowered to FMA instead of the matrix units, when, as one of the tiled attention kernels in
fp16/bf16 in the aligned form at a head dim up to 128 without score options (softcap, ALiBi,
dropout), it spills more than ``SPILL_BUDGET`` bytes, when, as the warp-specialised forward
(``fwd_ws``) where the runtime rule enables it, it fails to compile or leaves its loop whole (where
the rule does not enable it on the installed Triton, one row says "not enabled on this Triton"), or
when, as the aligned sm90 forward at head dim 128, its main loop costs more instructions per key
than Triton's tutorial kernel (``PROXY``).
A kernel of the deterministic backward (``DETERMINISTIC_KERNELS``) also fails where its TTIR holds
an atomic operation.
The other spills are reported, not failed: every score option at once (dropout's random numbers
above all) and a head dim whose mask Triton cannot vectorise cost registers that the tables' tiles
do not avoid, and fp32 (full-precision dots on the FMA units) is the slow path by design. Run it
as::

    python -m devtools.compile_check --target sm90 --target sm120 [--json]

It must run with ``TRITON_INTERPRET`` unset (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Optional

from flash_recipe.ops import configs, features, limits, targets
from flash_recipe.tools.compile_calls import DECODE_GROUPS, SCORE_OPTIONS, Case, compile_case, constants

from . import compiled_code

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIM_BUCKETS = limits.HEAD_DIM_BUCKETS
# Launcher calls: "fwd" the dense forward with plain scores (its "fwd" configuration); "options"
# the dense forward with every score option (its "fwd_general" configuration); "bwd" the backward,
# one-pass (preprocess, dK/dV adding dQ) and deterministic (preprocess, dQ, dK/dV); "varlen" the
# packed-sequence forward and backward; "decode" a GQA KV-cache step over a dense cache
# (rotary/append, the forward with decode tiles and the group packed into one query tile, split-KV
# merge); "decode_paged" the same over a paged cache; "paged" the forward over a paged cache with
# more query rows than a decode step; "sinks" the forward and backward
# with attention sinks (aligned: the "bwd" call's causal tensors; ragged: every score option; every
# backward path: the one pass where the release compiles it, the three kernels, the one launch where offered);
# "int8" 8-bit attention (the quantizer, then the kernel with fp16 P.V and, on targets with FP8
# tensor cores, FP8 P.V: ``ops.int8_attention``), causal; "fwd_ws" the "fwd" call's forward, causal
# and not, with warp specialisation asked for (``ops.features.warp_specialization``: a kernel of its
# own, "fwd_ws", where the target and head dim take it, else the plain one; where the installed
# Triton does not compile it, a row "not enabled on this Triton": ``warp_spec_not_enabled``); "one_key" the backward
# of a window of width one, where the dK/dV kernel gives every row its exact softmax (``EXACT_ONE_KEY``):
# degenerate calls, reported, not in a preset (sm86's one pass at head dim 64 spills 8 B there);
# "one_pass" the "bwd" call's one-pass backward whatever the installed Triton's release rule says
# (``choose.one_pass_fits``), MHA and GQA, each without and with attention sinks ("-sinks" rows):
# what ``configs.ONE_PASS_TRITON`` is measured from, not in a preset; "folded" the "fwd" call's
# forward, the "bwd" call's backward (the target's path) and the "int8" call with the batch past the
# grid's axis-2 limit, folded into axis 0 (``ops.launch.fold_grid``; ``compile_calls.FOLD_BATCH``);
# "one_launch" the one-launch backward (``ops.backward_one_launch``) where the table has its tiles
# (``configs.ONE_LAUNCH_FAMILIES``; elsewhere it compiles nothing), as "one_pass" ("-sinks" rows).
CALLS = ("fwd", "options", "bwd", "varlen", "decode", "decode_paged", "paged", "sinks", "int8", "fwd_ws", "one_key")
CALLS += ("one_pass", "folded", "one_launch")
FORMS = ("aligned", "ragged")
TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "sm121", "gfx90a", "gfx942", "gfx950")
# Spilled bytes per thread allowed in the tiled kernels (forward, decode, dK/dV, dQ) in fp16/bf16,
# aligned form, head dims up to 128; the rest report theirs.
SPILL_BUDGET = 0
SPILL_BUDGET_MAX_HEAD_DIM = 128
# Named selections (``--preset``), each a list of (calls, dtypes, head dims, forms, targets).
# "full": the forward (plain and every score option), the backward and a KV-cache decode step at the
# largest head dim of each configuration row (64, 128, 256) on every target, aligned, in bf16; the
# same in fp32, at the small head dims (16, 32) and in the (slow) ragged form on one target per
# configuration family (fp16 compiles to the same tiles as bf16; sm89, sm121 and gfx90a have their
# family target's limits and tables, gfx950 more room and gfx942's tables); packed sequences and
# paged caches at every head dim; sinks, 8-bit attention, folded grids and the warp-specialised
# forward. About 2,000 kernels: run it when a kernel, a configuration table or a limit changes.
# "ci" (``nox -s compile_check``, what CI runs): the forward, backward and decode step at head dim
# 128 on every target (aligned, bf16); on one target per family the other configuration rows (64,
# 256), the score options and a paged decode step, fp32 at 256 (where shared memory binds), head
# dim 32, the ragged form, packed sequences, paged caches, sinks and 8-bit attention at 128; the
# folded grids and the warp-specialised forward as in full. About a quarter of full's calls; the
# rest are for a kernel, table or limit change.
# "compat" (``nox -s torch_compat``, once per torch release): the forward, backward and decode
# step for sm80 and sm90 at head dim 128 in bf16, both forms, and the warp-specialised forward on
# sm100 at the head dims it is offered (aligned, bf16), which a Triton that does not compile it
# reports as not enabled. "triton" (``nox -s compile_check_triton``, a Triton without its torch):
# the forward, backward and decode step for sm80, sm90 and sm100 at head dim 128 in bf16, aligned,
# and the same warp-specialised forward.
_CI_CALLS = ("fwd", "options", "bwd", "decode", "decode_paged")
_CI_HEAD_DIMS, _SMALL_HEAD_DIMS = (64, 128, 256), (16, 32)
FAMILY_TARGETS = ("sm80", "sm86", "sm90", "sm100", "sm120", "gfx942")
ONE_LAUNCH_TARGETS = ("sm80", "sm86", "sm90", "sm100", "sm120")  # a target of each of configs.ONE_LAUNCH_FAMILIES
ALL = (CALLS, DTYPES, HEAD_DIM_BUCKETS, FORMS, TARGETS)
PRESETS = {
    "ci": [
        # Every target: the forward, the backward and a decode step at head dim 128, aligned, bf16.
        (("fwd", "bwd", "decode"), ("bfloat16",), (128,), ("aligned",), TARGETS),
        # One target per family: the other configuration rows (64, 256), the score options and a
        # paged decode step, fp32 tiles where shared memory binds, the small head dims, the ragged
        # form, packed sequences and paged caches, sinks and 8-bit attention.
        (("fwd", "bwd", "decode"), ("bfloat16",), (64, 256), ("aligned",), FAMILY_TARGETS),
        (("options", "decode_paged"), ("bfloat16",), (128,), ("aligned",), FAMILY_TARGETS),
        (("fwd", "bwd"), ("float32",), (256,), ("aligned",), FAMILY_TARGETS),
        (("fwd", "bwd"), ("bfloat16",), (32,), ("aligned",), FAMILY_TARGETS),
        (("fwd", "bwd"), ("bfloat16",), (128,), ("ragged",), FAMILY_TARGETS),
        (("varlen", "paged"), ("bfloat16",), (128,), ("aligned",), FAMILY_TARGETS),
        (("sinks", "int8"), ("bfloat16",), (128,), ("aligned",), FAMILY_TARGETS),
        (("int8",), ("bfloat16",), (128,), ("ragged",), FAMILY_TARGETS),
        (("folded",), ("bfloat16",), (128,), ("aligned",), ("sm80", "sm90", "sm100", "gfx942")),
        (("fwd_ws",), ("bfloat16",), _SMALL_HEAD_DIMS + (64, 128), ("aligned",), ("sm100",)),
        # The one-launch backward where it is a candidate (``configs.ONE_LAUNCH_FAMILIES``): its two
        # rows on one target per NVIDIA family.
        (("one_launch",), ("bfloat16",), (64, 128), ("aligned",), ONE_LAUNCH_TARGETS),
    ],
    "full": [
        (_CI_CALLS, ("bfloat16",), _CI_HEAD_DIMS, ("aligned",), TARGETS),
        (_CI_CALLS, ("float32",), _CI_HEAD_DIMS, ("aligned",), FAMILY_TARGETS),
        (_CI_CALLS, ("bfloat16",), _SMALL_HEAD_DIMS, ("aligned",), FAMILY_TARGETS),
        (_CI_CALLS, ("bfloat16",), _CI_HEAD_DIMS, ("ragged",), FAMILY_TARGETS),
        # Packed sequences and paged caches take the general forward (and varlen the backward) with
        # their own registers: no spill at head dim <= 128 on any family.
        (("varlen", "paged"), ("bfloat16",), _SMALL_HEAD_DIMS + _CI_HEAD_DIMS, ("aligned",), FAMILY_TARGETS),
        # Attention sinks: the forward and the backward with them on every target (no spill at head
        # dim <= 128: the sinks only set each row's starting max and sum).
        (("sinks",), ("bfloat16",), (128,), ("aligned",), TARGETS),
        (("sinks",), ("bfloat16",), (64,), ("aligned",), FAMILY_TARGETS),
        # 8-bit attention on every target (its rules: ``int8_problems``), ragged on one per family.
        (("int8",), ("bfloat16",), _CI_HEAD_DIMS, ("aligned",), TARGETS),
        (("int8",), ("bfloat16",), (64, 128), ("ragged",), FAMILY_TARGETS),
        # Grids folded past CUDA's axis-2 limit (``ops.launch.fold_grid``), one target per NVIDIA
        # generation and AMD's: the kernels' ids through ``tiles.grid_id`` with ``GRID_FOLD`` 2.
        (("folded",), ("bfloat16",), (128,), ("aligned",), ("sm80", "sm90", "sm100", "gfx942")),
        # The warp-specialised forward where it is offered (``ops.features.WARP_SPEC_FAMILIES``).
        (("fwd_ws",), ("bfloat16",), _SMALL_HEAD_DIMS + (64, 128), ("aligned",), ("sm100",)),
        (("one_launch",), ("bfloat16",), (16, 32, 64, 128), FORMS, ONE_LAUNCH_TARGETS),
    ],
    "compat": [
        (("fwd", "bwd", "decode", "decode_paged"), ("bfloat16",), (128,), FORMS, ("sm80", "sm90")),
        (("fwd_ws",), ("bfloat16",), _SMALL_HEAD_DIMS + (64, 128), ("aligned",), ("sm100",)),
    ],
    "triton": [
        (("fwd", "bwd", "decode"), ("bfloat16",), (128,), ("aligned",), ("sm80", "sm90", "sm100")),
        (("fwd_ws",), ("bfloat16",), _SMALL_HEAD_DIMS + (64, 128), ("aligned",), ("sm100",)),
    ],
}
# Kernels launched with a fixed configuration and no dots (no matrix units to check).
ELEMENTWISE = ("bwd_preprocess", "rotary_append", "split_combine", "quantize")
# The deterministic backward's kernels (``deterministic=True``: the preprocess, dQ and dK/dV
# kernels, the last adding no dQ), whose TTIR must hold none of ``ATOMIC_OPS``: gradients, the
# sinks' included, bit-identical from run to run.
DETERMINISTIC_KERNELS = ("bwd_preprocess", "bwd_dq", "bwd_dkdv", "bwd_onelaunch")
ATOMIC_OPS = ("tt.atomic_rmw", "tt.atomic_cas")
SINKS_KERNEL = {"one_pass": "attn_bwd_dkdv_kernel", "one_launch": "attn_bwd_one_launch_kernel"}  # "-sinks" rows
# The kernels a GQA launch compiles apart (``group_size`` above 1), whose rows say so ("-gqa").
GROUPED_KERNELS = ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_one_launch_kernel")
# The rows one iteration of a tiled kernel's main loop advances by: keys for the forward, decode and
# dQ kernels, queries for dK/dV.
LOOP_STEP = {
    "fwd": "BLOCK_N",
    "fwd_general": "BLOCK_N",
    "fwd_ws": "BLOCK_N",
    "decode": "BLOCK_N",
    "bwd_dq": "BLOCK_N",
    "bwd_dkdv": "BLOCK_M",
    "bwd_onepass": "BLOCK_M",
    "bwd_onelaunch": "BLOCK_M",  # both kinds of its programs step BLOCK_M rows
    "int8": "BLOCK_N",
    "int8_fp8": "BLOCK_N",
}
# Matrix products per (query block, key block) pair in a kernel's main loop (the multiply-adds of
# its matrix instructions, ``compiled_code.loop_matrix_macs``, over BLOCK_M * BLOCK_N * D), for the
# aligned fp16/bf16 kernels at head dim 128 on PRODUCT_TARGETS: the forward's S = QK^T and PV; the
# deterministic backward's dQ kernel (S, dP = dO V^T, dS K) and dK/dV kernel (S, dP, P^T dO, dS^T Q),
# 7 per pair; the one-pass backward's dK/dV kernel with dQ added (5).
PRODUCTS = {"fwd": 2, "bwd_dq": 3, "bwd_dkdv": 4, "bwd_onepass": 5, "int8": 2, "int8_fp8": 2}
PRODUCT_TARGETS = ("sm80", "sm90")
# Targets whose fast matrix instruction works on tiles of 64 rows or more (sm90's wgmma, sm100's
# tcgen05) and still run Ampere's mma.sync, at a fraction of the rate, for a dot it cannot take:
# there the backward's dots must all be on the fast unit (no ``mma.sync`` dot in the TTGIR, no
# ``HMMA`` in the main loop's SASS), in fp16/bf16 at head dims 64 and 128, both forms. (sm100's
# backward at head dim 256 has 32-key blocks, its 64-key ones compiling to a trap, and so runs
# the key-side products on mma.sync: reported, not failed.)
FAST_MMA_TARGETS = ("sm90", "sm100")
FAST_MMA_KERNELS = ("bwd_onepass", "bwd_dkdv", "bwd_dq", "bwd_onelaunch")
FAST_MMA_HEAD_DIMS = (64, 128)
# The speed proxy: SASS instructions per key in the forward's main loop (``loop_per_row``), at most
# those of Triton's own tutorial fused-attention forward (python/tutorials/06-fused-attention.py)
# counted the same way (``compiled_code.main_loop``), for the aligned bf16/fp16 forward at head dim 128 on sm90.
# Measured outside the project with Triton 3.9.0, the tutorial compiled as it runs on Hopper (host
# tensor descriptors, 128x128 tiles, 8 warps), its loop costs 521, 521 and 519 instructions per
# 128 keys with 2, 3 and 4 stages: the best is 519 / 128.
PROXY = {"target": "sm90", "kernel": "fwd", "head_dim": 128, "per_key": 519 / 128, "since_triton": (3, 9)}
# Decoding must stay bound by the bytes it reads, not by the instructions it issues: warp-instructions
# per cached key per kv head (the main loop's instructions x warps / BLOCK_N, times the programs
# that read one kv head's cache: 1 when the group is packed, else the group) at most these, for the
# aligned fp16/bf16 decode step at head dim 128 on DECODE_TARGETS. An H100 issues about 9.7e11
# warp-instructions/s against 3.35 TB/s of HBM, so at 512 bytes per key (d128, bf16) about 148 per
# key saturate it; H200 (4.8 TB/s) leaves about 100. The aligned calls decode one query row with
# groups 4 (dense) and 8 (paged): both pack into one 16-row tile, the same kernel (DECODE_GROUPS).
DECODE_BOUND = {"decode": 32, "decode_paged": 48}
DECODE_TARGETS = ("sm80", "sm90")


def cases(calls=CALLS, dtypes=DTYPES, buckets=HEAD_DIM_BUCKETS, forms=FORMS) -> Iterator[Case]:
    """Every combination of call, dtype, head-dim bucket and form."""
    for call, dtype, head_dim, form in itertools.product(calls, dtypes, buckets, forms):
        yield Case(call, dtype, head_dim, form)


def warp_spec_not_enabled(case: Case, target: str) -> Optional[str]:
    """For a ``fwd_ws`` case at a target and head dim the warp-specialised forward is offered
    (``features.WARP_SPEC_FAMILIES``, ``WARP_SPEC_HEAD_DIMS``): why the runtime rule does not
    enable it on the installed Triton (``features.warp_specialization_triton_problem``), or None."""
    if case.call != "fwd_ws" or case.head_dim not in features.WARP_SPEC_HEAD_DIMS:
        return None
    if not features.takes_warp_specialization(target):
        return None  # not offered: the plain forward compiles, as at run time
    return features.warp_specialization_triton_problem(target, case.head_dim)


def check_case(case: Case, target: str) -> list[dict]:
    """Compile ``case`` for ``target`` through the launch path; one report row per kernel launched.

    A ``fwd_ws`` case the runtime rule does not enable on this Triton (``warp_spec_not_enabled``)
    compiles nothing: one passing row says why. Where the rule enables it, a launch that falls back
    to the plain forward (``choose.tuned_fallback``) raises its ``WarpSpecializationWarning``: the
    rule enabled what does not compile, and ``check_job`` reports the case failed."""
    reason = warp_spec_not_enabled(case, target)
    if reason:
        row = {"case": case.id, "kernel": case.call, "target": target, "dtype": case.dtype, "head_dim": case.head_dim}
        return [{**row, "form": case.form, "call": case.call, "not_enabled": reason, "ok": True, "problems": []}]
    start = time.perf_counter()
    with warnings.catch_warnings():
        if case.call == "fwd_ws":
            features.forget_warp_specialization_failures()  # an earlier case's fall back hides nothing
            warnings.simplefilter("error", features.WarpSpecializationWarning)
        compiled = compile_case(case, target)
    seconds = round(time.perf_counter() - start, 2)
    rows = []
    for label, name, kernel in compiled:
        # The backward kernels' GQA specialisation (group_size above 1) is a row of its own.
        grouped = name in GROUPED_KERNELS and constants(kernel).get("group_size") != 1
        # Those calls' launches with attention sinks pass SINK_DELTA (None, a constant, without).
        sinks = SINKS_KERNEL.get(case.call) == name and "SINK_DELTA" not in constants(kernel)
        usage = compiled_code.amd_usage(kernel) if target.startswith("gfx") else compiled_code.nvidia_usage(kernel)
        step = constants(kernel).get(LOOP_STEP.get(label, ""))
        loop, warps = usage.get("loop_instructions"), kernel.metadata.num_warps
        if usage.get("warp_partitions"):  # per row and element: the softmax partition's loop, the busiest
            loop, warps = usage["softmax_loop_instructions"], usage["softmax_warps"]
        per_kv_head = None
        if label == "decode" and loop and step and case.form == "aligned":
            programs = 1 if constants(kernel).get("PACK_GQA") else DECODE_GROUPS[case.call]
            per_kv_head = round(loop * kernel.metadata.num_warps / step * programs, 2)
        rows.append(
            _verdict(
                {
                    "case": case.id + ("-gqa" if grouped else "") + ("-sinks" if sinks else ""),
                    "kernel": label,
                    "target": target,
                    "dtype": case.dtype,
                    "head_dim": case.head_dim,
                    "form": case.form,
                    "shared_bytes": kernel.metadata.shared,
                    "shared_limit": configs.SHARED_MEMORY_LIMIT[target],
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    **usage,
                    "loop_step": step,
                    "score_options": any(constants(kernel).get(flag) for flag in SCORE_OPTIONS),
                    "loop_per_row": round(loop / step, 3) if loop and step else None,
                    "loop_per_element": _per_element(kernel, loop, warps),
                    "loop_products": _products(kernel, usage.get("loop_matrix_macs")),
                    "seconds": seconds,
                    "call": case.call,
                    "per_key_per_kv_head": per_kv_head,
                    "atomic_ops": atomic_ops(kernel),
                    "grid_fold": constants(kernel).get("GRID_FOLD", 1),
                }
            )
        )
    return rows


def atomic_ops(kernel) -> int:
    """How many of ``ATOMIC_OPS`` the compiled kernel's TTIR holds."""
    ttir = kernel.asm["ttir"]
    return sum(ttir.count(op) for op in ATOMIC_OPS)


def _per_element(kernel, loop: Optional[int], warps: int) -> Optional[float]:
    """Warp-instructions per score element of a tiled kernel's main loop: its instructions, issued
    by each of ``warps`` warps, over the ``BLOCK_M x BLOCK_N`` scores of the block pair one
    iteration covers."""
    blocks = [constants(kernel).get(name) for name in ("BLOCK_M", "BLOCK_N")]
    if not loop or not all(blocks):
        return None
    return round(loop * warps / (blocks[0] * blocks[1]), 4)


def _products(kernel, macs: Optional[int]) -> Optional[float]:
    """Block-pair matrix products in one main-loop iteration: its multiply-adds over BM * BN * D."""
    blocks = [constants(kernel).get(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D")]
    if not macs or not all(blocks):
        return None
    return round(macs / (blocks[0] * blocks[1] * blocks[2]), 3)


def products_expected(row: dict) -> Optional[int]:
    """The products per block pair (``PRODUCTS``) that ``row``'s main loop must issue, or None."""
    if (
        row["kernel"] in PRODUCTS
        and row["target"] in PRODUCT_TARGETS
        and row["form"] == "aligned"
        and row["head_dim"] == 128
        and row["dtype"] in ("float16", "bfloat16")
    ):
        return PRODUCTS[row["kernel"]]
    return None


def proxy_applies(row: dict) -> bool:
    """Whether ``row`` is the kernel the speed proxy (``PROXY``) bounds, compiled by a Triton at
    least as new as the one the bound was measured with."""
    return (
        row["target"] == PROXY["target"]
        and row["kernel"] == PROXY["kernel"]
        and row["form"] == "aligned"
        and row["head_dim"] == PROXY["head_dim"]
        and row["dtype"] in ("float16", "bfloat16")
        and targets.triton_release() >= PROXY["since_triton"]
    )


def needs_fast_matrix_unit(row: dict) -> bool:
    """Whether every dot of ``row``'s kernel must run on its target's fast matrix unit
    (``FAST_MMA_TARGETS``)."""
    return (
        row["target"] in FAST_MMA_TARGETS
        and row["kernel"] in FAST_MMA_KERNELS
        and row["dtype"] in ("float16", "bfloat16")
        and row["head_dim"] in FAST_MMA_HEAD_DIMS
    )


# 8-bit attention's kernels: Q.K^T on the integer tensor cores (IMMA, sm90's IGMMA, sm100's
# UTCIMMA, AMD's v_mfma_i32_*_i8) and, with FP8 P.V, P.V on the FP8 ones (QMMA, QGMMA, UTCQMMA),
# with no spill in any form at any head dim, and on sm90/sm100 nothing on mma.sync.
INT8_KERNELS = ("int8", "int8_fp8")


def int8_problems(row: dict) -> list:
    """What ``row``, a kernel of 8-bit attention, breaks of the rules above (empty: none)."""
    problems = []
    if not row.get("loop_integer_mma"):
        problems.append("Q.K^T is not on the integer tensor cores (no IMMA/IGMMA/UTCIMMA/v_mfma_i32 in the loop)")
    if row["kernel"] == "int8_fp8" and not row.get("loop_fp8_mma"):
        problems.append("P.V is not on the FP8 tensor cores (no QMMA/QGMMA/UTCQMMA in the loop)")
    if row["spill_bytes"] > SPILL_BUDGET:
        problems.append(f"spills {row['spill_bytes']} B per thread (8-bit attention's budget: {SPILL_BUDGET} B)")
    if row["target"] in FAST_MMA_TARGETS and (row.get("sync_dots") or row.get("loop_hmma")):
        problems.append(f"{row.get('sync_dots')} dots on mma.sync, not on {row['target']}'s fast matrix unit")
    return problems


def decode_bound(row: dict) -> Optional[int]:
    """The instruction bound (``DECODE_BOUND``) that applies to ``row``, or None."""
    if (
        row["kernel"] == "decode"
        and row["form"] == "aligned"
        and row["target"] in DECODE_TARGETS
        and row["head_dim"] == 128
        and row["dtype"] in ("float16", "bfloat16")
    ):
        return DECODE_BOUND[row["call"]]
    return None


def needs_matrix_units(kernel: str, dtype: str) -> bool:
    """fp16/bf16 dots must use the tensor cores; fp32 ones run in full precision on the FMA units."""
    return kernel not in ELEMENTWISE and dtype != "float32"


def _verdict(row: dict) -> dict:
    """Add ``problems`` (empty when the kernel passes) and ``ok`` to a report row."""
    problems = []
    if not row["stores"]:  # every kernel writes its output; one that cannot has been compiled to a trap
        problems.append("the compiled kernel stores nothing (Triton compiled it to a trap)")
    if row.get("call") == "folded" and row.get("grid_fold") != 2:  # the call's batch folds by 2 (compile_calls)
        problems.append(f"compiled with GRID_FOLD {row.get('grid_fold')}, where the folded call's launch folds by 2")
    if row["shared_bytes"] > row["shared_limit"]:
        problems.append(f"shared memory {row['shared_bytes']} B over the {row['shared_limit']} B limit")
    budgeted = (
        row["form"] == "aligned"
        and row["dtype"] != "float32"
        and row["kernel"] not in ELEMENTWISE
        and row["head_dim"] <= SPILL_BUDGET_MAX_HEAD_DIM
        and not row.get("score_options")
    )
    if budgeted and row["spill_bytes"] > SPILL_BUDGET:
        problems.append(
            f"spills {row['spill_bytes']} B per thread (budget {SPILL_BUDGET} B at head dim <= "
            f"{SPILL_BUDGET_MAX_HEAD_DIM})"
        )
    per_key = row["loop_instructions"] / row["loop_step"] if row.get("loop_instructions") and row["loop_step"] else None
    if proxy_applies(row) and not (per_key or float("inf")) <= PROXY["per_key"]:
        problems.append(
            f"main loop {'no' if per_key is None else round(per_key, 4)} instructions per key, over the "
            f"{PROXY['per_key']:.4f} "
            "of Triton's tutorial forward"
        )
    expected = products_expected(row)
    if expected is not None and row.get("loop_products") != expected:
        problems.append(
            f"main loop issues {row.get('loop_products')} matrix products per block pair, expected {expected}"
        )
    if needs_fast_matrix_unit(row) and (row.get("sync_dots") or row.get("loop_hmma")):
        problems.append(
            f"{row.get('sync_dots')} dots on mma.sync ({row.get('loop_hmma')} HMMA in the main loop), not on "
            f"{row['target']}'s fast matrix unit"
        )
    if row["kernel"] in INT8_KERNELS:
        problems += int8_problems(row)
    if row["kernel"] in DETERMINISTIC_KERNELS and row.get("atomic_ops"):
        problems.append(f"{row['atomic_ops']} atomic operations in a kernel of the deterministic backward")
    if row["kernel"] == "fwd_ws" and not row.get("warp_partitions"):
        problems.append("warp specialisation asked for, but Triton left the loop whole (no partitions)")
    bound = decode_bound(row)
    if bound is not None and not (row["per_key_per_kv_head"] or float("inf")) <= bound:
        problems.append(
            f"decoding issues {row['per_key_per_kv_head']} warp-instructions per cached key per kv head, over {bound}"
        )
    if needs_matrix_units(row["kernel"], row["dtype"]) and (row["fma_dots"] or not row["matrix_unit"]):
        problems.append(f"fp16/bf16 dots do not all use the matrix units ({row['fma_dots']} lowered to FMA)")
    return {**row, "problems": problems, "ok": not problems}


def check_job(job: tuple[Case, str]) -> list[dict]:
    """``check_case`` for one ``(case, target)``; a failure to compile is a failing row of its own."""
    case, target = job
    try:
        return check_case(case, target)
    except Exception as exc:  # report and go on: one failure must not hide the others
        return [
            {
                "case": case.id,
                "kernel": case.call,
                "target": target,
                "ok": False,
                "problems": [f"{type(exc).__name__}: {exc}"[:2000]],
            }
        ]


def _line(row: dict) -> str:
    if row.get("not_enabled"):
        reason = f"not enabled on this Triton: {row['not_enabled']}"
        return f"--  {row['target']:<7} {row['case']:<30} {row['kernel']:<14} {reason}"
    if "shared_bytes" not in row:
        return f"BAD {row['target']:<7} {row['case']:<30} {row['kernel']:<14} {row['problems'][0]}"
    loop = f"{row['loop_per_row']:>5.2f}/row" if row.get("loop_per_row") else " " * 9
    detail = (
        f"{row['shared_bytes']:>6} / {row['shared_limit']:<6} B shared  {row['registers']:>3} regs  "
        f"{row['spill_bytes']:>5} B spill  {row['matrix_unit'] or '-':<11} "
        f"w{row['num_warps']} s{row['num_stages']}  {loop}"
    )
    verdict = "ok " if row["ok"] else "BAD"
    problems = f"  <- {'; '.join(row['problems'])}" if row["problems"] else ""
    return f"{verdict} {row['target']:<7} {row['case']:<30} {row['kernel']:<14} {detail}{problems}"


def narrowed(chosen: Optional[list], selection) -> list:
    """The values of ``selection`` that a repeatable option chose, in the option's order (all of
    them when it chose none)."""
    return [x for x in chosen if x in selection] if chosen else list(selection)


def select_jobs(preset=None, targets=None, calls=None, dtypes=None, head_dims=None, forms=None) -> list:
    """The ``(Case, target)`` pairs to compile: the ``preset``'s selections (default: everything),
    narrowed by the values the repeatable options chose."""
    jobs = []
    for all_calls, all_dtypes, all_dims, all_forms, all_targets in PRESETS.get(preset or "", [ALL]):
        for target in narrowed(targets, all_targets):
            chosen = (narrowed(calls, all_calls), narrowed(dtypes, all_dtypes), narrowed(head_dims, all_dims))
            jobs += [(case, target) for case in cases(*chosen, narrowed(forms, all_forms))]
    return jobs


def run_jobs(jobs: list, processes: int = 1) -> Iterator[dict]:
    """The report rows of ``jobs`` (``select_jobs``), in their order, compiled in ``processes``
    processes (1: in this one)."""
    pool = concurrent.futures.ProcessPoolExecutor(processes) if processes > 1 else None
    try:
        for result in pool.map(check_job, jobs) if pool else map(check_job, jobs):
            yield from result
    finally:
        if pool:
            pool.shutdown()


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="architecture (repeatable); default: all")
    parser.add_argument("--call", action="append", choices=CALLS, help="launcher call (repeatable); default: all")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="dtype (repeatable); default: all")
    parser.add_argument(
        "--head-dim",
        action="append",
        type=int,
        choices=HEAD_DIM_BUCKETS,
        help="head-dim bucket (repeatable); default: all",
    )
    parser.add_argument("--form", action="append", choices=FORMS, help="aligned and/or ragged; default: both")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="a named selection (see PRESETS); the options above narrow it"
    )
    parser.add_argument("--jobs", type=int, default=1, help="parallel compiler processes")
    parser.add_argument("--json", action="store_true", help="print one JSON object per kernel")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if targets.interpreter_enabled():
        print("unset TRITON_INTERPRET: the compile check needs Triton's compiler", file=sys.stderr)
        return 2
    jobs = select_jobs(args.preset, args.target, args.call, args.dtype, args.head_dim, args.form)
    rows, started = [], time.perf_counter()
    for row in run_jobs(jobs, args.jobs):
        rows.append(row)
        print(json.dumps(row) if args.json else _line(row), flush=True)
    failures = sum(not row["ok"] for row in rows)
    skipped = sum(bool(row.get("not_enabled")) for row in rows)
    minutes = (time.perf_counter() - started) / 60
    print(
        f"{len(rows) - skipped - failures} of {len(rows) - skipped} kernels from {len(jobs)} calls passed"
        + (f", {skipped} not enabled on this Triton" if skipped else "")
        + f" ({minutes:.1f} min)",
        file=sys.stderr,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
