"""A GPU campaign in one command: ``python -m devtools.campaign --out DIR``.

On a CUDA machine with whatever torch and Triton are installed, it runs these steps, in the order
of value, each in its own subprocess with its own time budget (measured on an H100 and an H200
where the plan's comments say so, planned elsewhere; ``--budget STEP=SECONDS`` changes one). The
whole plan fits ``TOTAL_BUDGET_S``; a run fits what it can in ``--minutes`` (default 9, what one
lent GPU session can spend): a step whose budget no longer fits is skipped, and the plan and the
report's first lines say which and why (``fit``). By default that is env, warmup, check, bench,
decode, memory and host:

=======  ===========================================================================================
env      the device, its memory, torch/CUDA/Triton/flash_recipe versions, the backend chosen for the
         target shape, the bench peers this machine has
warmup   ``flash-recipe warmup --jobs N --for ...`` (N: the CPU count, at most 16): compiles ahead,
         in N processes, the kernel variants of the steps after it that run (check, bench, verify
         in its dtype, the GPU tests), and reports the first-call seconds per kernel family; its
         budget is sized from the variants of those steps (``plan.warmup_budget``)
check    ``devtools.gpu_check``: correctness on the GPU: the forward and dq, dk, dv of a
         table of cases (MHA, GQA, MQA, causal, Sq != Sk, head dims 64/128/256, varlen, a paged KV
         cache with rows appended, window, softcap, ALiBi, dropout by its own replay) in bf16 and
         fp16 against fp32 math by the accuracy rule, SDPA flash the low-precision peer where it
         runs the case; then a seeded fuzz within the table's compiled variants until its time bound
bench    ``flash-recipe bench`` at the target shapes (bf16, head dim 128, 16 heads, seqlen 4k, 8k and
         16k at 16k tokens each, causal and not), forward, backward and both, with its peers side by
         side: SDPA flash, cuDNN and efficient, compiled FlexAttention, and flash_recipe with TMA
         descriptors off (a peer this machine lacks is left out and named in the report)
decode   ``flash_recipe.tools.bench_decode --cuda-graph``: KV-cache bandwidth of one decoding step at
         Llama-3-8B's shape, called from Python and replayed from a CUDA graph, SDPA beside (each
         captured too), and a device-to-device copy's bandwidth
memory   peak memory of one training step (forward; forward and backward) of flash_recipe and SDPA
         flash at seqlen 32k and 64k, above its inputs (``bench.peak_memory``)
host     the host cost per call at the decoding shape (``flash_recipe.tools.host_cost``): Python calls
         and microseconds of ``flash_attn_func`` (with and without autograd) and
         ``flash_attn_with_kvcache``, Triton's launch stubbed and real, torch SDPA's beside
capture  CUDA-graph capture (``devtools.capture_check``): a KV-cache step (dense and paged),
         varlen, the forward and forward + backward, replayed against eager calls bit for bit, and a
         decoding step under ``torch.compile(mode="reduce-overhead")``
verify   ``flash-recipe verify --kvcache --grid full`` in bf16: every backend against
         the reference, ``flash_attn_with_kvcache`` included
tests    pytest on the checkout's GPU-relevant test files, when a ``tests/`` folder lies next to the
         package (else recorded as skipped: an installed wheel has none)
tune     ``flash-recipe tune --head-dim 64,128 --dtype bfloat16 --kernel fwd,decode``, its ``--json``
         report kept
=======  ===========================================================================================

A step that fails, crashes, hangs or outlives its budget is recorded as such (a step over budget
has its whole process group stopped; what a finished step leaves running is stopped too) and the
campaign goes on. The report's first lines say what was proven (the check's summary: which table
checks passed, in which dtypes, covering what, and the fuzz cases), what failed and what was
skipped and why. The targets are then judged from this run's measurements, flash_recipe against
SDPA's flash backend measured side by side in the same process:

- forward at least 1.25x SDPA flash's TFLOP/s at each target shape, causal and not;
- backward at least 1.1x;
- peak memory at most 1.05x SDPA flash's at 32k and 64k, forward and forward + backward;
- peak memory linear in the sequence length: from 32k to 64k it grows at most 1.1 x 2;
- decoding replayed from a CUDA graph at least as fast as SDPA's replay at every row, and from an
  8k cache at least 80% of the copy bandwidth at batch 8 or more (50% below); called from Python,
  at least 0.9x SDPA at batch 8 or more from an 8k cache.

Each is reported per shape with both values, the ratio and PASS or MISS; a shape either side did
not measure is a MISS that says why.

Output, kept to a few files in one folder, so that it is easy to carry off a machine whole:
``campaign.md``
(the report), ``campaign.json`` (everything, machine readable), ``campaign.log`` (every step's
command and full output, in order), ``bench-fwd.png`` and ``bench-bwd.png`` (TFLOP/s against
sequence length per peer; they need matplotlib), the tuned-configuration file ``tune`` wrote,
if any (``*.tune.json``, one per GPU model; ``FLASH_RECIPE_TUNE_CACHE=DIR`` makes flash_recipe
use it) and the measured-defaults file the shoot-out wrote (``measured/<GPU>.tune.json``, to
commit to ``flash_recipe/measured/``, where the wheel ships it): seven at most. ``campaign.md``
and ``campaign.json`` are rewritten after every step, so a campaign that is itself interrupted
still leaves its report. Step results travel through a temporary folder,
``{scratch}`` in the commands, removed at the end.

Every step runs with ``FLASH_RECIPE_TUNE_CACHE`` pointing to an empty folder of the scratch, so
the measurements use the configurations flash_recipe ships (its tables, and its measured file
for this GPU model if it has one), never a tuned file left on the machine; the shoot-out writes
into a folder of its own (``{scratch}/measured``); ``tune`` runs last and writes into the empty
one (``--tune-first`` runs it first, so that verify, bench, memory and tests use what it found).
``TRITON_INTERPRET`` and ``FLASH_RECIPE_BACKEND`` are removed from the steps' environment, and the
folder flash_recipe was imported from is put first on their ``PYTHONPATH``, so every step runs
this same flash_recipe.

``--dry-run`` prints and writes the plan (steps, commands, budgets, shapes) and runs nothing; it
works without a GPU. Without it, a machine with no CUDA device is refused (exit status 2).
``--only bench,memory`` and ``--skip tests`` choose steps (``env`` always runs, and ``warmup``
with any step it compiles for unless ``--skip warmup``), and ``--minutes 24`` leaves room for all
of them.

Exit status: 0 when every step that ran passed (the targets are findings in the report, PASS or
MISS, not an exit status); 1 when a step failed or ran out of time; 2 for a usage error or no GPU.

The package: ``plan`` (budgets, targets, the steps), ``steps`` (running one and collecting its
results), ``workers`` (the steps run in-process), ``targets`` (the verdicts, pure), ``report``
(campaign.md and campaign.json) and ``cli`` (the command line and the run).
"""

