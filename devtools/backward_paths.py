"""The backward path per family: the warp-instructions per score element of each path's main loops,
from the compile check, and the path each family runs by default (``configs.BACKWARD_PATHS``).

Per element is ``instructions x warps / (BLOCK_M x BLOCK_N)`` of a kernel's main loop
(``compile_check`` rows' ``loop_per_element``): the one-pass backward's dK/dV kernel adding dQ
against the three kernels' dQ kernel plus dK/dV kernel (their preprocess is the same). The
fewer, averaged over MHA and GQA (a row each), is the family's default, unless that path spills
in a call the check budgets (``SPILLING``) or a GPU measured the other faster
(``configs.MEASURED_BACKWARD_PATHS``); each row's ``source`` says which of the three chose it.
The table in docs/performance.md ("The backward path per family") is this tool's output, and
tests/test_backward_paths.py pins the defaults to it::

    python -m devtools.backward_paths --jobs 2 [--target sm90] [--head-dim 128]
    python -m devtools.backward_paths --rows rows.jsonl   # compile check --json output

On AMD a wavefront issues each instruction once, as a warp does, so the counts read the same
(``compiled_code.amd_main_loop_body``); each AMD target has its row, since the family's three
generations of matrix cores do not agree (``configs.BACKWARD_PATHS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from flash_recipe.ops import configs, limits

from . import compile_check

# One target per NVIDIA family (the families' own compile targets), and every AMD target: their
# family ("amd") shares one table of tiles across three generations of matrix cores.
TARGETS = ("sm80", "sm86", "sm90", "sm100", "sm120", "gfx90a", "gfx942", "gfx950")
# The paths the proxy compares, by the kernels whose loops it counts. The one launch
# (``ops.backward_one_launch``) runs the three kernels' loops in one launch, so instruction counts
# cannot tell it from them: only a GPU's timing can choose it (``flash-recipe tune``).
PATH_KERNELS = {"one_pass": ("bwd_onepass",), "three_kernels": ("bwd_dq", "bwd_dkdv")}
# Where the path with fewer instructions spills in a call the compile check budgets, the other is
# the default: (target, head dim) -> why (``python -m devtools.compile_check --call varlen``).
SPILLING = {
    ("sm86", 64): "the three kernels' dQ kernel spills 8 B with packed sequences",
    ("sm100", 128): "the three kernels' dK/dV kernel spills 48 B with packed sequences",
}


def path_rows(rows: list) -> list[dict]:
    """One row per (target, head dim) with both paths' per-element counts, MHA and GQA, from the
    compile check's rows of the aligned bf16/fp16 ``bwd`` call: ``{"target", "head_dim",
    "one_pass": (mha, gqa), "three_kernels": (mha, gqa), "fewer", "default", "source"}`` (a count
    of None where a kernel's main loop was not found; ``source``: ``source_of``)."""
    found: dict[tuple, float] = {}
    for row in rows:
        chosen = row.get("call") == "bwd" and row.get("form") == "aligned" and row.get("dtype") != "float32"
        if chosen and row.get("loop_per_element") is not None:
            grouped = row["case"].endswith("-gqa")
            found[(row["target"], row["head_dim"], row["kernel"], grouped)] = float(row["loop_per_element"])
    table = []
    for target, head_dim in sorted({(t, d) for t, d, _, _ in found}, key=lambda x: (TARGETS.index(x[0]), x[1])):
        counts: dict[str, tuple] = {}
        for path, kernels in PATH_KERNELS.items():
            each = [[(target, head_dim, kernel, grouped) for kernel in kernels] for grouped in (False, True)]
            counts[path] = tuple(
                round(sum(found[key] for key in keys), 2) if all(key in found for key in keys) else None
                for keys in each
            )
        fewer = None
        if None not in counts["one_pass"] + counts["three_kernels"]:
            fewer = min(PATH_KERNELS, key=lambda path: float(sum(counts[path])))
        default = configs.backward_path(target, head_dim)
        table.append(
            {
                "target": target,
                "head_dim": head_dim,
                **counts,
                "fewer": fewer,
                "default": default,
                "source": source_of(target, head_dim),
            }
        )
    return table


def source_of(target: str, head_dim: int) -> str:
    """What chose the default of ``target`` at ``head_dim``: ``"GPU"`` (a measurement,
    ``configs.MEASURED_BACKWARD_PATHS``), ``"spills"`` (the path with fewer instructions spills,
    ``SPILLING``) or ``"instructions"`` (the fewer)."""
    if (target, head_dim) in configs.MEASURED_BACKWARD_PATHS:
        return "GPU"
    return "spills" if (target, head_dim) in SPILLING else "instructions"


def markdown(table: list) -> str:
    """The table as docs/performance.md shows it."""
    lines = [
        "| target | head dim | one-pass, MHA / GQA | three kernels, MHA / GQA | fewer | default | chosen by |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for row in table:
        one, three = (" / ".join("-" if c is None else f"{c:.2f}" for c in row[p]) for p in PATH_KERNELS)
        lines.append(
            f"| {row['target']} | {row['head_dim']} | {one} | {three} | {row['fewer'] or '-'} | {row['default']} "
            f"| {row['source']} |"
        )
    return "\n".join(lines)


# The comment that precedes the table in docs/performance.md.
DOCS_MARKER = "<!-- backward-paths -->"


def read_markdown(text: str) -> list[dict]:
    """The rows of the table that follows ``DOCS_MARKER`` in ``text`` (a page of the docs), as
    ``path_rows`` gives them."""
    lines = text.split(DOCS_MARKER + "\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    table = []
    for line in lines:
        target, head_dim, one, three, fewer, default, source = (
            cell.strip() for cell in line.strip().strip("|").split("|")
        )
        counts = [tuple(None if c == "-" else float(c) for c in cell.split(" / ")) for cell in (one, three)]
        table.append(
            {
                "target": target,
                "head_dim": int(head_dim),
                "one_pass": counts[0],
                "three_kernels": counts[1],
                "fewer": None if fewer == "-" else fewer,
                "default": default,
                "source": source,
            }
        )
    return table


def compile_rows(targets: list, head_dims: list, jobs: int = 1) -> list:
    """The compile check's rows of the aligned bf16 ``bwd`` call for ``targets`` and ``head_dims``."""
    chosen = compile_check.select_jobs(None, targets, ["bwd"], ["bfloat16"], head_dims, ["aligned"])
    return list(compile_check.run_jobs(chosen, jobs))


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.backward_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="repeatable; default: every family's")
    parser.add_argument(
        "--head-dim",
        action="append",
        type=int,
        choices=limits.HEAD_DIM_BUCKETS,
        help="repeatable; default: every bucket",
    )
    parser.add_argument("--rows", type=Path, help="the compile check's --json output to read instead of compiling")
    parser.add_argument("--jobs", type=int, default=1, help="parallel compiler processes")
    args = parser.parse_args(argv)
    if args.rows is not None:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.startswith("{")]
    else:
        rows = compile_rows(args.target or list(TARGETS), args.head_dim or list(limits.HEAD_DIM_BUCKETS), args.jobs)
    wanted = [
        row
        for row in rows
        if row.get("target") in (args.target or TARGETS)
        and row.get("head_dim") in (args.head_dim or limits.HEAD_DIM_BUCKETS)
    ]
    table = path_rows(wanted)
    print(markdown(table))
    differ = [row for row in table if row["fewer"] not in (None, row["default"]) and row["source"] == "instructions"]
    for row in differ:
        print(
            f"{row['target']} at head dim {row['head_dim']}: {row['fewer']} issues fewer, the default is "
            f"{row['default']}",
            file=sys.stderr,
        )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
