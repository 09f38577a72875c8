"""``flash-recipe tune``: time launch configurations on the local GPU and keep the fastest.

For each kernel (``fwd``, ``fwd_general``, ``bwd_dkdv``, ``bwd_dq``, ``bwd_onepass``, ``decode``, and
``bwd_onelaunch`` where the target's table offers it; the general forward is timed and checked on a
softcapped call), head-dim bucket and element size
(2 for fp16 and bf16, which share their tiles; 4 for fp32), the tuner

1. takes the candidates: the table's own configuration, then a small grid (``GRID``);
2. prunes them by a launch-specialised compile: each candidate is compiled for the GPU's own
   compile target through the real launchers, as ``devtools.compile_check`` compiles a launch
   (``aligned`` and ``ragged`` forms), and dropped when its kernel needs more shared memory per
   block than the architecture offers (``configs.SHARED_MEMORY_LIMIT``), compiles to a trap, or
   spills a register in the aligned form under the installed Triton (the ragged form's spills,
   every score option at once, are reported: most tiles spill there); the table's own
   configuration is timed whatever its compile says: it is the baseline;
3. checks each remaining candidate's output on small aligned and ragged shapes against the fp32
   reference by the accuracy rule (at most 2x the error of PyTorch in the input precision for
   the output, 3x for the gradients, plus 1e-5), with output buffers filled with NaN first: a
   candidate that computes anything else, or leaves a tile unwritten, is rejected;
4. times it through the real launcher (``ops.forward.attention_forward``,
   ``ops.backward_launch.attention_backward``, ``ops.kvcache.attention_kvcache``) inside
   ``choose.overriding`` (``triton.testing.do_bench``, median, L2 flushed between runs) on the
   timing shapes: each sequence length at about ``tokens`` tokens per batch, causal and not; a
   decoding step (one query row, GQA 4:1) per batch size and cache length. The backward's
   configurations are timed as the whole backward with only the tuned kernel changed;
5. keeps the candidate with the least geometric mean, over the timing shapes and dtypes, of its
   time divided by the table's, if that is at most ``1 - min_gain``; else the table's.

The backward's path is chosen after its kernels: each path the target offers (the one pass, the
three kernels, and the one launch where its tiles are in the table) is checked, then timed whole
with the winners of its kernels, and the fastest kept when it beats the family's default
(``configs.BACKWARD_PATHS``) by ``min_gain`` (``Tuner.best_path``; the file's ``backward`` section).

Decoding's split-KV count is tuned after the decode configuration: each of ``splits`` is checked,
then timed per batch size and cache length, and the fastest is kept per bucket of programs
(``batch * nheads``) and cache length when it beats ``kvcache.heuristic_splits`` by ``min_gain``.

The work goes one head dim (and element size) at a time: its kernels, its split counts, then its
backward path. After each, the winners so far are written to the per-device cache
(``flash_recipe.ops.tuned``: where it lives, its format, its key), which ``choose.launch_config``
and ``kvcache.auto_splits`` read from then on; a run stopped later keeps them. With a bound on
the run's seconds, a head dim that would likely end past it is not started (``not_reached``). A
run covers what it is asked for and keeps the file's other entries.

The package, one module per step:

- ``problem``: the kernels, the candidate grid, the shapes and one checked launch (``Problem``, ``Check``);
- ``candidates``: the candidates of a kernel and their pruning by the compile check;
- ``search``: checking and timing them (``Tuner``, its settings frozen) and ``tune``;
- ``cli``: the ``flash-recipe tune`` subcommand.
"""

from __future__ import annotations

from .candidates import (
    candidates,
    prune,
)
from .cli import (
    add_arguments,
    clear,
    run,
    show,
)
from .problem import (
    COMPILE_CALL,
    DTYPES,
    EIGHT_WARPS_MIN_TILE,
    ELEMENT_SIZE,
    GENERAL_SOFTCAP,
    GRID,
    HEAD_DIMS,
    KERNELS,
    SPLITS,
    Check,
    CheckSizes,
    Problem,
    Shape,
    Timer,
    Trial,
    TuneError,
    describe,
    nan_outputs,
)
from .search import (
    Tuner,
    gpu_timer,
    timing_shapes,
    tune,
)

__all__ = [
    "COMPILE_CALL",
    "Check",
    "CheckSizes",
    "DTYPES",
    "EIGHT_WARPS_MIN_TILE",
    "ELEMENT_SIZE",
    "GENERAL_SOFTCAP",
    "GRID",
    "HEAD_DIMS",
    "KERNELS",
    "Problem",
    "SPLITS",
    "Shape",
    "Timer",
    "Trial",
    "TuneError",
    "Tuner",
    "add_arguments",
    "candidates",
    "clear",
    "describe",
    "gpu_timer",
    "nan_outputs",
    "prune",
    "run",
    "show",
    "timing_shapes",
    "tune",
]
