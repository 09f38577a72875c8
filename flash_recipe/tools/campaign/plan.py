"""The campaign's plan: its budgets, targets and shapes, and the steps it runs (``Step``,
``build_plan``)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

# The whole plan, with every step, fits in TOTAL_BUDGET_S; a run fits what it can in ``--minutes``
# (DEFAULT_MINUTES unless asked: ``fit``), in the order of the plan, which is the order of value.
TOTAL_BUDGET_S = 20 * 60
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
# (``flash_recipe.tools.capture_check``).
HOST_CASES = ("fwd", "fwd_autograd", "kvcache")
CAPTURE_CHECKS = ("kvcache", "kvcache_paged", "varlen", "fwd", "fwd_bwd", "compile")

# The steps in the order of value: the decoding path (host cost, capture), correctness, training
# speed, decoding speed, memory, the GPU tests, tuning.
STEP_NAMES = ("host", "capture", "verify", "bench", "decode", "memory", "tests", "tune")
# Seconds per step (``--budget STEP=SECONDS`` changes one). Measured on one H200 on 2026-11-27:
# env 10 s, bench 132 s, memory 17 s, decode 16 s (eager only; the CUDA-graph replay about doubles
# it), verify (bf16, full and KV grids) unfinished after 90 s of compiling; on an H100 on
# 2026-11-25 bench took 189 s and memory 33 s. host and capture are planned, not yet measured: host
# times 3 cases 2 ways with SDPA beside, capture compiles 6 small variants.
BUDGETS_S = {
    "env": 20, "host": 30, "capture": 60, "verify": 120, "bench": 190, "decode": 60, "memory": 35, "tests": 210,
    "tune": 270,
}  # fmt: skip

OUTPUT_FILES = ("campaign.md", "campaign.json", "campaign.log", "bench-fwd.png", "bench-bwd.png")


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Step:
    """One step of the campaign: a command run in its own subprocess within ``budget_s`` seconds.

    ``argv`` may contain ``{scratch}`` (the campaign's temporary folder). ``result`` names the
    file under the scratch where the step leaves its JSON result; with ``stdout_is_result`` the
    step's standard output is that file (its standard error goes to the log). ``cwd`` None runs
    it in the scratch. ``skip`` is why a planned step does not run. ``params`` describe what it
    covers, for the plan and the report.
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

    def command(self, scratch: str = "{scratch}") -> list:
        return [arg.replace("{scratch}", scratch) for arg in self.argv]

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "title": self.title,
            "command": shlex.join(self.argv),
            "budget_s": self.budget_s,
            "params": self.params,
            "cwd": self.cwd,
            "skip": self.skip,
        }


def package_root() -> Path:
    """The folder flash_recipe was imported from (its parent): a checkout or site-packages."""
    import flash_recipe

    return Path(flash_recipe.__file__).resolve().parent.parent


def find_test_tree(root: Optional[Path] = None) -> Optional[Path]:
    """The checkout's ``tests/`` folder next to the package, if it holds any GPU test file."""
    tests = (root or package_root()) / "tests"
    if tests.is_dir() and any((tests / name).is_file() for name in GPU_TEST_FILES):
        return tests
    return None


def bench_shapes() -> list:
    """The target shapes, as ``flash-recipe bench`` builds them from the bench step's options."""
    from flash_recipe.tools import bench

    causal, gqa = [False, True], [False]
    return bench.shapes(
        TARGET["seqlens"], [TARGET["head_dim"]], causal, gqa, [TARGET["dtype"]], TARGET["tokens"], TARGET["nheads"]
    )


