"""``flash-recipe tune``'s options and its ``run``, ``show`` and ``clear``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

import torch

from ... import atomic_json
from ...ops import targets, tuned
from .problem import DTYPES, HEAD_DIMS, KERNELS, SPLITS, TuneError, describe
from .search import tune

# -- the command line -------------------------------------------------------------------------


def _listed(kind: Callable, allowed: Optional[tuple] = None, low: int = 1) -> Callable[[str], list]:
    """An argparse type: comma-separated values of ``kind``, each in ``allowed`` (or ``>= low``)."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = None
        shown = ",".join(map(str, allowed)) if allowed else f"integers >= {low}"
        if not values or any((v not in allowed) if allowed else (v < low) for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated values from {shown}, got {text!r}")
        return values

    return parse


_CAUSAL = {"both": [False, True], "yes": [True], "no": [False]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time launch configurations on the local GPU and write the fastest to the per-device cache "
        f"(${tuned.ENV_VAR}, else $XDG_CACHE_HOME/flash-recipe/tune or ~/.cache/flash-recipe/tune), "
        "which the kernels then use instead of the built-in table."
    )
    parser.add_argument(
        "--kernel",
        type=_listed(str, KERNELS),
        default=list(KERNELS),
        help=f"comma-separated kernels from {','.join(KERNELS)} (default: all)",
    )
    parser.add_argument(
        "--head-dim",
        type=_listed(int, HEAD_DIMS),
        default=[64, 128],
        help="comma-separated head-dim buckets from 16,32,64,128,256 (default 64,128)",
    )
    parser.add_argument(
        "--dtype",
        type=_listed(str, DTYPES),
        default=["bfloat16"],
        help="comma-separated dtypes from float16,bfloat16,float32 (default bfloat16; float16 and "
        "bfloat16 share their entries)",
    )
    parser.add_argument(
        "--seqlen",
        type=_listed(int),
        default=[1024, 4096],
        help="comma-separated sequence lengths, and cache lengths for decode (default 1024,4096)",
    )
    parser.add_argument(
        "--causal",
        choices=tuple(_CAUSAL),
        default="both",
        help="masks timed and checked: both (default), yes (causal only) or no",
    )
    parser.add_argument(
        "--tokens",
        type=_positive("--tokens"),
        default=16384,
        metavar="N",
        help="batch * seqlen of the fwd/bwd timing shapes (default 16384)",
    )
    parser.add_argument(
        "--nheads",
        type=_positive("--nheads"),
        default=16,
        metavar="N",
        help="query heads (default 16; decode uses nheads/4 key heads when nheads is a multiple of 4)",
    )
    parser.add_argument(
        "--decode-batch",
        type=_listed(int),
        default=[1, 8, 32],
        help="comma-separated batch sizes of the decode timing shapes (default 1,8,32)",
    )
    parser.add_argument(
        "--splits",
        type=_listed(int, SPLITS),
        default=list(SPLITS),
        help=f"comma-separated split-KV counts to time for decode, from {','.join(map(str, SPLITS))}",
    )
    parser.add_argument(
        "--min-gain",
        type=_fraction,
        default=0.02,
        metavar="F",
        help="how much faster than the table (or the split heuristic) a candidate must be to "
        "replace it, in [0, 1) (default 0.02)",
    )
    parser.add_argument(
        "--max-candidates",
        type=_positive("--max-candidates"),
        default=None,
        metavar="N",
        help="time at most N configurations per kernel that fit: the table's and the N-1 nearest it "
        "(default: every one)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive("--jobs"),
        default=min(8, os.cpu_count() or 1),
        metavar="N",
        help="processes compiling candidates for pruning (default: the CPU count, at most 8)",
    )
    parser.add_argument(
        "--seconds",
        type=_positive("--seconds"),
        default=None,
        metavar="S",
        help="start no head dim's work (its kernels, then the backward's path) that would likely end past S "
        "seconds; the winners are saved, and --json written, after each head dim (default: no bound)",
    )
    parser.add_argument("--no-prune", action="store_true", help="time every candidate without compiling it first")
    parser.add_argument("--device", default="cuda", help="the GPU to tune (default: the current one)")
    parser.add_argument("--no-save", action="store_true", help="measure and print, write nothing")
    parser.add_argument("--json", metavar="FILE", help="write the full report (every candidate's timings) as JSON")
    parser.add_argument("--show", action="store_true", help="print the cache directory and its files, and exit")
    parser.add_argument("--clear", action="store_true", help="delete the cache files (back to the table), and exit")


def _write_report(path: str, report: dict) -> None:
    """``report`` as JSON at ``path``, whole or not at all (a run stopped midway leaves the last one)."""
    atomic_json.write_json(path, json.loads(json.dumps(report, default=list)))


def _positive(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be a positive integer, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--min-gain must be a number in [0, 1), got {text!r}")
    return value


def show(directory=None, out=print) -> int:
    """Print the cache directory and, per file, its key and entries; then the measured defaults
    shipped in the wheel (``tuned.MEASURED_DIR``), which this machine's files override."""
    directory = tuned.cache_dir() if directory is None else directory
    files = tuned.cache_files(directory)
    out(f"tuned configurations: {directory} (${tuned.ENV_VAR} overrides it){'' if files else '; no files'}")
    for path in files:
        _show_file(path, out)
    shipped = tuned.cache_files(tuned.MEASURED_DIR)
    out(f"measured defaults shipped: {tuned.MEASURED_DIR}{'' if shipped else '; no files'}")
    for path in shipped:
        _show_file(path, out)
    return 0


def _show_file(path, out) -> None:
    try:
        found = tuned.read(path)
    except tuned.BadCacheFile as exc:
        out(f"{path.name}: ignored, {exc}")
        return
    key = found.key
    out(f"{path.name}: {key['gpu']} ({key['target']}), Triton {key['triton']}, flash_recipe {key['flash_recipe']}")
    for (kernel, head_dim, size), config in sorted(found.configs.items()):
        out(f"  {kernel:<8} d{head_dim:<3} {size}-byte  {describe(config)}")
    for (head_dim, size, programs, cache_len), splits in sorted(found.splits.items()):
        out(f"  num_splits d{head_dim:<3} {size}-byte  {programs} programs, cache {cache_len}: {splits}")
    for (head_dim, size), path_name in sorted(found.paths.items()):
        out(f"  backward d{head_dim:<3} {size}-byte  {path_name}")


def clear(directory=None, out=print) -> int:
    """Delete the cache files (``*.tune.json``) in the cache directory."""
    files = tuned.cache_files(directory)
    for path in files:
        path.unlink()
        out(f"deleted {path}")
    if not files:
        out(f"no tuned configurations in {tuned.cache_dir() if directory is None else directory}")
    tuned.forget()
    return 0


def run(args) -> int:
    if args.show:
        return show()
    if args.clear:
        return clear()

    if not torch.cuda.is_available():
        print(
            "flash-recipe tune: no CUDA or ROCm GPU is visible; tune times the kernels on the GPU that will run "
            "them, so run it there (`flash-recipe tune --show` lists what is cached).",
            file=sys.stderr,
        )
        return 2

    def progress(line: str) -> None:
        print(line, flush=True)

    begin = time.perf_counter()
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        device = None
    count = torch.cuda.device_count()
    if device is None or device.type != "cuda" or (device.index or 0) >= count:
        print(
            f"flash-recipe tune: --device must be a GPU, cuda or cuda:N with N < {count}, got {args.device!r}",
            file=sys.stderr,
        )
        return 2
    try:
        print(
            f"tuning {torch.cuda.get_device_name(device)} ({targets.target_of(device)}) into {tuned.cache_dir()}",
            flush=True,
        )
        report = tune(
            args.kernel,
            args.head_dim,
            args.dtype,
            args.seqlen,
            causal=_CAUSAL[args.causal],
            tokens=args.tokens,
            nheads=args.nheads,
            decode_batches=args.decode_batch,
            splits=args.splits,
            device=device,
            prune=not args.no_prune,
            jobs=args.jobs,
            min_gain=args.min_gain,
            max_candidates=args.max_candidates,
            save=not args.no_save,
            progress=progress,
            seconds=args.seconds,
            checkpoint=(lambda report: _write_report(args.json, report)) if args.json else None,
        )
    except (TuneError, ValueError) as exc:
        print(f"flash-recipe tune: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _write_report(args.json, report)
    kept = len(report["configs"]) + len(report["num_splits"]) + len(report["backward"])
    print(
        f"{kept} entries {'written to ' + report['path'] if report['path'] else 'measured (not saved)'} in "
        f"{time.perf_counter() - begin:.0f} s"
    )
    if report["not_reached"]:
        skipped = ", ".join(f"head dim {g['head_dim']} ({'/'.join(g['dtypes'])})" for g in report["not_reached"])
        print(f"not reached within --seconds {args.seconds}: {skipped}")
    return 0 if kept else 1