from __future__ import annotations

from .cli import (
    build_parser,
    cuda_available,
    main,
    run_campaign,
)
from .plan import (
    BENCH_MODES,
    BENCH_PEERS,
    BENCH_REPS,
    BENCH_WARMUP,
    BUDGETS_S,
    DEFAULT_MINUTES,
    GPU_TEST_FILES,
    LINEAR_SLACK,
    MEMORY_PEERS,
    MEMORY_RATIO,
    MEMORY_SEQLENS,
    OUTPUT_FILES,
    REFERENCE,
    RESERVE_S,
    SPEED_TARGETS,
    STEP_NAMES,
    STOP_GRACE_S,
    SUBJECT,
    TARGET,
    TOTAL_BUDGET_S,
    TUNE_HEAD_DIMS,
    TUNE_JOBS,
    TUNE_KERNELS,
    TUNE_SEQLEN,
    VERIFY_DTYPES,
    Step,
    bench_shapes,
    build_plan,
    find_test_tree,
    fit,
    format_plan,
    memory_shapes,
    package_root,
    select,
)
from .report import (
    build_targets,
    new_report,
    render_markdown,
    timestamp,
    write_report,
)
from .steps import (
    collect,
    make_plots,
    run_step,
    step_environment,
    without_unavailable_peers,
)
from .targets import (
    decode_targets,
    memory_table,
    memory_targets,
    parse_junit,
    speed_targets,
    summarize_targets,
    summarize_verify,
)
from .workers import (
    env_probe,
    memory_rows,
    run_worker,
    worker_parser,
    write_json,
)

__all__ = [
    "BENCH_MODES",
    "BENCH_PEERS",
    "BENCH_REPS",
    "BENCH_WARMUP",
    "BUDGETS_S",
    "DEFAULT_MINUTES",
    "GPU_TEST_FILES",
    "LINEAR_SLACK",
    "MEMORY_PEERS",
    "MEMORY_RATIO",
    "MEMORY_SEQLENS",
    "OUTPUT_FILES",
    "REFERENCE",
    "RESERVE_S",
    "SPEED_TARGETS",
    "STEP_NAMES",
    "STOP_GRACE_S",
    "SUBJECT",
    "Step",
    "TARGET",
    "TOTAL_BUDGET_S",
    "TUNE_HEAD_DIMS",
    "TUNE_JOBS",
    "TUNE_KERNELS",
    "TUNE_SEQLEN",
    "VERIFY_DTYPES",
    "bench_shapes",
    "build_parser",
    "build_plan",
    "build_targets",
    "collect",
    "cuda_available",
    "env_probe",
    "find_test_tree",
    "format_plan",
    "main",
    "make_plots",
    "memory_rows",
    "memory_shapes",
    "memory_table",
    "decode_targets",
    "memory_targets",
    "new_report",
    "package_root",
    "parse_junit",
    "render_markdown",
    "run_campaign",
    "run_step",
    "run_worker",
    "fit",
    "select",
    "speed_targets",
    "step_environment",
    "summarize_targets",
    "summarize_verify",
    "timestamp",
    "without_unavailable_peers",
    "worker_parser",
    "write_json",
    "write_report",
]