def memory_shapes(seqlens=MEMORY_SEQLENS) -> list:
    """The peak-memory shapes: batch 1 at each of ``seqlens`` (32k and 64k), bf16, head dim 128,
    16 heads, causal and not."""
    from flash_recipe.tools.bench import Shape

    return [
        Shape(1, seqlen, TARGET["nheads"], TARGET["nheads"], TARGET["head_dim"], causal, TARGET["dtype"])
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
    ``BUDGETS_S`` per step name."""
    budgets = {**BUDGETS_S, **(budgets or {})}
    joined = lambda values: ",".join(str(v) for v in values)  # noqa: E731
    env = Step(
        "env",
        "device, driver and versions",
        [python, "-m", "flash_recipe.tools.campaign", "--step", "env", "--result", "{scratch}/env.json"],
        budgets["env"],
        result="env.json",
    )
    verify = Step(
        "verify",
        "flash-recipe verify, every backend against the reference, KV-cache path included",
        [python, "-m", "flash_recipe", "verify", "--json", "--kvcache", "--grid", "full"]
        + [arg for dtype in VERIFY_DTYPES for arg in ("--dtype", dtype)],
        budgets["verify"],
        params={"dtypes": list(VERIFY_DTYPES), "kvcache": True, "grid": "full"},
        result="verify.json",
        stdout_is_result=True,
    )
    bench = Step(
        "bench",
        "flash-recipe bench at the target shapes, with peers side by side",
        [
            python, "-m", "flash_recipe", "bench",
            "--seqlen", joined(TARGET["seqlens"]), "--head-dim", str(TARGET["head_dim"]),
            "--dtype", TARGET["dtype"], "--causal", "both", "--gqa", "no",
            "--nheads", str(TARGET["nheads"]), "--tokens", str(TARGET["tokens"]),
            "--mode", joined(BENCH_MODES), "--warmup", str(BENCH_WARMUP), "--reps", str(BENCH_REPS),
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
    memory = Step(
        "memory",
        "peak memory of a training step at 32k and 64k",
        [
            python, "-m", "flash_recipe.tools.campaign", "--step", "memory", "--result", "{scratch}/memory.json",
            "--seqlen", joined(MEMORY_SEQLENS),
        ]
        + [arg for peer in MEMORY_PEERS for arg in ("--peer", peer)],
        budgets["memory"],
        params={
            "shapes": [shape.id for shape in memory_shapes()], "peers": list(MEMORY_PEERS), "modes": ["fwd", "fwd_bwd"]
        },
        result="memory.json",
    )  # fmt: skip
    decode = Step(
        "decode",
        "decoding: KV-cache bandwidth of one step, Llama-3-8B's shape, with SDPA beside it",
        [python, "-m", "flash_recipe.tools.bench_decode", "--batch", joined(DECODE_BATCHES)]
        + ["--cache", joined(DECODE_CACHES), "--cuda-graph", "--json", "{scratch}/decode.json"],
        budgets["decode"],
        params={"batches": list(DECODE_BATCHES), "caches": list(DECODE_CACHES), "shape": "H32-Hk8-D128-bfloat16"},
        result="decode.json",
    )
    if test_tree is not None:
        files = [str(test_tree / name) for name in GPU_TEST_FILES if (test_tree / name).is_file()]
        config = test_tree.parent / "pyproject.toml"
        argv = [python, "-m", "pytest", *files, "-q", "-rfE", "-p", "no:cacheprovider"]
        argv += ["--junitxml", "{scratch}/junit.xml", "--rootdir", str(test_tree.parent)]
        argv += ["-c", str(config)] if config.is_file() else []
        tests = Step(
            "tests",
            "the GPU tests (pytest)",
            argv,
            budgets["tests"],
            params={"files": [Path(f).name for f in files]},
            result="junit.xml",
            cwd=str(test_tree.parent),
        )
    else:
        tests = Step(
            "tests",
            "the GPU tests (pytest)",
            [],
            budgets["tests"],
            skip="no test tree: no tests/ folder next to the flash_recipe package (an installed wheel)",
        )
    tune = Step(
        "tune",
        "flash-recipe tune: the forward and decoding, head dims 64 and 128, bf16",
        [python, "-m", "flash_recipe", "tune", "--head-dim", joined(TUNE_HEAD_DIMS), "--dtype", "bfloat16"]
        + ["--kernel", joined(TUNE_KERNELS), "--jobs", str(TUNE_JOBS)]
        + ["--seqlen", str(TUNE_SEQLEN), "--json", "{scratch}/tune.json"],
        budgets["tune"],
        params={
            "head_dims": list(TUNE_HEAD_DIMS),
            "kernels": list(TUNE_KERNELS),
            "dtype": "bfloat16",
            "seqlen": TUNE_SEQLEN,
        },
        result="tune.json",
    )
    host = Step(
        "host",
        "host cost per call: Python calls and microseconds, launches stubbed and real, beside torch SDPA",
        [python, "-m", "flash_recipe.tools.campaign", "--step", "host", "--result", "{scratch}/host.json"],
        budgets["host"],
        params={"cases": list(HOST_CASES)},
        result="host.json",
    )
    capture = Step(
        "capture",
        "CUDA-graph capture: kvcache (dense, paged), varlen, forward, forward + backward, reduce-overhead",
        [python, "-m", "flash_recipe.tools.capture_check", "--json", "{scratch}/capture.json"],
        budgets["capture"],
        params={"checks": list(CAPTURE_CHECKS)},
        result="capture.json",
    )
    steps = [host, capture, verify, bench, decode, memory, tests]
    return [env, tune, *steps] if tune_first else [env, *steps, tune]


def select(plan: list, only: Optional[list] = None, skip: Optional[list] = None) -> list:
    """The plan with only the named steps (``env`` always stays); raises ValueError on unknown names."""
    for option, names in (("--only", only), ("--skip", skip)):
        unknown = [name for name in names or [] if name not in STEP_NAMES]
        if unknown:
            raise ValueError(f"{option} takes step names from {', '.join(STEP_NAMES)}; got {', '.join(unknown)}")
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
    later, shorter one may still fit. ``env`` always runs."""
    left = minutes * 60 - RESERVE_S
    fitted = []
    for step in plan:
        if step.skip or step.name == "env" or step.budget_s <= left:
            left -= 0 if step.skip else step.budget_s
            fitted.append(step)
            continue
        why = (
            f"does not fit in --minutes {minutes:g} ({step.budget_s} s needed, {max(left, 0):.0f} s left after the "
            f"steps before it); a larger --minutes, or --only {step.name}, runs it"
        )
        fitted.append(dataclasses.replace(step, skip=why))
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
