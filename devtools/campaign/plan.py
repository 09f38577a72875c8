"""The campaign's plan: its budgets, targets and shapes, and the steps it runs (``Step``,
``build_plan``)."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from flash_recipe.tools import bench
from flash_recipe.tools.bench import Shape

from .. import gpu_check_cases as gpu_check

# The whole plan, with every step, fits in TOTAL_BUDGET_S (warmup compiling for check, bench,
# verify and the tests included); a run fits what it can in ``--minutes`` (DEFAULT_MINUTES unless
# asked: ``fit``), in the order of the plan, which is the order of value.
TOTAL_BUDGET_S = 24 * 60
DEFAULT_MINUTES = 9
# Kept out of the steps' budgets: stopping a step that outlives its budget, and writing the report.
RESERVE_S = 45
STOP_GRACE_S = 5

# The target shapes: bf16, head dim 128, MHA with 16 heads, about 16k tokens per shape.
TARGET: dict[str, Any] = {
    "dtype": "bfloat16",
    "head_dim": 128,
    "nheads": 16,
    "tokens": 16384,
    "seqlens": (4096, 8192, 16384),
}
SUBJECT, REFERENCE = "flash_recipe", "sdpa_flash"
BENCH_PEERS = (SUBJECT, REFERENCE, "sdpa_cudnn", "sdpa_efficient", "flex", "flash_recipe_pointers")
BENCH_MODES = ("fwd", "bwd", "fwd_bwd")
BENCH_WARMUP, BENCH_REPS = 5, 20
MEMORY_SEQLENS = (32768, 65536)
MEMORY_PEERS = (SUBJECT, REFERENCE)
TUNE_HEAD_DIMS = (64, 128)
# The kernels the campaign tunes, within its budget: most of a tuning run is compiling candidates
# (in TUNE_JOBS processes), and the dense forward and decoding are what most calls run.
TUNE_KERNELS = ("fwd", "decode")
TUNE_JOBS = 12
TUNE_SEQLEN = 8192
# The shoot-out (``flash-recipe tune`` of the backward, right after the correctness check): every
# backward path with at most SHOOTOUT_CANDIDATES configurations per kernel (the table's and those
# nearest it that fit), each path then timed whole at the training shapes (bf16, head dims 64 and
# 128, causal and not, about 16k tokens, 16 heads), the faster kept where it beats the table's
# default. It writes the measured-defaults file for this GPU model (``tuned.MEASURED_DIR``'s format)
# into ``measured/`` beside the report, to be committed to ``flash_recipe/measured/``. Head dim 128
# goes first: there a GPU's timing and the instruction proxy disagreed (``configs.MEASURED_BACKWARD_PATHS``).
# tune saves its winners after each head dim and starts none that would likely end past the step's
# budget less TUNE_MARGIN_S (``tune --seconds``): a shoot-out that runs long keeps what it finished.
SHOOTOUT_KERNELS = ("bwd_dq", "bwd_dkdv", "bwd_onepass", "bwd_onelaunch")
SHOOTOUT_HEAD_DIMS = (128, 64)
# Seconds of a tune step's budget left for its last save, its report and its exit (``--seconds``).
TUNE_MARGIN_S = 15
SHOOTOUT_SEQLENS = (4096, 16384)
SHOOTOUT_CANDIDATES = 4
# bf16, what training runs: fp16 shares its kernels, and fp32 (its own path) is verified by CI under
# the interpreter; `flash-recipe verify --dtype float32` on the GPU covers it when time allows.
VERIFY_DTYPES = ("bfloat16",)
# Test files that exercise the kernels on the GPU when one is present (the device fixture).
GPU_TEST_FILES = (
    "test_gpu.py",
    "test_kernels.py",
    "test_kvcache.py",
    "test_varlen.py",
    "test_dropout.py",
    "test_torch_compile.py",
    "test_host_reads.py",  # on a GPU the metadata really lives in device memory
    "test_sage.py",  # 8-bit attention: FP8 P.V runs on a GPU only
)

SPEED_TARGETS = {"fwd": 1.25, "bwd": 1.1}  # flash_recipe TFLOP/s over SDPA flash's, at least
MEMORY_RATIO = 1.05  # flash_recipe peak memory over SDPA flash's, at most
LINEAR_SLACK = 1.1  # peak growth at most this times the sequence-length growth

# Decoding (``flash_recipe.tools.bench_decode --cuda-graph``): Llama-3-8B's attention shape, one
# query row per sequence, each step timed as Python calls it and replayed from a CUDA graph (both
# flash_recipe's and SDPA's). Targets (``targets.decode_targets``): replayed, at least SDPA's own
# replay at every row, and from a DECODE_LONG-row cache at least DECODE_REPLAY_OF_COPY of the
# device-to-device copy's bandwidth measured in the same run (batch >= DECODE_WIDE: True; smaller:
# False); called from Python, at least DECODE_EAGER_RATIO x SDPA's at batch >= DECODE_WIDE there.
DECODE_BATCHES, DECODE_CACHES = (1, 8, 32, 64), (1024, 8192, 32768)
DECODE_LONG, DECODE_WIDE = 8192, 8
DECODE_REPLAY_OF_COPY = {True: 0.8, False: 0.5}
DECODE_EAGER_RATIO = 0.9
# The host cost step (``flash_recipe.tools.host_cost``) and the capture step's checks
# (``devtools.capture_check``).
HOST_CASES = ("fwd", "fwd_autograd", "kvcache", "fwd_bwd")
CAPTURE_CHECKS = ("kvcache", "kvcache_paged", "varlen", "fwd", "fwd_bwd", "compile")

# The steps in the order of value (after ``env``): compiling ahead, correctness on the GPU, the
# backward's shoot-out (what ships as measured defaults), training speed, the host cost per call
# (what a decoding step's speed at small batches is made of; it fits the default 9 minutes beside
# the steps before it), decoding speed, memory, CUDA-graph capture, verify's grids, the GPU
# tests, tuning.
STEP_NAMES = (
    "warmup", "check", "shootout", "bench", "host", "decode", "memory", "capture", "verify", "tests", "tune"
)  # fmt: skip
# Seconds per step (``--budget STEP=SECONDS`` changes one). Measured on one H200 on 2026-11-27:
# env 10 s, bench 132 s, memory 17 s, decode 16 s (eager only; the CUDA-graph replay about doubles
# it), verify (bf16, full and KV grids) unfinished after 90 s of compiling; on an H100 on
# 2026-11-25 bench took 189 s and memory 33 s. host and capture are planned, not yet measured: host
# times 3 cases 2 ways with SDPA beside, capture compiles 6 small variants; shootout is planned, not
# yet measured (compiling and timing at most 4 configurations of 3 kernels at 2 head dims, then the
# 2 paths whole, with the pruning in TUNE_JOBS processes). warmup's budget is
# ``warmup_budget`` of the steps it compiles for that run (below); the figure here is for all of them.
BUDGETS_S = {
    "env": 20, "warmup": 0, "check": 60, "shootout": 150, "bench": 190, "decode": 60, "memory": 35, "host": 30,
    "capture": 60, "verify": 120, "tests": 210, "tune": 270,
}  # fmt: skip

# ``check`` (``devtools.gpu_check``): its table (19 rows in bf16 and fp16: 38 checks)
# launches 98 kernel variants (recorded for sm90 by ``python -m devtools.warmup --offline sm90
# --for check``); compiled on first call one after another they take WARMUP_SERIAL_S["check"] (1.7
# minutes on the CPU machine), so the campaign compiles them ahead in ``warmup``. With its
# variants in Triton's cache the step is the interpreter's and CUDA's start (about 10 s), the 38
# checks (each loads its variants and runs a small forward and backward beside fp32 math and its
# peer: well under a second) and the fuzz, which fills the rest: its table stops starting checks
# CHECK_MARGIN_S before the budget ends (the check in flight and the exit). Without warmup
# (``--skip warmup``) the table is cut at that time and the report lists the checks not reached.
CHECK_MARGIN_S = 15
# ``warmup`` compiles, in ``warmup_jobs()`` processes, the variants of the steps that run among
# WARMUP_FOR (``python -m devtools.warmup --for``). Its budget (``warmup_budget``): WARMUP_START_S
# (spawning the workers, each importing torch and Triton), plus per step (``warmup_share``) the
# seconds to record its calls with launches stubbed (WARMUP_RECORD_S) and its serial compile seconds
# (WARMUP_SERIAL_S) divided among MAX_WARMUP_JOBS processes and multiplied by WARMUP_SAFETY (the GPU
# machine's cores are not the ones measured, and 16 processes share its memory bandwidth).
WARMUP_FOR = {
    "check": ["check"], "bench": ["bench"], "verify": [f"verify:{dtype}" for dtype in VERIFY_DTYPES], "tests": ["tests"]
}  # fmt: skip
# Measured on the 2-core CPU machine with Triton 3.9 and the compile check's stub driver for sm90,
# each step alone and with an empty Triton cache (``TRITON_CACHE_DIR=$(mktemp -d) python -m
# devtools.warmup --offline sm90 --for STEP --jobs 2``, the sum of the per-variant first-call seconds):
# check 101.2 s (98 variants: bwd 41.9 s, fwd 27.7 s, fwd_general 20.5 s, the rest 11.1 s); bench
# 8.2 s (7 variants); verify in bf16, full and KV grids, both backward paths, 137.5 s (140
# variants: bwd 82.5 s); the GPU tests' tables 554.2 s (287 variants: bwd 367.4 s, the longest an
# fp32 backward variant at 13.7 s). Recording took 4-6 s for check and verify and 10 s for tests
# there (CPU tensors); bench's recording allocates its 16k-token tensors on the CPU, milliseconds on
# a GPU.
WARMUP_SERIAL_S = {"check": 102, "bench": 9, "verify": 138, "tests": 555}
WARMUP_RECORD_S = {"check": 6, "bench": 2, "verify": 6, "tests": 10}
WARMUP_START_S = 10
MAX_WARMUP_JOBS = 16
WARMUP_SAFETY = 2.0

OUTPUT_FILES = ("campaign.md", "campaign.json", "campaign.log", "bench-fwd.png", "bench-bwd.png")


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Step:
    """One step of the campaign: a command run in its own subprocess within ``budget_s`` seconds.

    ``argv`` may contain ``{scratch}`` (the campaign's temporary folder). ``result`` names the
    file under the scratch where the step leaves its JSON result; with ``stdout_is_result`` the
    step's standard output is that file (its standard error goes to the log). ``cwd`` None runs
    it in the scratch. ``skip`` is why a planned step does not run. ``params`` describe what it
    covers, for the plan and the report. ``env``: variables set for this step alone.
    """

    name: str
    title: str
    argv: list
    budget_s: int
    params: dict = dataclasses.field(default_factory=dict)
    result: Optional[str] = None
    stdout_is_result: bool = False
    cwd: Optional[str] = None
    skip: Optional[str] = None
    env: dict = dataclasses.field(default_factory=dict)

    def command(self, scratch: str = "{scratch}") -> list:
        return [arg.replace("{scratch}", scratch) for arg in self.argv]

    def environment(self, base: dict, scratch: str) -> dict:
        """``base`` with the step's own variables (``env``, which may contain ``{scratch}``) over it."""
        return {**base, **{name: value.replace("{scratch}", scratch) for name, value in self.env.items()}}

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "title": self.title,
            "command": shlex.join(self.argv),
            "budget_s": self.budget_s,
            "params": self.params,
            "cwd": self.cwd,
            "skip": self.skip,
            "env": self.env,
        }


