"""``python -m devtools.gpu_check``: the Triton kernels' forward and every gradient against
float32 math, case by case from a table, then a seeded fuzz, within a time bound.

The cases, their kinds and how one is checked (the accuracy rule, the peer: SDPA's flash kernel
where it runs the case, else torch math in the input dtype) are ``gpu_check_cases``'s. This runs
``GPU_TABLE`` on a GPU (every row in bf16 and fp16, row by row) and stops starting checks after
``--seconds``, listing those not reached.

Then, while time is left, a fuzz (``random.Random(seed)``) draws dense and varlen cases from the
table's feature sets with random lengths, heads and head dims inside the table's head-dim buckets;
a draw whose kernel variants (recorded with Triton's launch stubbed, ``warmup.recorded_launches``)
are not among the table's is redrawn, so the fuzz runs what is already compiled and spends its time
checking, not compiling.

On the CPU it runs through the Triton interpreter (``TRITON_INTERPRET=1``) on ``TINY_TABLE`` in
float16 and float32; bfloat16 is skipped there and said so (the interpreter computes bf16 dots
wrongly). ``--json FILE`` is rewritten after every check, so a run stopped at its time bound still
leaves its result; its ``summary`` is the campaign report's first line. Exit status 0 when every
check that ran passed (at least one), 1 otherwise, 2 when the kernels cannot run here.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import Any, Callable, Optional

import torch

from flash_recipe.atomic_json import write_json
from flash_recipe.ops import targets
from flash_recipe.ops.configs import head_dim_bucket
from flash_recipe.tools import warmup

from .gpu_check_cases import (
    GPU_DTYPES,
    GPU_TABLE,
    INTERPRETER_DTYPES,
    KINDS,
    TINY_TABLE,
    Case,
    check,
    feature_order,
    run_subject,
    safe_check,
)

__all__ = [
    "GPU_DTYPES", "GPU_TABLE", "INTERPRETER_DTYPES", "KINDS", "TINY_TABLE", "Case", "build_parser", "check",
    "feature_order", "fuzz_case", "main", "run", "run_subject", "safe_check", "summary", "variant_keys",
]  # fmt: skip

INTERPRETER_BF16 = "the Triton interpreter computes bf16 dots wrongly (raw bits): checked on a GPU only"
FUZZ_DRAWS = 25  # draws per fuzz case before giving up on finding one whose variants are compiled


# ----------------------------------------------------------------------------- the fuzz


def fuzz_case(rng: random.Random, templates: list, longest: int) -> Case:
    """A dense or varlen case with one template's features (causal, window, softcap, ALiBi, GQA or
    not) and head-dim bucket, and random lengths (up to ``longest``), heads and head dim."""
    t = rng.choice(templates)
    bucket = head_dim_bucket(t.head_dim)
    head_dim = rng.choice([d for d in range(8, bucket + 1, 8) if head_dim_bucket(d) == bucket])
    nheads_k = rng.choice((1, 2, 3))
    group = 1 if t.nheads == t.nheads_k else rng.choice((2, 4))
    window = t.window
    if window != (-1, -1):
        window = (rng.randint(0, longest // 2), 0 if t.causal else rng.randint(0, longest // 2))
    features = dict(causal=t.causal, window=window, softcap=t.softcap, alibi=t.alibi)
    if t.kind == "varlen":
        batch = rng.randint(1, 4)
        lens_q = tuple(rng.randint(1, longest) for _ in range(batch))
        same = t.causal and all(a == b for a, b in zip(t.lens_q, t.lens_k))
        lens_k = lens_q if same else tuple(rng.randint(1, longest) for _ in range(batch))
        shape = (max(lens_q), max(lens_k), nheads_k * group, nheads_k, head_dim)
        return Case(batch, *shape, kind="varlen", **features, lens_q=lens_q, lens_k=lens_k)
    seqlen_q = rng.randint(1, longest)
    seqlen_k = seqlen_q if t.seqlen_q == t.seqlen_k and rng.random() < 0.5 else rng.randint(1, longest)
    return Case(rng.randint(1, 3), seqlen_q, seqlen_k, nheads_k * group, nheads_k, head_dim, **features)


def variant_keys(case: Case, dtype, device) -> set:
    """The kernel variants the check of ``case`` launches, recorded with Triton's launch stubbed."""
    with warmup.recorded_launches() as launches:
        run_subject(case, dtype, device)
    return {warmup.to_variant(fn, args, kwargs, case.id).key for fn, args, kwargs in launches}


