"""``flash-recipe warmup``: compile the Triton kernels for the local GPU ahead of time.

The first call of each kernel variant (dtype x head-dim bucket x causal x sequence-length
alignment) compiles it, which takes seconds; the result lands in Triton's on-disk cache
(``$TRITON_CACHE_DIR``, default ``~/.triton/cache``) and later processes load it from there.
Running ``flash-recipe warmup`` once, for example as a step of a Docker build on a GPU builder
whose cache directory is copied into the image, moves that cost out of the first training step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (16, 32, 64, 128, 256)


def cache_dir() -> str:
    """Where Triton keeps compiled kernels."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def warm(dtypes, head_dims, device, progress=print) -> list[dict]:
    """Run forward and backward once per variant on small tensors; returns the time of each."""
    import torch

    import flash_recipe

    rows = []
    # Lengths 128 (a multiple of every block) and 127 (ragged) select both alignment variants.
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for head_dim in head_dims:
            for causal in (False, True):
                for seqlen in (128, 127):
                    q, k, v = (
                        torch.randn(1, seqlen, 2, head_dim, device=device, dtype=dtype, requires_grad=True)
                        for _ in range(3)
                    )
                    torch.cuda.synchronize()
                    begin = time.perf_counter()
                    with flash_recipe.use_backend("triton"):
                        flash_recipe.flash_attn_func(q, k, v, causal=causal).sum().backward()
                    torch.cuda.synchronize()
                    row = {
                        "dtype": dtype_name,
                        "head_dim": head_dim,
                        "causal": causal,
                        "seqlen": seqlen,
                        "seconds": time.perf_counter() - begin,
                    }
                    rows.append(row)
                    progress(
                        f"{dtype_name:<9} d{head_dim:<4} {'causal' if causal else 'full':<7} S{seqlen:<4} "
                        f"{row['seconds']:7.2f} s"
                    )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", action="append", choices=DTYPES, help="dtype (repeatable); default: all the GPU supports"
    )
    parser.add_argument(
        "--head-dim",
        action="append",
        type=int,
        choices=HEAD_DIMS,
        help="head-dim bucket (repeatable); head dims compile to the next power of two; default: all",
    )
    parser.add_argument("--device", default="cuda", help="CUDA device to compile for (default: the current one)")


def run(args) -> int:
    import torch

    import flash_recipe

    if not torch.cuda.is_available():
        print(
            "flash-recipe warmup: no CUDA or ROCm GPU is visible, so there is nothing to compile for; "
            "run it on a machine with the target GPU (the offline compile check is "
            "`python -m flash_recipe.tools.compile_check`).",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    dtypes = args.dtype or [d for d in DTYPES if d != "bfloat16" or torch.cuda.is_bf16_supported()]
    print(f"compiling into {cache_dir()} for {torch.cuda.get_device_name(device)}")
    begin = time.perf_counter()
    try:
        rows = warm(dtypes, args.head_dim or HEAD_DIMS, device)
    except flash_recipe.BackendUnavailableError as exc:
        print(f"flash-recipe warmup: {exc}", file=sys.stderr)
        return 1
    print(f"{len(rows)} variants in {time.perf_counter() - begin:.1f} s")
    return 0