def package_root() -> Path:
    """The checkout's root (the folder holding ``devtools/`` and ``flash_recipe/``), which every
    step gets on its ``PYTHONPATH``."""
    return Path(__file__).resolve().parents[2]  # devtools/campaign/plan.py


def find_test_tree(root: Optional[Path] = None) -> Optional[Path]:
    """The checkout's ``tests/`` folder next to the package, if it holds any GPU test file."""
    tests = (root or package_root()) / "tests"
    if tests.is_dir() and any((tests / name).is_file() for name in GPU_TEST_FILES):
        return tests
    return None


def warmup_jobs() -> int:
    """The warmup's processes: this machine's CPU count, at most MAX_WARMUP_JOBS."""
    return max(1, min(os.cpu_count() or 1, MAX_WARMUP_JOBS))


def warmup_share(step: str) -> int:
    """Seconds of ``warmup``'s budget that ``step``'s variants add (see WARMUP_SERIAL_S)."""
    return math.ceil(WARMUP_RECORD_S[step] + WARMUP_SAFETY * WARMUP_SERIAL_S[step] / MAX_WARMUP_JOBS)


def warmup_budget(steps: list) -> int:
    """``warmup``'s budget when it compiles for ``steps`` (names of WARMUP_FOR)."""
    return WARMUP_START_S + sum(warmup_share(step) for step in steps)


