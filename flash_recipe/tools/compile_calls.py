"""The launcher calls that compile the kernels for a GPU target without a GPU: for each ``Case``
(a call, a dtype, a head-dim bucket, a form), ``run_call`` makes the call on CPU tensors through
the package's launchers, and ``compile_case`` compiles what they launch for the target instead of
running it (``ops.offline``). ``flash-recipe tune`` prunes its candidates with it; the compile
check of a checkout (``devtools.compile_check``) reports on every kernel it compiles.
``aligned``: head dims equal to their bucket, block-multiple lengths, MHA, causal
(the ``bwd`` call also with GQA groups of 4: ``group_size`` 1 and larger are two specialisations);
``ragged``: an odd head dim below the bucket, ragged lengths, GQA, every score option, q/k/v as
views of one packed tensor with odd strides."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ..ops import choose, configs, features, options, targets
from ..ops.options import ScoreOptions

# The backward's kernels (one pass or three) and the labels their report rows carry.
BACKWARD_LABELS = {
    "attn_bwd_preprocess_kernel": "bwd_preprocess",
    "attn_bwd_dkdv_kernel": "bwd_dkdv",
    "attn_bwd_dq_kernel": "bwd_dq",
}
ONE_LAUNCH_LABEL = {"attn_bwd_one_launch_kernel": "bwd_onelaunch"}
# The forward's score options, and every flag that makes the launcher choose the forward's general
# configuration over the plain one (``forward.attention_forward``).
SCORE_OPTIONS = ("SOFTCAP", "ALIBI", "DROPOUT")
GENERAL_FLAGS = ("VARLEN", "KV_RANGES", "MASK_D", *SCORE_OPTIONS)
# A global store in the compiled code: Triton lowers what it cannot lower properly to a trap, which
# stores nothing.
NVIDIA_STORE = re.compile(r"\bst\.global|\bcp\.async\.bulk\.global")
AMD_STORE = re.compile(r"\b(global|buffer)_store")
# The GQA groups of the aligned decode steps (``decode``: a dense cache; ``decode_paged``: pages).
DECODE_GROUPS = {"decode": 4, "decode_paged": 8}


@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call: which call, in which dtype, head-dim bucket and form (see module doc)."""

    call: str
    dtype: str
    head_dim: int  # the bucket
    form: str

    @property
    def id(self) -> str:
        return f"{self.call}-{self.dtype}-d{self.head_dim}-{self.form}"


def _head_dim(case: Case) -> int:
    """The real head dim: the bucket itself (aligned) or an odd one below it (ragged, masked)."""
    if case.form == "aligned":
        return case.head_dim
    return case.head_dim - 5 if case.head_dim > 16 else 13


def _qkv(case: Case, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int, head_dim=None):
    """q ``(B, Sq, H, D)`` and k, v ``(B, Sk, Hk, D)`` on the CPU: separate contiguous tensors
    (aligned), or views of one packed ``(B, S, H + 2 Hk, D)`` tensor (ragged: odd strides, and k/v
    pointers off the 16-byte alignment); ``D`` is ``_head_dim(case)`` unless given."""
    dtype, head_dim = getattr(torch, case.dtype), head_dim or _head_dim(case)
    if case.form == "aligned":
        return (
            torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
        )
    packed = torch.randn(batch, max(seqlen_q, seqlen_k), nheads + 2 * nheads_k, head_dim, dtype=dtype)
    return (
        packed[:, :seqlen_q, :nheads],
        packed[:, :seqlen_k, nheads : nheads + nheads_k],
        packed[:, :seqlen_k, nheads + nheads_k :],
    )


