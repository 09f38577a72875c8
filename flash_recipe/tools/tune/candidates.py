"""The candidates of one kernel (the table's configuration, then ``GRID``) and their pruning by
what a launch-specialised compile for the target says (``compile_calls.compile_case``): shared
memory within the target's limit, no spilled register, no trap."""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import multiprocessing
import subprocess
from typing import Optional

from ...ops import choose, configs, targets
from ...ops.configs import Config
from .problem import COMPILE_CALL, EIGHT_WARPS_MIN_TILE, ELEMENT_SIZE, GRID, TuneError

# -- candidates and pruning -------------------------------------------------------------------


def candidates(kernel: str, table: Config, grid: Optional[dict] = None) -> list[Config]:
    """The table's configuration first, then ``grid[kernel]`` (a list of configs, default ``GRID``'s
    product, with eight warps only on tiles of at least ``EIGHT_WARPS_MIN_TILE`` elements), each once."""
    if grid is not None and kernel in grid:
        found = [Config(*c) for c in grid[kernel]]
    else:
        found = [
            Config(*c) for c in itertools.product(*GRID[kernel]) if c[2] < 8 or c[0] * c[1] >= EIGHT_WARPS_MIN_TILE
        ]
    return list(dict.fromkeys([Config(*table)] + found))


def nearest(found: list, table: Config, limit: Optional[int]) -> list[Config]:
    """``table`` (when among ``found``) and the ``limit - 1`` other configurations of ``found``
    nearest to it: fewest doublings or halvings of the blocks and warps plus the difference in
    stages, ties in ``found``'s order. ``limit`` None keeps all of ``found``."""
    if limit is None:
        return list(found)

    def distance(config: Config) -> float:
        steps = sum(abs(math.log2(a / b)) for a, b in zip(config[:3], table[:3]))
        return steps + abs(config[3] - table[3])

    others = sorted((c for c in found if c != table), key=distance)  # sorted() keeps ties in order
    return ([table] if table in found else []) + others[: max(limit - 1, 0) if table in found else limit]


def _compile_one(job: tuple) -> list[dict]:
    """Compile one candidate in one form for a target; one row per compiled launch of the kernel."""
    # Triton on use: without it ``flash-recipe tune`` says why
    from ..compile_calls import Case, compile_case, resource_usage, stores

    kernel, head_dim, dtype, config, target, form = job
    row = {"kernel": kernel, "config": list(config), "form": form, "target": target}
    try:
        with choose.overriding(kernel, head_dim, ELEMENT_SIZE[dtype], Config(*config)):
            compiled = compile_case(Case(COMPILE_CALL[kernel], dtype, head_dim, form), target)
    except Exception as exc:  # a candidate the compiler refuses is dropped, with the reason
        return [{**row, "fits": False, "problem": f"does not compile: {type(exc).__name__}: {exc}"[:500]}]
    rows = []
    limit = configs.SHARED_MEMORY_LIMIT[target]
    for label, _name, compiled_kernel in compiled:
        if label != kernel:
            continue
        problems = []
        shared = compiled_kernel.metadata.shared
        if shared > limit:
            problems.append(f"needs {shared} B of shared memory, {target} offers {limit} B")
        amd = target.startswith("gfx")
        try:
            registers, spill_bytes = resource_usage(compiled_kernel, amd=amd)
        except (OSError, subprocess.CalledProcessError, RuntimeError):  # no cuobjdump beside this Triton
            registers = spill_bytes = None  # not known: the candidate is timed, as before the check
        if spill_bytes and form == "aligned":
            problems.append(f"spills {spill_bytes} B per thread ({registers} registers)")
        if not stores(compiled_kernel, amd=amd):
            problems.append("compiles to a trap")
        rows.append(
            {
                **row,
                "shared_bytes": shared,
                "shared_limit": limit,
                "registers": registers,
                "spill_bytes": spill_bytes,
                "fits": not problems,
                "problem": "; ".join(problems) or None,
            }
        )
    return rows or [{**row, "fits": False, "problem": f"the {COMPILE_CALL[kernel]} call launched no {kernel} kernel"}]


def prune(
    kernel: str,
    head_dim: int,
    dtype: str,
    found: list,
    target: str,
    forms: tuple = ("aligned", "ragged"),
    jobs: int = 1,
) -> tuple[list[Config], list[dict]]:
    """Keep the candidates that fit ``target``: compiled through the real launchers with a launch's
    specialisation (``compile_calls.compile_case``, in each of ``forms``), none may need more shared
    memory than ``configs.SHARED_MEMORY_LIMIT[target]`` or compile to a trap, and none of the
    ``aligned`` form's (the calls the timings run) may spill a register under the installed Triton
    (a release's spills differ). The ``ragged`` form's spills are reported, not pruned: every score
    option at once spills on most tiles, the tables' own included (sm90's one launch at head dim
    128: 1.4-1.9 KB a thread under Triton 3.6, every candidate of ``GRID``).

    Returns the kept configurations (in the given order) and one row per compiled kernel:
    ``config``, ``form``, ``shared_bytes``, ``shared_limit``, ``registers``, ``spill_bytes``,
    ``fits``, ``problem`` (``registers`` and ``spill_bytes`` None where this Triton ships no
    ``cuobjdump`` to read them: the candidate is then kept on its other checks). A candidate
    dropped in one form is not compiled in the next. Needs Triton's compiler (``TRITON_INTERPRET``
    unset); ``jobs > 1`` compiles in that many processes.
    """
    if targets.interpreter_enabled():
        raise TuneError("pruning compiles the kernels for the GPU: unset TRITON_INTERPRET")
    if target not in configs.SHARED_MEMORY_LIMIT:
        raise TuneError(f"no shared-memory limit on record for {target}; known: {sorted(configs.SHARED_MEMORY_LIMIT)}")
    kept, rows = [Config(*c) for c in found], []
    pool = None
    if jobs > 1 and len(found) > 1:
        # Fresh processes: a forked copy of a process that has used the GPU must not touch it.
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        for form in forms:  # a candidate that fails one form is not compiled in the next
            work = [(kernel, head_dim, dtype, tuple(c), target, form) for c in kept]
            results = list(pool.map(_compile_one, work) if pool else map(_compile_one, work))
            rows += [row for result in results for row in result]
            bad = {tuple(row["config"]) for row in rows if not row["fits"]}
            kept = [c for c in kept if tuple(c) not in bad]
    finally:
        if pool:
            pool.shutdown()
    return kept, rows