def with_warmup_for(step: Step, steps: list) -> Step:
    """The warmup step compiling for ``steps`` (in the plan's order), its budget sized for them
    unless it was given one (``--budget warmup=S``)."""
    argv = list(step.argv)
    argv[argv.index("--for") + 1] = ",".join(item for name in steps for item in WARMUP_FOR[name])
    if "tests" not in steps and "--tests" in argv:  # the test tree is read only for the tests' variants
        del argv[argv.index("--tests") : argv.index("--tests") + 2]
    params = {**step.params, "for": list(steps)}
    budget = step.budget_s
    if params["budget"] != "given":
        budget = warmup_budget(steps)
        shares = " + ".join(f"{name} {warmup_share(name)} s" for name in steps)
        params["budget"] = f"{WARMUP_START_S} s to start + compiling for {shares}"
    return dataclasses.replace(step, argv=argv, budget_s=budget, params=params)


def bench_shapes() -> list:
    """The target shapes, as ``flash-recipe bench`` builds them from the bench step's options."""
    causal, gqa = [False, True], [False]
    return bench.shapes(
        TARGET["seqlens"], [TARGET["head_dim"]], causal, gqa, [TARGET["dtype"]], TARGET["tokens"], TARGET["nheads"]
    )


def memory_shapes(seqlens=MEMORY_SEQLENS) -> list:
    """The peak-memory shapes: batch 1 at each of ``seqlens`` (32k and 64k), bf16, head dim 128,
    16 heads, causal and not."""
    return [
        Shape(1, seqlen, seqlen, TARGET["nheads"], TARGET["nheads"], TARGET["head_dim"], causal, TARGET["dtype"])
        for seqlen in seqlens
        for causal in (False, True)
    ]