# ----------------------------------------------------------------------------- the run


def default_dtypes(device, interpreter: bool) -> tuple:
    """``(dtypes, {skipped dtype: why})`` for this device."""
    if interpreter:
        return list(INTERPRETER_DTYPES), {"bfloat16": INTERPRETER_BF16}
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["float16"], {"bfloat16": "this GPU has no bf16"}
    return list(GPU_DTYPES), {}


def run(
    table: tuple, dtypes: list, device, seconds: float, fuzz: bool = True, seed: int = 0,
    write: Optional[Callable[[dict], None]] = None, progress: Callable[[str], None] = print, fuzz_limit: int = 0,
) -> dict:  # fmt: skip
    """Check every row of ``table`` in every dtype (row by row), then fuzz while time is left (at
    most ``fuzz_limit`` cases when > 0); stops starting checks after ``seconds``. Returns the
    result document (``write`` gets it after every check)."""
    begin = time.monotonic()
    deadline = begin + seconds
    doc: dict[str, Any] = {"device": str(device), "backend": "triton", "dtypes": [str(d) for d in dtypes]}
    doc.update(seconds_bound=seconds, seed=seed, rows=[], not_reached=[], fuzz={"seed": seed, "cases": 0})
    doc["fuzz"].update(failed=[], passed=0, redrawn=0, gave_up=0, skipped=None if fuzz else "--no-fuzz")

    def save() -> None:
        doc["seconds"] = round(time.monotonic() - begin, 1)
        failed = [r for r in doc["rows"] if not r["passed"]] + doc["fuzz"]["failed"]
        doc["passed"] = bool(doc["rows"]) and not failed  # nothing checked proves nothing
        doc["complete"] = not doc["not_reached"]
        if write is not None:
            write(doc)

    jobs = [(case, dtype) for case in table for dtype in dtypes]
    for index, (case, dtype) in enumerate(jobs):
        if time.monotonic() > deadline:
            doc["not_reached"] = [f"{c.id}:{d}" for c, d in jobs[index:]]
            break
        row = safe_check(case, getattr(torch, dtype), device, seed)
        doc["rows"].append(row)
        progress(_line(row))
        save()
    templates = [c for c in table if c.kind in ("dense", "varlen")]
    if fuzz and templates and not doc["not_reached"]:
        _fuzz(doc, table, templates, dtypes, device, deadline, seed, save, progress, fuzz_limit)
    save()
    return doc


def _fuzz(doc, table, templates, dtypes, device, deadline, seed, save, progress, limit) -> None:
    """The fuzz part of ``run``: cases whose variants the table launched, until the deadline."""
    rng = random.Random(seed)
    known = set()
    for case in table:
        for dtype in dtypes:
            known |= variant_keys(case, getattr(torch, dtype), device)
    longest = max(max(c.seqlen_q, c.seqlen_k) for c in templates)
    record = doc["fuzz"]
    while time.monotonic() < deadline and not (limit and record["cases"] >= limit):
        dtype = getattr(torch, rng.choice(dtypes))
        for _ in range(FUZZ_DRAWS):
            case = fuzz_case(rng, templates, longest)
            if variant_keys(case, dtype, device) <= known:
                break
            record["redrawn"] += 1
        else:
            record["gave_up"] += 1
            continue
        row = safe_check(case, dtype, device, seed=rng.randrange(2**31))
        record["cases"] += 1
        if row["passed"]:
            record["passed"] += 1
        else:
            record["failed"].append(row)
            progress("fuzz " + _line(row))
        save()


def _ratio(error: float, bound: float) -> float:
    """An error as a fraction of its bound (an exact check's bound is 0)."""
    return error / bound if bound else (0.0 if error == 0 else math.inf)


def _line(row: dict) -> str:
    if "error" in row and "errors" not in row:
        return f"FAIL {row['case']:<60} {row['dtype']:<9} {row['error']}"
    ratios = {n: _ratio(row["errors"][n], row["bounds"][n]) for n in row["errors"]}
    worst = max(ratios, key=lambda n: ratios[n])
    ratio = ratios[worst]
    verdict = "ok  " if row["passed"] else "FAIL"
    return f"{verdict} {row['case']:<60} {row['dtype']:<9} {row['peer']:<10} worst {worst} at {ratio:.2f} of its bound"