def _variant(case: Case, nheads: int, diag_offset: int, scale: float):
    """Causal (aligned), or window + softcap + ALiBi + dropout (ragged), with attention sinks except
    in the ``bwd`` call, which keeps the backward of an attention's own lse without them (its
    one-key rules; ``varlen`` compiles the backward with sinks)."""
    if case.form == "aligned":
        return ScoreOptions(
            softmax_scale=scale, diag_offset=diag_offset, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
        )
    slopes = torch.rand(nheads, dtype=torch.float32)
    dropout = 0.0 if case.call in ("decode", "decode_paged", "paged") else 0.1  # the cache is forward-only
    seed = torch.zeros(1, dtype=torch.int64)
    sinks = None if case.call == "bwd" else torch.randn(nheads, dtype=torch.float32)
    return ScoreOptions(
        softmax_scale=scale,
        diag_offset=diag_offset,
        window_left=37,
        window_right=5,
        softcap=30.0,
        alibi_slopes=slopes,
        dropout_p=dropout,
        seed=seed if dropout else None,
        sinks=sinks,
    )


def _one_launch_offered(case: Case) -> bool:
    """Whether the target being compiled for (the offline driver's) has the one-launch tiles for ``case``."""
    size = 4 if case.dtype == "float32" else 2
    return configs.has_config(targets.target_of(torch.device("cpu")), configs.ONE_LAUNCH, case.head_dim, size)