def build_plan(
    python: str = sys.executable,
    test_tree: Optional[Path] = None,
    tune_first: bool = False,
    budgets: Optional[dict] = None,
) -> list:
    """The campaign's steps in the order they run (``env`` first); ``budgets`` overrides
    ``BUDGETS_S`` per step name. ``warmup`` compiles for every step of WARMUP_FOR in the plan
    (``select`` and ``fit`` narrow it to those that run)."""
    given = dict(budgets or {})
    budgets = {**BUDGETS_S, **given}
    env, tune = _env_step(python, budgets), _tune_step(python, budgets)
    tests = _tests_step(python, budgets, test_tree)
    built = {
        step.name: step
        for step in (
            _warmup_step(python, budgets, "warmup" in given, test_tree if tests.skip is None else None),
            _check_step(python, budgets),
            _shootout_step(python, budgets),
            _bench_step(python, budgets),
            _host_step(python, budgets),
            _decode_step(python, budgets),
            _memory_step(python, budgets),
            _capture_step(python, budgets),
            _verify_step(python, budgets),
            tests,
        )
    }
    steps = [built[name] for name in STEP_NAMES if name != "tune"]  # the order of value, written once
    return [env, tune, *steps] if tune_first else [env, *steps, tune]


def _joined(values) -> str:
    return ",".join(str(v) for v in values)


def _env_step(python: str, budgets: dict) -> Step:
    """The ``env`` step."""
    return Step(
        "env",
        "device, driver and versions",
        [python, "-m", "devtools.campaign", "--step", "env", "--result", "{scratch}/env.json"],
        budgets["env"],
        result="env.json",
    )


def _verify_step(python: str, budgets: dict) -> Step:
    """The ``verify`` step."""
    return Step(
        "verify",
        "flash-recipe verify, every backend against the reference, KV-cache path included",
        [python, "-m", "flash_recipe", "verify", "--json", "--kvcache", "--grid", "full"]
        + [arg for dtype in VERIFY_DTYPES for arg in ("--dtype", dtype)],
        budgets["verify"],
        params={"dtypes": list(VERIFY_DTYPES), "kvcache": True, "grid": "full"},
        result="verify.json",
        stdout_is_result=True,
    )


