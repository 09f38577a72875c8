"""Compile every kernel variant for a GPU architecture without a GPU, and check its resources.

``triton.compile`` builds real PTX/cubin (NVIDIA) or code objects (AMD) on any machine, so this
proves that each variant the dispatcher can launch compiles for an architecture, fits its
shared-memory limit and uses the matrix units. Run it as::

    python -m flash_recipe.ops.compile_check --target sm80 --target sm90 [--json]

It must run with ``TRITON_INTERPRET`` unset (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import sys
import time
from typing import Iterator

from flash_recipe.ops import configs

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "decode", "rotary_append", "split_combine")
TARGETS = ("sm80", "sm86", "sm89", "sm90", "gfx90a", "gfx942")


MODES = ("full", "causal", "all-options", "varlen-causal", "kvcache")
FP32_POINTERS = ("LSE", "DELTA", "SLOPES", "O_SPLIT", "LSE_SPLIT")
INT32_POINTERS = ("CU_Q", "CU_K", "K_START", "K_END", "PAGE_TABLE", "POS")
CACHE_KERNELS = ("decode", "rotary_append", "split_combine")  # run only on a KV cache
INT64_POINTERS = ("SEED",)
FLOAT_SCALARS = ("sm_scale", "softcap", "dropout_p")


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str
    head_dim: int  # the padded bucket
    mode: str  # "full": no mask; "causal": right edge; "all-options": window, softcap, ALiBi, dropout;
    # "varlen-causal": packed sequences with the causal edge; "kvcache": a paged cache with per-batch
    # key ranges, window, softcap and ALiBi, writing split-KV partials (float32)
    even: bool  # sequence lengths multiples of the blocks and head dim == bucket

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.dtype}-d{self.head_dim}-{self.mode}-{'even' if self.even else 'ragged'}"


def variants(kernels=KERNELS, dtypes=tuple(DTYPES), buckets=HEAD_DIM_BUCKETS, modes=MODES) -> Iterator[Variant]:
    """The (kernel, dtype, head-dim bucket, mode, even) combinations the launchers can produce.

    The modes span the option flags: none, the causal edge alone, all score options at once (the
    most code and the most registers), packed variable-length sequences, and a paged KV cache
    (the forward and decode kernels, the rotary/append kernel and the split-KV merge).
    """
    for kernel, dtype, head_dim, mode, even in itertools.product(kernels, dtypes, buckets, modes, (False, True)):
        if kernel == "bwd_preprocess" and mode in ("causal", "all-options"):
            continue  # the preprocess has no masking options
        if (kernel in CACHE_KERNELS) != (mode == "kvcache") and not (kernel == "fwd" and mode == "kvcache"):
            continue  # the cache kernels run on a cache only; the backward never does
        if mode.startswith("varlen") and even:
            continue  # packed sequence lengths are always ragged
        yield Variant(kernel, dtype, head_dim, mode, even)


KERNEL_NAMES = {"fwd": ("forward", "attn_fwd_kernel"), "bwd_preprocess": ("backward", "attn_bwd_preprocess_kernel"),
                "bwd_dkdv": ("backward", "attn_bwd_dkdv_kernel"), "bwd_dq": ("backward", "attn_bwd_dq_kernel"),
                "decode": ("forward", "attn_fwd_kernel"), "rotary_append": ("kvcache", "rotary_append_kernel"),
                "split_combine": ("forward", "split_combine_kernel")}


def _source(variant: Variant, target: str):
    """The jit function, its signature and constexprs for ``variant``, read off the kernel's parameters."""
    import importlib

    module, name = KERNEL_NAMES[variant.kernel]
    fn = getattr(importlib.import_module(f"flash_recipe.ops.{module}"), name).fn  # inside triton.heuristics
    element_size = 4 if variant.dtype == "float32" else 2
    even, mode = variant.even, variant.mode
    options = mode in ("all-options", "kvcache")
    constexprs = {"BLOCK_D": variant.head_dim, "EVEN_M": even, "EVEN_N": even, "MASK_D": not even,
                  "MASK_LEFT": options, "MASK_RIGHT": mode != "full", "SOFTCAP": options, "ALIBI": options,
                  "DROPOUT": mode == "all-options", "IS_VARLEN": mode.startswith("varlen"),
                  "KV_RANGES": mode.startswith("varlen") or mode == "kvcache", "PAGED": mode == "kvcache",
                  "ROTARY": True, "INTERLEAVED": even, "TO_CACHE": True}  # both rotary pairings get compiled
    fp32_pointers = FP32_POINTERS + (("O",) if mode == "kvcache" and variant.kernel in ("fwd", "decode") else ())
    cfg = None
    if variant.kernel in ("bwd_preprocess", "rotary_append", "split_combine"):
        constexprs["BLOCK_M"] = 64 if variant.kernel == "bwd_preprocess" else 16
    else:
        cfg = configs.get_config(target, variant.kernel, variant.head_dim, element_size)
        constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    signature, used = {}, {}
    for param in fn.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            used[param.name] = constexprs[param.name]
        elif param.name.isupper():
            if param.name in fp32_pointers:
                signature[param.name] = "*fp32"
            elif param.name in INT32_POINTERS:
                signature[param.name] = "*i32"
            elif param.name in INT64_POINTERS:
                signature[param.name] = "*i64"
            else:
                signature[param.name] = f"*{DTYPES[variant.dtype]}"
        else:
            signature[param.name] = "fp32" if param.name in FLOAT_SCALARS else "i32"
    return fn, signature, used, cfg