def run_call(case: Case) -> dict[str, str]:
    """Run the launcher(s) of ``case``; returns which kernel label each launched jit function gets."""
    # The kernels import Triton: warmup imports this module (``GENERAL_FLAGS``) where it may be absent.
    from ..ops import backward_launch, forward, kvcache

    ragged = case.form == "ragged"
    nheads, nheads_k = (6, 2) if ragged else (4, 4)
    scale = _head_dim(case) ** -0.5
    if case.call == "sinks":  # the "bwd" call's tensors and causal mask, with a sink per query head
        seqlen_q, seqlen_k = (113, 203) if ragged else (1024, 1024)
        q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k)
        var = _variant(case, nheads, seqlen_k - seqlen_q, scale)._replace(
            sinks=torch.randn(nheads, dtype=torch.float32)
        )
        forward.attention_forward(q, k, v, var)
        out, lse = torch.randn_like(q), torch.randn(2, nheads, seqlen_q, dtype=torch.float32)
        dout = torch.randn_like(q)
        # Every path, as the "bwd" call compiles them, whichever the target runs by default: the
        # three kernels' dQ kernel stores the sinks' row sums, the one pass adds them with atomics,
        # the one launch's dQ programs store them (where the table offers it).
        one_pass = case.dtype != "float32" and choose.one_pass_fits(torch.device("cpu"), case.head_dim)
        paths = ("one_pass",) * one_pass + ("three_kernels",) + ("one_launch",) * _one_launch_offered(case)
        for path in paths:
            with choose.taking_path(path):
                backward_launch.attention_backward(dout, q, k, v, out, lse, var)
        return {"attn_fwd_kernel": "fwd", **BACKWARD_LABELS, **ONE_LAUNCH_LABEL}
    if case.call == "fwd_ws":  # the plain forward with warp specialisation asked for, causal and not
        seqlen_q, seqlen_k = (113, 203) if ragged else (1024, 1024)
        q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim=case.head_dim)
        causal = _variant(case, nheads, seqlen_k - seqlen_q, scale)._replace(
            softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, sinks=None, window_left=-1
        )
        # Asked for where tl.range takes warp_specialize; under an older Triton no launch can ask
        # (where it would be taken, ``devtools.compile_check.warp_spec_not_enabled`` compiles nothing).
        asking = features.warp_specialization_available()
        with features.using_warp_specialization(True) if asking else contextlib.nullcontext():
            for var in (causal, causal._replace(window_right=-1)):
                forward.attention_forward(q, k, v, var)
        return {"attn_fwd_kernel": "fwd"}
    if case.call in ("fwd", "options", "bwd"):
        seqlen_q, seqlen_k = (113, 203) if ragged else (1024, 1024)
        q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k)
        var = _variant(case, nheads, seqlen_k - seqlen_q, scale)
        if case.call == "fwd":
            if ragged:  # the plain-score configuration's worst case: the window alone, every column used
                q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim=case.head_dim)
                var = var._replace(softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, sinks=None)
            forward.attention_forward(q, k, v, var)
            return {"attn_fwd_kernel": "fwd"}
        if case.call == "options":  # every score option, on aligned tensors (TMA where the target has it) or ragged
            var = _variant(dataclasses.replace(case, form="ragged"), nheads, seqlen_k - seqlen_q, scale)
            forward.attention_forward(q, k, v, var)
            return {"attn_fwd_kernel": "fwd"}
        # Both paths, whichever the family runs by default (``configs.BACKWARD_PATHS``; a tuned file
        # may choose the other): the one pass, where the installed Triton compiles its tile cleanly
        # (``choose.one_pass_fits``), and the three kernels; fp32 (its own lse) runs only these.
        # Aligned: MHA, then GQA (8 query heads on 2 kv heads), which Triton compiles apart.
        one_pass = case.dtype != "float32" and choose.one_pass_fits(torch.device("cpu"), case.head_dim)
        for heads in ((nheads, nheads_k),) if ragged else ((nheads, nheads_k), (8, 2)):
            q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, *heads)
            out, lse = torch.randn_like(q), torch.randn(2, heads[0], seqlen_q, dtype=torch.float32)
            for path in ("one_pass", "three_kernels") if one_pass else ("three_kernels",):
                with choose.taking_path(path):
                    backward_launch.attention_backward(torch.randn_like(q), q, k, v, out, lse, var)
        return dict(BACKWARD_LABELS)
    # "one_pass": the "bwd" call's one pass whatever the release rule says; "one_launch": the one-launch
    # backward where the table offers it (elsewhere nothing); each without and then with sinks.
    if case.call in ("one_pass", "one_launch"):
        if case.call == "one_launch" and not _one_launch_offered(case):
            return {}
        seqlen_q, seqlen_k = (113, 203) if ragged else (1024, 1024)
        var = _variant(dataclasses.replace(case, call="bwd"), nheads, seqlen_k - seqlen_q, scale)
        for heads, sinks in itertools.product(
            ((nheads, nheads_k),) if ragged else ((nheads, nheads_k), (8, 2)), (False, True)
        ):
            q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, *heads)
            out, lse = torch.randn_like(q), torch.randn(2, heads[0], seqlen_q, dtype=torch.float32)
            with_sinks = var._replace(sinks=torch.randn(heads[0], dtype=torch.float32) if sinks else None)
            with choose.taking_path(case.call):
                backward_launch.attention_backward(torch.randn_like(q), q, k, v, out, lse, with_sinks)
        return {**BACKWARD_LABELS, **ONE_LAUNCH_LABEL}
    if case.call == "one_key":  # the backward of a window of width one: every row sees one key (exact dS = 0)
        seqlen_q = seqlen_k = 113 if ragged else 1024
        q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k)
        var = _variant(case, nheads, 0, scale)._replace(window_left=0, window_right=0)
        out, lse = torch.randn_like(q), torch.randn(2, nheads, seqlen_q, dtype=torch.float32)
        backward_launch.attention_backward(torch.randn_like(q), q, k, v, out, lse, var)
        return dict(BACKWARD_LABELS)
    if case.call == "folded":  # a batch past CUDA's grid limit: the "fwd" and "bwd" calls and 8-bit attention, folded
        return _folded(case, scale)
    if case.call == "int8":  # 8-bit attention: the quantizer and the kernel, fp16 P.V and, where the target has it, FP8
        from ..ops import int8_attention  # Triton on use, as in ``run_call``

        seqlen_q, seqlen_k = (113, 203) if ragged else (1024, 1024)
        q, k, v = _qkv(case, 2, seqlen_q, seqlen_k, nheads, nheads_k)
        fp8 = (False,) if int8_attention.fp8_problem(targets.target_of(q.device)) else (False, True)
        for use_fp8 in fp8:
            int8_attention.int8_attention(q, k, v, scale, causal=True, fp8=use_fp8)
        return {"quantize_kernel": "quantize", "attn_int8_kernel": "int8"}
    if case.call == "varlen":
        lengths = [113, 0, 257] if ragged else [512, 1024, 256]
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        total = int(cu[-1])
        q, k, v = (t[0] for t in _qkv(case, 1, total, total, nheads, nheads_k))
        varlen = options.Varlen(cu, cu, max(lengths), max(lengths))
        var = _variant(case, nheads, 0, scale)
        forward.attention_forward(q, k, v, var, varlen=varlen)
        out, lse = torch.randn_like(q), torch.randn(nheads, total, dtype=torch.float32)
        backward_launch.attention_backward(torch.randn_like(q), q, k, v, out, lse, var, varlen=varlen)
        return {"attn_fwd_kernel": "fwd", **BACKWARD_LABELS}
    # A KV cache of 3 sequences, appended one new key and value row per query row: "decode" over a
    # dense cache (each sequence its own page of 1024 rows: a page table one entry wide, whose width
    # Triton specialises to the constant 1), the other calls over pages of 64 rows (aligned) or 16
    # (ragged). The aligned decode steps use GQA groups 4 and 8 (DECODE_GROUPS), the ragged ones 3.
    decoding = case.call in DECODE_GROUPS
    seqlen_q = 1 if decoding else 64
    page_size, width = (1024, 1) if case.call == "decode" else (64, 16) if not ragged else (16, 40)
    if decoding and not ragged:
        nheads = nheads_k * DECODE_GROUPS[case.call]
    dtype, head_dim = getattr(torch, case.dtype), _head_dim(case)
    q = _qkv(case, 3, seqlen_q, seqlen_q, nheads, nheads_k)[0]
    k_new, v_new = (torch.randn(3, seqlen_q, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    pages = torch.randn(2, 3 * width, page_size, nheads_k, head_dim, dtype=dtype)  # dense: (B, S_cache, Hk, D)
    table = torch.arange(3 * width, dtype=torch.int32).reshape(3, width)
    seqlens = torch.tensor([100, 333, 17], dtype=torch.int32)
    leftpad = torch.tensor([0, 5, 3], dtype=torch.int32) if ragged else None
    cache = kvcache.Cache(pages[0], pages[1], table, seqlens, leftpad)
    rotary_dim = head_dim - head_dim % 2
    angles = torch.rand(width * page_size, rotary_dim // 2)
    rotary = kvcache.Rotary(angles.cos().to(dtype), angles.sin().to(dtype), interleaved=not ragged)
    var = _variant(case, nheads, 0, scale)
    kvcache.attention_kvcache(q, k_new, v_new, cache, rotary, var, num_splits=4)
    return {
        "rotary_append_kernel": "rotary_append",
        "attn_fwd_kernel": "decode" if decoding else "fwd",
        "split_combine_kernel": "split_combine",
    }


# The "folded" call's grid limit and batch: a batch of 5 over a limit of 4 (the 4 heads fit on axis
# 1) folds by 2 (``launch.fold_grid``), as a batch of 70,000 over CUDA's 65535 does.
FOLD_LIMIT, FOLD_BATCH = 4, 5


def _folded(case: Case, scale: float) -> dict[str, str]:
    """The "fwd" call's forward, the target's backward and the causal 8-bit attention with the
    batch folded into grid axis 0 (``GRID_FOLD`` 2): the kernels as a launch past CUDA's axis-2
    limit compiles them."""
    from ..ops import backward_launch, forward, int8_attention, launch  # Triton on use, as in ``run_call``

    seqlen = 113 if case.form == "ragged" else 1024
    q, k, v = _qkv(case, FOLD_BATCH, seqlen, seqlen, 4, 4)
    var = _variant(case, 4, 0, scale)
    if case.form == "ragged":  # the "fwd" call's configuration: plain scores
        var = var._replace(softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, sinks=None)
    with mock.patch.object(launch, "AXIS_LIMIT", FOLD_LIMIT):
        forward.attention_forward(q, k, v, var)
        out, lse = torch.randn_like(q), torch.randn(FOLD_BATCH, 4, seqlen, dtype=torch.float32)
        backward_launch.attention_backward(torch.randn_like(q), q, k, v, out, lse, var)
        fp8 = not int8_attention.fp8_problem(targets.target_of(q.device))
        int8_attention.int8_attention(q, k, v, scale, causal=True, fp8=fp8)
    return {"attn_fwd_kernel": "fwd", **BACKWARD_LABELS, "quantize_kernel": "quantize", "attn_int8_kernel": "int8"}


def constants(kernel) -> dict:
    """The constexpr arguments a compiled kernel was compiled with, by name (empty where Triton
    keeps none). Triton 3.2 keys them by name, later releases by ``(argument index,)``."""
    src = getattr(kernel, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if src is None or names is None:
        return {}
    found = {}
    for key, value in src.constants.items():
        if isinstance(key, str):
            found[key] = value
        elif isinstance(key, tuple) and len(key) == 1:
            found[names[key[0]]] = value
    return found


def kernel_label(label: str, kernel) -> str:
    """``run_call``'s label of a compiled kernel, refined by the flags its launcher chose."""
    flags = constants(kernel)
    if label == "fwd" and any(flags.get(flag) for flag in GENERAL_FLAGS):
        return "fwd_general"  # the configuration the launcher chose (forward.attention_forward)
    if label == "fwd" and flags.get("WARP_SPEC"):
        return "fwd_ws"  # the unmasked key loop warp-specialised (ops.features)
    if label == "int8" and flags.get("PV_FP8"):
        return "int8_fp8"  # P.V in FP8 (ops.int8_attention)
    if label == "bwd_dkdv" and flags.get("ATOMIC_DQ"):
        return "bwd_onepass"  # the dK/dV kernel adding dQ too (backward_launch.attention_backward)
    return label


def compile_case(case: Case, target: str) -> list[tuple[str, str, Any]]:
    """Compile ``case`` for ``target`` through Triton's launch path: ``(label, function name,
    compiled kernel)`` per kernel launched, labelled by ``kernel_label``. Needs Triton's compiler
    (``TRITON_INTERPRET`` unset)."""
    from ..ops.offline import offline_launches  # Triton on use, as in ``run_call``

    with offline_launches(target) as compiled:
        labels = run_call(case)
    return [(kernel_label(labels[name], kernel), name, kernel) for name, kernel in compiled]


def stores(kernel, amd: bool) -> bool:
    """Whether the compiled kernel stores to global memory (a kernel lowered to a trap does not)."""
    return bool((AMD_STORE if amd else NVIDIA_STORE).search(kernel.asm.get("amdgcn", "") if amd else kernel.asm["ptx"]))


def resource_usage(kernel, amd: bool) -> tuple[int, int]:
    """Registers and spilled bytes per thread of a compiled kernel. NVIDIA: the cubin's ``REG`` and
    ``STACK`` (``cuobjdump -res-usage``, the tool Triton ships; the kernels keep no arrays in local
    memory, so their stack frame is where spilled registers go). AMD: the code object's VGPRs and
    scratch bytes (``private_segment_fixed_size``: spilled VGPRs; spilled SGPRs land in VGPR lanes
    and cost no memory)."""
    if amd:
        asm = kernel.asm.get("amdgcn", "")

        def field(name: str) -> int:
            found = re.search(rf"\.{name}:\s+(\d+)", asm)
            if found is None:
                raise RuntimeError(f"the AMD code object's metadata has no .{name}")
            return int(found.group(1))

        return field("vgpr_count"), field("private_segment_fixed_size")
    import triton.backends.nvidia  # Triton on use, as in ``run_call``

    cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {usage.stdout[:200]!r}")
    return int(found.group(1)), int(found.group(2))