def _bench_step(python: str, budgets: dict) -> Step:
    """The ``bench`` step."""
    return Step(
        "bench",
        "flash-recipe bench at the target shapes, with peers side by side",
        [
            python, "-m", "flash_recipe", "bench",
            "--seqlen", _joined(TARGET["seqlens"]), "--head-dim", str(TARGET["head_dim"]),
            "--dtype", TARGET["dtype"], "--causal", "both", "--gqa", "no",
            "--nheads", str(TARGET["nheads"]), "--tokens", str(TARGET["tokens"]),
            "--mode", _joined(BENCH_MODES), "--warmup", str(BENCH_WARMUP), "--reps", str(BENCH_REPS),
        ]
        + [arg for peer in BENCH_PEERS for arg in ("--peer", peer)]
        + ["--json", "{scratch}/bench.json"],
        budgets["bench"],
        params={
            "shapes": [shape.id for shape in bench_shapes()],
            "peers": list(BENCH_PEERS),
            "modes": list(BENCH_MODES),
            "warmup": BENCH_WARMUP,
            "reps": BENCH_REPS,
        },
        result="bench.json",
    )  # fmt: skip


def _memory_step(python: str, budgets: dict) -> Step:
    """The ``memory`` step."""
    return Step(
        "memory",
        "peak memory of a training step at 32k and 64k",
        [
            python, "-m", "devtools.campaign", "--step", "memory", "--result", "{scratch}/memory.json",
            "--seqlen", _joined(MEMORY_SEQLENS),
        ]
        + [arg for peer in MEMORY_PEERS for arg in ("--peer", peer)],
        budgets["memory"],
        params={
            "shapes": [shape.id for shape in memory_shapes()], "peers": list(MEMORY_PEERS), "modes": ["fwd", "fwd_bwd"]
        },
        result="memory.json",
    )  # fmt: skip


def _decode_step(python: str, budgets: dict) -> Step:
    """The ``decode`` step."""
    return Step(
        "decode",
        "decoding: KV-cache bandwidth of one step, Llama-3-8B's shape, with SDPA beside it",
        [python, "-m", "flash_recipe.tools.bench_decode", "--batch", _joined(DECODE_BATCHES)]
        + ["--cache", _joined(DECODE_CACHES), "--cuda-graph", "--json", "{scratch}/decode.json"],
        budgets["decode"],
        params={"batches": list(DECODE_BATCHES), "caches": list(DECODE_CACHES), "shape": "H32-Hk8-D128-bfloat16"},
        result="decode.json",
    )


def _tune_step(python: str, budgets: dict) -> Step:
    """The ``tune`` step."""
    return Step(
        "tune",
        "flash-recipe tune: the forward and decoding, head dims 64 and 128, bf16",
        [python, "-m", "flash_recipe", "tune", "--head-dim", _joined(TUNE_HEAD_DIMS), "--dtype", "bfloat16"]
        + ["--kernel", _joined(TUNE_KERNELS), "--jobs", str(TUNE_JOBS)]
        + ["--seqlen", str(TUNE_SEQLEN), "--json", "{scratch}/tune.json"]
        + ["--seconds", str(max(1, budgets["tune"] - TUNE_MARGIN_S))],
        budgets["tune"],
        params={
            "head_dims": list(TUNE_HEAD_DIMS),
            "kernels": list(TUNE_KERNELS),
            "dtype": "bfloat16",
            "seqlen": TUNE_SEQLEN,
        },
        result="tune.json",
    )


def _shootout_step(python: str, budgets: dict) -> Step:
    """The ``shootout`` step."""
    return Step(
        "shootout",
        "the backward's shoot-out: each path with at most 4 configurations per kernel, bf16, head dims 128 "
        "and 64, writing the measured defaults for this GPU model",
        [python, "-m", "flash_recipe", "tune", "--head-dim", _joined(SHOOTOUT_HEAD_DIMS), "--dtype", "bfloat16"]
        + ["--kernel", _joined(SHOOTOUT_KERNELS), "--seqlen", _joined(SHOOTOUT_SEQLENS), "--causal", "both"]
        + ["--tokens", str(TARGET["tokens"]), "--nheads", str(TARGET["nheads"])]
        + ["--max-candidates", str(SHOOTOUT_CANDIDATES), "--jobs", str(TUNE_JOBS), "--json", "{scratch}/shootout.json"]
        + ["--seconds", str(max(1, budgets["shootout"] - TUNE_MARGIN_S))],
        budgets["shootout"],
        params={
            "kernels": list(SHOOTOUT_KERNELS),
            "head_dims": list(SHOOTOUT_HEAD_DIMS),
            "seqlens": list(SHOOTOUT_SEQLENS),
            "candidates": SHOOTOUT_CANDIDATES,
            "dtype": "bfloat16",
        },
        result="shootout.json",
        env={"FLASH_RECIPE_TUNE_CACHE": "{scratch}/measured"},  # its file, apart from every other step's
    )