def needs_matrix_units(variant: Variant) -> bool:
    """fp16/bf16 dots must use the tensor cores; fp32 ones run in full precision on the FMA units."""
    return variant.kernel not in ("bwd_preprocess", "rotary_append", "split_combine") and variant.dtype != "float32"


def compile_variant(variant: Variant, target: str) -> dict:
    """Compile one variant for ``target`` (``"sm80"``, ``"gfx942"``, ...) and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, sig, constexprs, cfg = _source(variant, target)
    if target.startswith("gfx"):
        gpu, limit_key = GPUTarget("hip", target, 64), target
    else:
        gpu, limit_key = GPUTarget("cuda", int(target[2:]), 32), target
    options = {}
    if cfg is not None:
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=gpu, options=options)
    seconds = time.perf_counter() - start
    shared = compiled.metadata.shared
    if target.startswith("gfx"):
        asm = compiled.asm.get("amdgcn", "")
        uses_matrix = "mfma" in asm
    else:
        asm = compiled.asm.get("ptx", "")
        uses_matrix = "mma" in asm  # mma.sync (sm80-89) or wgmma (sm90)
    limit = configs.SHARED_MEMORY_LIMIT[limit_key]
    return {
        "variant": variant.id,
        "target": target,
        "shared_bytes": shared,
        "shared_limit": limit,
        "fits": shared <= limit,
        "matrix_instructions": uses_matrix,
        "seconds": round(seconds, 2),
    }


def _check(job: tuple[Variant, str]) -> dict:
    variant, target = job
    try:
        row = compile_variant(variant, target)
    except Exception as exc:  # report and go on: one failure must not hide the others
        row = {"variant": variant.id, "target": target, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    row["ok"] = "error" not in row and row["fits"] and (row["matrix_instructions"] or not needs_matrix_units(variant))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_recipe.ops.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="architecture (repeatable); default: all")
    parser.add_argument("--kernel", action="append", choices=KERNELS, help="kernel (repeatable); default: all")
    parser.add_argument("--dtype", action="append", choices=tuple(DTYPES), help="dtype (repeatable); default: all")
    parser.add_argument("--head-dim", action="append", type=int, choices=HEAD_DIM_BUCKETS, help="head-dim bucket (repeatable); default: all")
    parser.add_argument("--mode", action="append", choices=MODES, help="masking mode (repeatable); default: all")
    parser.add_argument("--even", choices=("both", "yes", "no"), default="both",
                        help="'no' compiles only the ragged variants, which hold every mask (same tiles, same shared memory)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel compiler processes")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    if configs.interpreter_enabled():
        print("unset TRITON_INTERPRET: the compile check needs Triton's compiler", file=sys.stderr)
        return 2
    flag = {"both": (False, True), "yes": (True,), "no": (False,)}
    jobs = [
        (variant, target)
        for target in args.target or TARGETS
        for variant in variants(kernels=args.kernel or KERNELS, dtypes=args.dtype or tuple(DTYPES),
                                buckets=args.head_dim or HEAD_DIM_BUCKETS, modes=args.mode or MODES)
        if variant.even in flag[args.even]
    ]
    failures = 0
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    rows = pool.map(_check, jobs) if pool else map(_check, jobs)
    try:
        for row in rows:
            failures += not row["ok"]
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                detail = row.get("error") or f"{row['shared_bytes']:>6} / {row['shared_limit']} B shared, {row['seconds']} s"
                print(f"{'ok ' if row['ok'] else 'BAD'} {row['target']:<7} {row['variant']:<40} {detail}", flush=True)
    finally:
        if pool:
            pool.shutdown()
    print(f"{len(jobs) - failures} of {len(jobs)} variants compiled and fit", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