def summary(doc: dict) -> str:
    """One line for the report's head: what was proven, what failed, what was not reached."""
    rows = doc.get("rows") or []
    passed = [r for r in rows if r.get("passed")]
    failed = [f"{r['case']}:{r['dtype']}" for r in rows if not r.get("passed")]
    fuzz = doc.get("fuzz") or {}
    features = sorted({f for r in passed for f in r.get("features", [])}, key=feature_order)
    peers = sorted({r.get("peer", "?") for r in passed})
    text = (
        f"{'PASSED' if doc.get('passed') else 'FAILED'}: {len(passed)} of {len(rows)} table checks "
        f"(forward and dq/dk/dv within 2x/3x of the low-precision peer's error against fp32 math; peers "
        f"{', '.join(peers) or 'none'}) in {', '.join(sorted({r['dtype'] for r in passed})) or 'no dtype'}"
        f" covering {', '.join(features) or 'nothing'}; fuzz: {fuzz.get('passed', 0)} of {fuzz.get('cases', 0)}"
        f" cases passed (seed {fuzz.get('seed')})"
    )
    if fuzz.get("skipped"):
        text += f", skipped ({fuzz['skipped']})"
    if failed or fuzz.get("failed"):
        text += f"; failed: {', '.join(failed + [f['case'] + ':' + f['dtype'] for f in fuzz.get('failed', [])][:8])}"
    if doc.get("not_reached"):
        text += f"; not reached in {doc.get('seconds_bound')} s: {len(doc['not_reached'])} checks"
    for dtype, why in (doc.get("skipped_dtypes") or {}).items():
        text += f"; {dtype} skipped: {why}"
    return text


# ----------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.gpu_check",
        description="The Triton kernels' forward and gradients against fp32 math by the accuracy rule: a table of "
        "cases, then a seeded fuzz, within --seconds.",
    )
    parser.add_argument("--json", metavar="FILE", help="write the result here (rewritten after every check)")
    parser.add_argument("--seconds", type=float, default=60.0, help="start no check after this many seconds")
    parser.add_argument("--grid", choices=("gpu", "tiny"), help="the table: gpu (default on CUDA) or tiny")
    parser.add_argument("--dtype", action="append", choices=("bfloat16", "float16", "float32"), help="repeatable")
    parser.add_argument("--seed", type=int, default=0, help="inputs and fuzz seed (default 0)")
    parser.add_argument("--no-fuzz", dest="fuzz", action="store_false", help="the table only")
    parser.add_argument("--fuzz-cases", type=int, default=0, help="at most this many fuzz cases (default: the time)")
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seconds <= 0:
        print(f"gpu_check: --seconds must be positive, got {args.seconds:g}", file=sys.stderr)
        return 2
    interpreter = targets.interpreter_enabled()
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreter else "cpu")
    if device.type == "cpu" and not interpreter:
        print("gpu_check: no CUDA device and TRITON_INTERPRET is unset: the Triton kernels cannot run here "
              "(set TRITON_INTERPRET=1 to run the tiny table through the interpreter)", file=sys.stderr)  # fmt: skip
        return 2
    dtypes, skipped = default_dtypes(device, interpreter)
    if args.dtype:
        dtypes = [d for d in args.dtype if d not in skipped]
        skipped = {d: why for d, why in skipped.items() if d in args.dtype}
    table = TINY_TABLE if (args.grid or ("tiny" if device.type == "cpu" else "gpu")) == "tiny" else GPU_TABLE

    def write(doc: dict) -> None:
        doc.update(interpreter=interpreter, skipped_dtypes=skipped, summary=summary(doc))
        if args.json:
            write_json(args.json, doc)

    progress = lambda text: print(text, flush=True)  # noqa: E731
    progress(f"gpu_check: {len(table)} cases x {', '.join(dtypes)} on {device} within {args.seconds:g} s")
    doc = run(table, dtypes, device, args.seconds, args.fuzz, args.seed, write, progress, args.fuzz_cases)
    write(doc)
    progress(doc["summary"])
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