def _host_step(python: str, budgets: dict) -> Step:
    """The ``host`` step."""
    return Step(
        "host",
        "host cost per call: Python calls and microseconds, launches stubbed and real, beside torch SDPA",
        [python, "-m", "devtools.campaign", "--step", "host", "--result", "{scratch}/host.json"],
        budgets["host"],
        params={"cases": list(HOST_CASES)},
        result="host.json",
    )


def _capture_step(python: str, budgets: dict) -> Step:
    """The ``capture`` step."""
    return Step(
        "capture",
        "CUDA-graph capture: kvcache (dense, paged), varlen, forward, forward + backward, reduce-overhead",
        [python, "-m", "devtools.capture_check", "--json", "{scratch}/capture.json"],
        budgets["capture"],
        params={"checks": list(CAPTURE_CHECKS)},
        result="capture.json",
    )


def _check_step(python: str, budgets: dict) -> Step:
    """The ``check`` step."""
    return Step(
        "check",
        "correctness on the GPU: forward and dq/dk/dv against fp32 math by the accuracy rule, bf16 and fp16, "
        "then a seeded fuzz",
        [python, "-m", "devtools.gpu_check", "--json", "{scratch}/check.json"]
        + ["--seconds", str(max(budgets["check"] - CHECK_MARGIN_S, 1))],
        budgets["check"],
        params={
            "cases": len(gpu_check.GPU_TABLE),
            "dtypes": list(gpu_check.GPU_DTYPES),
            "covers": sorted({f for case in gpu_check.GPU_TABLE for f in case.features}, key=gpu_check.feature_order),
            "fuzz": "dense and varlen cases in the table's variants, seed 0, until the time bound",
        },
        result="check.json",
    )


def _tests_step(python: str, budgets: dict, test_tree: Optional[Path]) -> Step:
    """The ``tests`` step: the checkout's GPU test files, skipped without a test tree."""
    if test_tree is None:
        return Step(
            "tests",
            "the GPU tests (pytest)",
            [],
            budgets["tests"],
            skip="no test tree: no tests/ folder next to the flash_recipe package (an installed wheel)",
        )
    files = [str(test_tree / name) for name in GPU_TEST_FILES if (test_tree / name).is_file()]
    config = test_tree.parent / "pyproject.toml"
    argv = [python, "-m", "pytest", *files, "-q", "-rfE", "-p", "no:cacheprovider"]
    argv += ["--junitxml", "{scratch}/junit.xml", "--rootdir", str(test_tree.parent)]
    argv += ["-c", str(config)] if config.is_file() else []
    return Step(
        "tests",
        "the GPU tests (pytest)",
        argv,
        budgets["tests"],
        params={"files": [Path(f).name for f in files]},
        result="junit.xml",
        cwd=str(test_tree.parent),
    )


def _warmup_step(python: str, budgets: dict, budget_given: bool, test_tree: Optional[Path]) -> Step:
    """The ``warmup`` step, compiling for the steps of ``WARMUP_FOR`` (the tests' only with a
    ``test_tree`` they run from)."""
    names = [name for name in WARMUP_FOR if name != "tests" or test_tree is not None]
    warm = Step(
        "warmup",
        "compile ahead, in parallel, the kernel variants of the steps after it (first-call seconds per family)",
        [python, "-m", "devtools.warmup", "--jobs", str(warmup_jobs()), "--for", ""]
        + (["--tests", str(test_tree)] if test_tree is not None else [])
        + ["--json", "{scratch}/warmup.json"],
        budgets["warmup"],
        params={"jobs": warmup_jobs(), "budget": "given" if budget_given else ""},
        result="warmup.json",
    )
    return with_warmup_for(warm, names)


def select(plan: list, only: Optional[list] = None, skip: Optional[list] = None) -> list:
    """The plan with only the named steps (``env`` always stays; ``warmup`` stays with any step it
    compiles for, unless skipped by name); raises ValueError on unknown names."""
    for option, names in (("--only", only), ("--skip", skip)):
        unknown = [name for name in names or [] if name not in STEP_NAMES]
        if unknown:
            raise ValueError(f"{option} takes step names from {', '.join(STEP_NAMES)}; got {', '.join(unknown)}")
    if only and any(name in WARMUP_FOR for name in only):
        only = [*only, "warmup"]
    chosen = [
        step
        for step in plan
        if step.name == "env" or ((not only or step.name in only) and (not skip or step.name not in skip))
    ]
    return chosen


def fit(plan: list, minutes: float) -> list:
    """The plan with the steps that do not fit in ``minutes`` marked as skipped, saying so.

    In the plan's order (the order of value), a step runs if its budget fits in what is left of
    ``minutes`` after the steps before it and ``RESERVE_S``; one that does not is skipped, and a
    later, shorter one may still fit. ``env`` always runs. A step ``warmup`` compiles for also needs
    its share of warmup's budget (``warmup_share``, unless warmup's budget was given): warmup counts
    WARMUP_START_S where it stands and ends up compiling for the steps that fit, with the budget
    their shares add up to; with none of them left it is skipped."""
    left = minutes * 60 - RESERVE_S
    warm = next((step for step in plan if step.name == "warmup" and not step.skip), None)
    sized = warm is not None and warm.params["budget"] != "given"
    compiled = warm.params.get("for", []) if warm is not None else []
    fitted, warmed = [], []
    for step in plan:
        share = warmup_share(step.name) if sized and step.name in compiled else 0
        need = (WARMUP_START_S if sized else step.budget_s) if step is warm else step.budget_s + share
        if step.skip or step.name == "env" or need <= left:
            left -= 0 if step.skip else need
            fitted.append(step)
            if not step.skip and step.name in compiled:
                warmed.append(step.name)
            continue
        extra = f", {share} s of them compiling ahead in warmup" if share else ""
        why = (
            f"does not fit in --minutes {minutes:g} ({need} s needed{extra}, {max(left, 0):.0f} s left after the "
            f"steps before it); a larger --minutes, or --only {step.name}, runs it"
        )
        fitted.append(dataclasses.replace(step, skip=why))
    if warm is None:
        return fitted
    index = next(i for i, step in enumerate(fitted) if step.name == "warmup")
    if not warmed:
        fitted[index] = dataclasses.replace(warm, skip="none of the steps it compiles for runs")
    elif not fitted[index].skip:
        fitted[index] = with_warmup_for(warm, warmed)
    return fitted


def format_plan(plan: list, minutes: Optional[float] = None) -> str:
    """The plan as text: one line per step with its budget, then its command and what it covers."""
    total = sum(step.budget_s for step in plan if not step.skip)
    lines = [f"{'step':<8} {'budget':>7}  what"]
    for step in plan:
        lines.append(f"{step.name:<8} {step.budget_s:>5} s  {step.title}")
        if step.skip:
            lines.append(f"{'':<18}not run: {step.skip}")
        else:
            lines.append(f"{'':<18}$ {shlex.join(step.argv)}")
        for key, value in step.params.items():
            text = ", ".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
            lines.append(f"{'':<18}{key}: {text}")
    limit = TOTAL_BUDGET_S if minutes is None else minutes * 60
    over = total + RESERVE_S > limit
    skipped = [step.name for step in plan if step.skip]
    lines.append(
        f"total budget {total} s ({total / 60:.1f} min) + {RESERVE_S} s reserve, "
        f"{'OVER' if over else 'within'} {limit:.0f} s ({limit / 60:g} min); "
        + (f"not run: {', '.join(skipped)}; " if skipped else "")
        + "{scratch} is a temporary folder removed at the end"
    )
    lines.append(
        f"targets: {SUBJECT} vs {REFERENCE} in this run: forward >= {SPEED_TARGETS['fwd']}x and backward >= "
        f"{SPEED_TARGETS['bwd']}x TFLOP/s at each target shape; peak memory <= {MEMORY_RATIO}x at "
        f"{' and '.join(str(s) for s in MEMORY_SEQLENS)}, growing at most {LINEAR_SLACK} x linearly; decoding "
        f"replayed from a CUDA graph >= SDPA's replay at every row and, from a {DECODE_LONG}-row cache, >= "
        f"{DECODE_REPLAY_OF_COPY[True]:.0%} of the copy bandwidth at batch >= {DECODE_WIDE} "
        f"({DECODE_REPLAY_OF_COPY[False]:.0%} below), called from Python >= {DECODE_EAGER_RATIO}x SDPA there"
    )
    return "\n".join(lines)
