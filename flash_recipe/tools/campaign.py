"""A GPU campaign in one command: ``python -m flash_recipe.tools.campaign --out DIR``.

On a CUDA machine with whatever torch and Triton are installed, it runs these steps, each in its
own subprocess with its own time budget; the budgets add up to less than 20 minutes for one H100
(they are planned, not yet calibrated on a GPU: ``--budget STEP=SECONDS`` changes one):

=======  ===========================================================================================
env      the device, its memory, torch/CUDA/Triton/flash_recipe versions, the backend chosen for the
         target shape, the bench peers this machine has
verify   ``flash-recipe verify --kvcache --grid full`` in fp16, bf16 and fp32: every backend against
         the reference, ``flash_attn_with_kvcache`` included
bench    ``flash-recipe bench`` at the target shapes (bf16, head dim 128, 16 heads, seqlen 4k, 8k and
         16k at 16k tokens each, causal and not), forward, backward and both, with its peers side by
         side: SDPA flash, cuDNN and efficient, compiled FlexAttention, and flash_recipe with TMA
         descriptors off (a peer this machine lacks is left out and named in the report)
memory   peak memory of one training step (forward; forward and backward) of flash_recipe and SDPA
         flash at seqlen 32k and 64k, above its inputs (``bench.peak_memory``)
tests    pytest on the checkout's GPU-relevant test files, when a ``tests/`` folder lies next to the
         package (else recorded as skipped: an installed wheel has none)
tune     ``flash-recipe tune --head-dim 64,128 --dtype bfloat16 --kernel fwd,decode``, its ``--json``
         report kept
=======  ===========================================================================================

A step that fails, crashes, hangs or outlives its budget is recorded as such (a step over budget
has its whole process group stopped; what a finished step leaves running is stopped too) and the
campaign goes on. The targets are then judged from this run's measurements, flash_recipe against
SDPA's flash backend measured side by side in the same process:

- forward at least 1.25x SDPA flash's TFLOP/s at each target shape, causal and not;
- backward at least 1.1x;
- peak memory at most 1.05x SDPA flash's at 32k and 64k, forward and forward + backward;
- peak memory linear in the sequence length: from 32k to 64k it grows at most 1.1 x 2.

Each is reported per shape with both values, the ratio and PASS or MISS; a shape either side did
not measure is a MISS that says why.

Output, kept to a few files in one folder, so that it is easy to carry off a machine whole:
``campaign.md``
(the report), ``campaign.json`` (everything, machine readable), ``campaign.log`` (every step's
command and full output, in order), ``bench-fwd.png`` and ``bench-bwd.png`` (TFLOP/s against
sequence length per peer; they need matplotlib) and the tuned-configuration file ``tune`` wrote,
if any (``*.tune.json``, one per GPU model; ``FLASH_RECIPE_TUNE_CACHE=DIR`` makes flash_recipe
use it): six at most. ``campaign.md`` and ``campaign.json`` are rewritten after every step, so a campaign that is
itself interrupted still leaves its report. Step results travel through a temporary folder,
``{scratch}`` in the commands, removed at the end.

Every step runs with ``FLASH_RECIPE_TUNE_CACHE`` pointing to an empty folder of the scratch, so
the measurements use the configurations flash_recipe ships, never a tuned file left on the
machine; ``tune`` runs last and writes there (``--tune-first`` runs it first, so that verify,
bench, memory and tests use what it found). ``TRITON_INTERPRET`` and ``FLASH_RECIPE_BACKEND`` are
removed from the steps' environment, and the folder flash_recipe was imported from is put first
on their ``PYTHONPATH``, so every step runs this same flash_recipe.

``--dry-run`` prints and writes the plan (steps, commands, budgets, shapes) and runs nothing; it
works without a GPU. Without it, a machine with no CUDA device is refused (exit status 2).
``--only bench,memory`` and ``--skip tests`` choose steps (``env`` always runs).

Exit status: 0 when every step that ran passed (the targets are findings in the report, PASS or
MISS, not an exit status); 1 when a step failed or ran out of time; 2 for a usage error or no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable, Optional

TOTAL_BUDGET_S = 20 * 60
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
VERIFY_DTYPES = ("float16", "bfloat16", "float32")
# Test files that exercise the kernels on the GPU when one is present (the device fixture).
GPU_TEST_FILES = (
    "test_gpu.py",
    "test_kernels.py",
    "test_kvcache.py",
    "test_varlen.py",
    "test_dropout.py",
    "test_torch_compile.py",
)

SPEED_TARGETS = {"fwd": 1.25, "bwd": 1.1}  # flash_recipe TFLOP/s over SDPA flash's, at least
MEMORY_RATIO = 1.05  # flash_recipe peak memory over SDPA flash's, at most
LINEAR_SLACK = 1.1  # peak growth at most this times the sequence-length growth

STEP_NAMES = ("verify", "bench", "memory", "tests", "tune")
# Seconds per step, planned for one H100 (``--budget STEP=SECONDS`` changes one).
BUDGETS_S = {"env": 30, "verify": 240, "bench": 300, "memory": 90, "tests": 210, "tune": 270}

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
    steps = [verify, bench, memory, tests]
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


def format_plan(plan: list) -> str:
    """The plan as text: one line per step with its budget, then its command and what it covers."""
    total = sum(step.budget_s for step in plan)
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
    over = total + RESERVE_S > TOTAL_BUDGET_S
    lines.append(
        f"total budget {total} s ({total / 60:.1f} min) + {RESERVE_S} s reserve, "
        f"{'OVER' if over else 'within'} {TOTAL_BUDGET_S} s ({TOTAL_BUDGET_S // 60} min); "
        "{scratch} is a temporary folder removed at the end"
    )
    lines.append(
        f"targets: {SUBJECT} vs {REFERENCE} in this run: forward >= {SPEED_TARGETS['fwd']}x and backward >= "
        f"{SPEED_TARGETS['bwd']}x TFLOP/s at each target shape; peak memory <= {MEMORY_RATIO}x at "
        f"{' and '.join(str(s) for s in MEMORY_SEQLENS)}, growing at most {LINEAR_SLACK} x linearly"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running steps


def step_environment(scratch: Path) -> dict:
    """The environment every step runs with (see the module docstring)."""
    env = dict(os.environ)
    for name in ("TRITON_INTERPRET", "FLASH_RECIPE_BACKEND"):
        env.pop(name, None)
    root = str(package_root())
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    tune_cache = scratch / "tune-cache"
    tune_cache.mkdir(exist_ok=True)
    env["FLASH_RECIPE_TUNE_CACHE"] = str(tune_cache)
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop the step's whole process group: SIGTERM, then SIGKILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _stop_strays(proc: subprocess.Popen) -> None:
    """Kill what a finished step left running in its process group (workers holding the GPU)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_step(step: Step, scratch: Path, log, env: dict) -> dict:
    """Run one step; its output goes to ``log`` (a binary file) as it comes. Never raises for the
    step's own failures: returns ``{name, status, seconds, returncode, command, detail}`` with
    status ``passed``, ``failed``, ``timeout`` or ``error`` (it could not start)."""
    command = step.command(str(scratch))
    record = {"name": step.name, "budget_s": step.budget_s, "command": shlex.join(command), "returncode": None}
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    log.write(
        f"\n===== {step.name}: {step.title} ({stamp}, budget {step.budget_s} s)\n$ {record['command']}\n".encode()
    )
    log.flush()
    start = log.tell()
    begin = time.monotonic()
    # Closed below, once the step has ended (the process writes to it until then).
    stdout = open(scratch / step.result, "wb") if step.stdout_is_result else log  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            command,
            cwd=step.cwd or str(scratch),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=log,
            start_new_session=True,  # its own process group, so a timeout stops its children too
        )
    except OSError as exc:
        record.update(status="error", seconds=0.0, detail=f"could not start: {exc}")
    else:
        try:
            record["returncode"] = proc.wait(timeout=step.budget_s)
            record["status"] = "passed" if record["returncode"] == 0 else "failed"
            record["detail"] = f"exit status {record['returncode']}"
            _stop_strays(proc)
        except subprocess.TimeoutExpired:
            _stop(proc)
            record["returncode"] = proc.returncode
            record.update(status="timeout", detail=f"stopped after its budget of {step.budget_s} s")
        except BaseException:  # Ctrl-C: stop the step too, then let the campaign end
            _stop(proc)
            raise
        record["seconds"] = round(time.monotonic() - begin, 1)
    finally:
        if stdout is not log:
            stdout.close()
    log.flush()
    record["output_tail"] = _tail(log.name, start, 30)
    log.write(f"===== {step.name}: {record['status']} in {record['seconds']} s ({record['detail']})\n".encode())
    log.flush()
    return record


def _tail(path: str, start: int, lines: int) -> str:
    """The last ``lines`` lines a step wrote to the log (from byte ``start``)."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


# ----------------------------------------------------------------------------- the workers


def _write_json(path: str, document) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(document, f, indent=1)
    os.replace(partial, path)


def env_probe() -> dict:
    """The device and the software: what the report's header says."""
    import platform

    import torch

    import flash_recipe
    from flash_recipe.tools import bench
    from flash_recipe.tools.verify import versions

    info = {"cuda": torch.cuda.is_available(), "versions": versions(), "platform": platform.platform()}
    info["variables"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FLASH_RECIPE_", "TRITON_"))}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            device_count=torch.cuda.device_count(),
        )
        q = torch.zeros(
            1, 128, TARGET["nheads"], TARGET["head_dim"], device="cuda", dtype=getattr(torch, TARGET["dtype"])
        )
        reasons = flash_recipe.explain(q, q, q, causal=True)
        info["backends_for_target"] = reasons
        info["chosen_backend"] = next((name for name, why in reasons.items() if why is None), None)
        info["bench_peers"] = list(bench.peers("cuda"))
    return info


def memory_rows(seqlens, peers, result: Optional[str] = None, progress=print) -> list:
    """Peak memory (``bench.peak_memory``) of each peer, forward and forward + backward, at each
    sequence length, causal and not; rows written to ``result`` after each one."""
    import torch

    from flash_recipe.tools import bench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = bench.peers(device.type)
    rows = []
    for shape in memory_shapes(seqlens):
        for mode in bench.MEMORY_MODES:
            for name in peers:
                row = {"shape": shape.id, "peer": name, **dataclasses.asdict(shape)}
                try:
                    if name not in available:
                        raise ValueError(f"peer {name!r} is not available on {device.type}")
                    row.update(bench.peak_memory(available[name], shape, device, mode))
                except Exception as exc:  # reported, not fatal (out of memory included)
                    row.update(
                        mode=mode, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                text = row.get("error") or f"peak {row['peak_mb']:.1f} MiB above {row['before_mb']:.1f} MiB"
                progress(f"{shape.id:<44} {mode:<8} {name:<14} {text}")
                if result:
                    _write_json(result, rows)
    return rows


def worker_parser() -> argparse.ArgumentParser:
    """Options of ``--step env|memory``: the in-process part of a step, run in its subprocess."""
    parser = argparse.ArgumentParser(prog="python -m flash_recipe.tools.campaign --step")
    parser.add_argument("--step", choices=("env", "memory"), required=True)
    parser.add_argument("--result", required=True, help="write the step's JSON result here")
    parser.add_argument(
        "--seqlen", type=lambda text: [int(x) for x in text.split(",") if x], default=list(MEMORY_SEQLENS)
    )
    parser.add_argument("--peer", action="append", help="peer to measure (repeatable)")
    return parser


def _worker(argv: list) -> int:
    args = worker_parser().parse_args(argv)
    if args.step == "env":
        info = env_probe()
        _write_json(args.result, info)
        print(json.dumps(info, indent=1))
        return 0
    rows = memory_rows(args.seqlen, args.peer or list(MEMORY_PEERS), args.result)
    _write_json(args.result, rows)
    return 0 if rows and all("error" not in row for row in rows) else 1


# ----------------------------------------------------------------------------- summaries (pure)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def speed_targets(rows: list, shape_ids: list, subject: str = SUBJECT, reference: str = REFERENCE) -> list:
    """One entry per target mode and expected shape: both peers' TFLOP/s from ``rows`` (bench rows
    of one run), their ratio, and PASS when it reaches ``SPEED_TARGETS[mode]``. A shape either peer
    did not measure is a MISS with the reason."""
    by_key = {(row["shape"], row["peer"]): row for row in rows}
    targets = []
    for mode, required in SPEED_TARGETS.items():
        for shape_id in shape_ids:
            entry: dict[str, Any] = {"target": f"{mode} speed", "mode": mode, "shape": shape_id, "required": required}
            values: dict[str, Any] = {}
            notes = []
            for role, peer in (("subject", subject), ("reference", reference)):
                row = by_key.get((shape_id, peer))
                value = None if row is None else row.get(f"{mode}_tflops")
                if value is None:
                    why = "not measured" if row is None else row.get("error", f"no {mode} measurement")
                    notes.append(f"{peer}: {why}")
                values[role] = value
            entry.update(subject=values["subject"], reference=values["reference"], unit="TFLOP/s")
            if notes:
                entry.update(ratio=None, verdict="MISS", note="; ".join(notes))
            else:
                entry["ratio"] = values["subject"] / values["reference"]
                entry["verdict"] = _verdict(entry["ratio"] >= required)
            targets.append(entry)
    return targets


def memory_targets(rows: list, subject: str = SUBJECT, reference: str = REFERENCE) -> list:
    """Peak-memory targets from memory rows: per (mode, causal, seqlen) the subject's peak over the
    reference's, PASS at most ``MEMORY_RATIO``; per (mode, causal) the subject's growth from the
    shortest to the longest sequence, PASS at most ``LINEAR_SLACK`` times the growth in length.
    The reference's own growth is given beside it."""
    peaks = {}
    for row in rows:
        if "error" not in row and "peak_mb" in row:
            peaks[(row["mode"], row["causal"], row["seqlen"], row["peer"])] = row["peak_mb"]
    errors = {
        (row.get("mode"), row["causal"], row["seqlen"], row["peer"]): row["error"] for row in rows if "error" in row
    }
    seqlens = sorted({row["seqlen"] for row in rows})
    groups = sorted({(row.get("mode"), row["causal"]) for row in rows if row.get("mode")}, key=str)
    targets = []

    def lookup(mode, causal, seqlen, peer):
        value = peaks.get((mode, causal, seqlen, peer))
        why = None if value is not None else errors.get((mode, causal, seqlen, peer), "not measured")
        return value, why

    for mode, causal in groups:
        mask = "causal" if causal else "full"
        for seqlen in seqlens:
            mine, why_mine = lookup(mode, causal, seqlen, subject)
            theirs, why_theirs = lookup(mode, causal, seqlen, reference)
            entry = {
                "target": f"{mode} peak memory",
                "mode": mode,
                "shape": f"S{seqlen}-{mask}",
                "subject": mine,
                "reference": theirs,
                "unit": "MiB",
                "required": MEMORY_RATIO,
            }
            if mine is None or theirs is None or theirs <= 0:
                notes = [f"{p}: {w}" for p, w in ((subject, why_mine), (reference, why_theirs)) if w]
                entry.update(ratio=None, verdict="MISS", note="; ".join(notes) or f"{reference} allocated nothing")
            else:
                entry.update(ratio=mine / theirs, verdict=_verdict(mine / theirs <= MEMORY_RATIO))
            targets.append(entry)
        if len(seqlens) >= 2:
            short, long = seqlens[0], seqlens[-1]
            allowed = LINEAR_SLACK * long / short
            growth = {}
            for peer in (subject, reference):
                a, b = peaks.get((mode, causal, short, peer)), peaks.get((mode, causal, long, peer))
                growth[peer] = b / a if a and b is not None else None
            entry = {
                "target": f"{mode} memory linear",
                "mode": mode,
                "shape": f"S{long}/S{short}-{mask}",
                "subject": growth[subject],
                "reference": growth[reference],
                "unit": "x",
                "required": allowed,
            }
            if growth[subject] is None:
                entry.update(ratio=None, verdict="MISS", note=f"{subject}: not measured at both lengths")
            else:
                entry.update(ratio=growth[subject], verdict=_verdict(growth[subject] <= allowed))
            targets.append(entry)
    return targets


def summarize_targets(targets: list) -> list:
    """One line per target kind (``fwd speed``, ``fwd_bwd peak memory``, ...): PASS when every
    shape passes, how many did, and the worst ratio (the least for speed, the most for memory)."""
    groups: dict = {}
    for t in targets:
        groups.setdefault(t["target"], []).append(t)
    summary = []
    for name, entries in groups.items():
        ratios = [t["ratio"] for t in entries if t.get("ratio") is not None]
        worst = (min(ratios) if name.endswith("speed") else max(ratios)) if ratios else None
        passed = sum(t["verdict"] == "PASS" for t in entries)
        summary.append(
            {
                "target": name,
                "verdict": _verdict(passed == len(entries)),
                "passed": passed,
                "count": len(entries),
                "worst_ratio": worst,
                "required": entries[0].get("required"),
            }
        )
    return summary


def memory_table(rows: list) -> list:
    """Per (mode, causal, peer): peak MiB at each sequence length and the growth longest/shortest."""
    seqlens = sorted({row["seqlen"] for row in rows})
    table: dict = {}
    for row in rows:
        key = (row.get("mode"), row["causal"], row["peer"])
        entry = table.setdefault(key, {"mode": key[0], "causal": key[1], "peer": key[2], "peak_mb": {}, "total_mb": {}})
        entry["peak_mb"][row["seqlen"]] = row.get("peak_mb")
        entry["total_mb"][row["seqlen"]] = row.get("total_mb")
    for entry in table.values():
        a, b = entry["peak_mb"].get(seqlens[0]), entry["peak_mb"].get(seqlens[-1])
        entry["growth"] = b / a if len(seqlens) > 1 and a and b is not None else None
    return sorted(table.values(), key=lambda e: (str(e["mode"]), e["causal"], e["peer"]))


def parse_junit(path: Path) -> dict:
    """Counts and failures from a pytest JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                problem = case.find(kind)
                if problem is not None:
                    message = (problem.get("message") or problem.text or "").strip().splitlines()
                    failures.append(
                        {
                            "test": f"{case.get('classname')}::{case.get('name')}",
                            "kind": kind,
                            "message": message[0][:200] if message else "",
                        }
                    )
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures}


def summarize_verify(report: dict) -> dict:
    """The verify report's verdict, counts per dtype and kind, and the rows that failed."""
    counts: dict = {}
    for row in report.get("cases", []):
        kind = "kvcache" if row["case"].startswith("kv-") else "attention"
        key = f"{kind}/{row['dtype']}"
        done = counts.setdefault(key, {"checks": 0, "passed": 0})
        done["checks"] += 1
        done["passed"] += bool(row["passed"])
    return {
        "passed": report.get("passed"),
        "fingerprint": report.get("fingerprint"),
        "backends": report.get("backends"),
        "skipped": report.get("skipped"),
        "device": report.get("device"),
        "counts": counts,
        "mismatches": [row for row in report.get("cases", []) if not row["passed"]],
    }


# ----------------------------------------------------------------------------- collecting results


def _load_json(text: str):
    """A step's JSON result; a standard output may carry a stray line printed before the document."""
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("\n{")
        if start < 0:
            raise
        return json.loads(text[start + 1 :])


def without_unavailable_peers(step: Step, available: list) -> tuple:
    """``step`` without the ``--peer NAME`` pairs of peers this machine does not have (the bench
    refuses an unknown peer outright), and the names dropped."""
    argv, dropped = [], []
    args = iter(step.argv)
    for arg in args:
        if arg == "--peer":
            name = next(args)
            if name in available:
                argv += [arg, name]
            else:
                dropped.append(name)
        else:
            argv.append(arg)
    return dataclasses.replace(step, argv=argv), dropped


def collect(step: Step, record: dict, scratch: Path, out: Path, log) -> dict:
    """Read what the step left in the scratch into ``record["data"]``; adjust status and detail."""
    path = scratch / step.result if step.result else None
    if step.name == "tests" and path is not None:
        if path.is_file():
            data = parse_junit(path)
            record["data"] = data
            record["detail"] = (
                f"{data['passed']} passed, {data['failures']} failed, {data['errors']} errors, "
                f"{data['skipped']} skipped ({record['detail']})"
            )
        return record
    if step.name == "tune":
        record["data"] = {"files": _copy_tune_files(scratch, out)}
        if path is not None and path.is_file() and path.stat().st_size:
            try:
                record["data"]["report"] = json.loads(path.read_text())
            except ValueError as exc:
                record["detail"] += f"; its --json report is not JSON ({exc})"
        if record["status"] != "passed":
            last = record["output_tail"].splitlines()[-1:] if record["output_tail"] else []
            record["detail"] += f": {last[0][:200]}" if last else ""
        return record
    if path is None:  # a step with no result of its own: its exit status says it all
        return record
    if not path.is_file() or path.stat().st_size == 0:
        if record["status"] == "passed":
            record.update(status="failed", detail=f"{record['detail']}, but it left no result")
        return record
    try:
        document = _load_json(path.read_text())
    except ValueError as exc:
        record.update(status="failed" if record["status"] == "passed" else record["status"])
        record["detail"] += f"; its result is not JSON ({exc})"
        return record
    if step.name == "verify":
        from flash_recipe.tools.verify import format_table

        log.write(("\n" + format_table(document) + "\n").encode())
        log.flush()
        summary = summarize_verify(document)
        record["data"] = {**summary, "cases": document.get("cases", []), "versions": document.get("versions")}
        checks = sum(c["checks"] for c in summary["counts"].values())
        verdict = "PASSED" if summary["passed"] else f"FAILED: {len(summary['mismatches'])} mismatches"
        record["detail"] = f"{verdict}, {checks} checks, fingerprint {str(summary['fingerprint'])[:12]}"
    elif step.name == "bench":
        rows = document.get("rows", [])
        bad = sum("error" in row for row in rows)
        record["data"] = document
        note = "" if document.get("complete") else ", incomplete"
        record["detail"] = f"{len(rows)} rows, {bad} with errors{note} ({record['detail']})"
    elif step.name == "memory":
        rows = document if isinstance(document, list) else []
        record["data"] = {"rows": rows}
        record["detail"] = f"{len(rows)} rows, {sum('error' in r for r in rows)} with errors ({record['detail']})"
    elif step.name == "env":
        record["data"] = document
        record["detail"] = f"{document.get('device', 'no CUDA device')}"
    return record


def _copy_tune_files(scratch: Path, out: Path) -> list:
    """Copy the tuned-configuration file ``tune`` wrote (one per GPU model: the first) next to the report."""
    copied = []
    for path in sorted((scratch / "tune-cache").glob("*.tune.json"))[:1]:
        shutil.copy(path, out / path.name)
        copied.append(path.name)
    return copied


def make_plots(rows: list, out: Path) -> dict:
    """``bench-fwd.png`` and ``bench-bwd.png`` from the bench rows; per file, None or why not."""
    from flash_recipe.tools import bench

    problems: dict[str, Optional[str]] = {}
    for mode in ("fwd", "bwd"):
        name = f"bench-{mode}.png"
        try:
            bench.plot([row for row in rows if "error" not in row], mode, str(out / name))
            problems[name] = None
        except Exception as exc:  # no matplotlib, nothing measured: noted in the report
            problems[name] = f"{type(exc).__name__}: {exc}"
    return problems


# ----------------------------------------------------------------------------- the report


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _quantity(value, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}x" if unit == "x" else f"{value:.1f} {unit}"


def build_targets(steps: dict) -> list:
    """Every target from the bench and memory steps of this run (see the module docstring)."""
    targets = []
    bench_step = steps.get("bench")
    if bench_step is not None and bench_step.get("status") != "skipped":
        rows = (bench_step.get("data") or {}).get("rows", [])
        targets += speed_targets(rows, [shape.id for shape in bench_shapes()])
    memory_step = steps.get("memory")
    if memory_step is not None and memory_step.get("status") != "skipped":
        rows = (memory_step.get("data") or {}).get("rows", [])
        if rows:
            targets += memory_targets(rows)
        else:
            targets.append({"target": "peak memory", "verdict": "MISS", "ratio": None, "note": "no memory measurement"})
    return targets


def render_markdown(report: dict) -> str:
    """``campaign.md`` from the report (the same dictionary as ``campaign.json``)."""
    env = report.get("environment") or {}
    versions = env.get("versions") or {}
    lines = ["# flash-recipe GPU campaign", ""]
    if report.get("dry_run"):
        lines += ["**Dry run: the plan only; nothing was run or measured.**", ""]
    lines += [
        f"- device: {env.get('device') or ('no CUDA device' if env else 'not probed')}"
        + (f" (sm{env['capability'].replace('.', '')}, {env.get('memory_gib')} GiB)" if env.get("capability") else ""),
        f"- date: {report['started']}" + (f", finished {report['finished']}" if report.get("finished") else ""),
        f"- flash_recipe {versions.get('flash_recipe', report.get('flash_recipe', '?'))}, torch "
        f"{versions.get('torch', '?')} (CUDA {versions.get('torch_cuda', '?')}), Triton {versions.get('triton', '?')}, "
        f"Python {versions.get('python', '?')}",
        f"- command: `{report['command']}`",
        f"- backend chosen for the target shape: {env.get('chosen_backend', 'n/a')}",
        f"- environment of the steps: {', '.join(f'`{k}={v}`' for k, v in (env.get('variables') or {}).items())}",
        "",
    ]
    targets = report.get("targets") or []
    if targets:
        passed = sum(t["verdict"] == "PASS" for t in targets)
        lines += [f"## Targets: {passed} PASS, {len(targets) - passed} MISS", ""]
        for group in summarize_targets(targets):
            bound = ("≥ " if group["target"].endswith("speed") else "≤ ") + f"{_fmt(group['required'], 2)}x"
            lines.append(
                f"- **{group['target']}** {bound}: {group['verdict']} ({group['passed']} of {group['count']}; "
                f"worst {_quantity(group['worst_ratio'], 'x')})"
            )
        lines.append("")
        lines += [
            f"{SUBJECT} against {REFERENCE}, measured side by side in this run (bf16, head dim "
            f"{TARGET['head_dim']}, {TARGET['nheads']} heads). Speed: TFLOP/s (forward "
            "`4·B·H·S²·D`, halved when causal; backward 2.5x). Memory: the peak a training step allocates above "
            "its inputs.",
            "",
            f"| target | shape | {SUBJECT} | {REFERENCE} | ratio | required | verdict |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for t in targets:
            unit = t.get("unit", "")
            bound = ("≥ " if t["target"].endswith("speed") else "≤ ") + f"{_fmt(t.get('required'), 2)}x"
            verdict = t["verdict"] + (f" ({t['note']})" if t.get("note") else "")
            lines.append(
                f"| {t['target']} | {t.get('shape', '')} | {_quantity(t.get('subject'), unit)} | "
                f"{_quantity(t.get('reference'), unit)} | "
                f"{_quantity(t.get('ratio'), 'x')} | {bound} | {verdict} |"
            )
        lines.append("")
    steps = report.get("steps") or {}
    lines += ["## Steps", "", "| step | status | time | budget | detail |", "|---|---|---:|---:|---|"]
    for step in report["plan"]:
        done = steps.get(step["name"], {})
        status = done.get("status", "skipped: " + step["skip"] if step.get("skip") else "not run")
        seconds = f"{done['seconds']} s" if done.get("seconds") is not None else ""
        detail = str(done.get("detail", "")).replace("|", "\\|")
        lines.append(f"| {step['name']} | {status} | {seconds} | {step['budget_s']} s | {detail} |")
    lines += ["", "Commands (`{scratch}`: a temporary folder; full output in `campaign.log`):", ""]
    lines += [f"- {step['name']}: `{step['command']}`" for step in report["plan"] if step["command"]]
    lines.append("")
    memory = (steps.get("memory") or {}).get("data") or {}
    if memory.get("rows"):
        seqlens = sorted({row["seqlen"] for row in memory["rows"]})
        lines += [
            "## Peak memory",
            "",
            "MiB allocated by one training step above its inputs (forward: with inputs that require grad; "
            "fwd_bwd: forward and backward), batch 1, 16 heads, head dim 128, bf16.",
            "",
            "| mode | mask | peer | " + " | ".join(f"S{s}" for s in seqlens) + f" | S{seqlens[-1]}/S{seqlens[0]} |",
            "|---|---|---|" + "---:|" * (len(seqlens) + 1),
        ]
        for entry in memory_table(memory["rows"]):
            cells = [_fmt(entry["peak_mb"].get(s), 1) for s in seqlens]
            lines.append(
                f"| {entry['mode']} | {'causal' if entry['causal'] else 'full'} | {entry['peer']} | "
                + " | ".join(cells)
                + f" | {_fmt(entry['growth'])}x |"
            )
        lines.append("")
    bench_data = (steps.get("bench") or {}).get("data") or {}
    if bench_data.get("rows"):
        from flash_recipe.tools.bench import to_markdown

        context = bench_data.get("context", "")
        lines += ["## Bench", "", to_markdown(bench_data["rows"], bench_data.get("modes", BENCH_MODES), context)]
        for name, problem in (report.get("plots") or {}).items():
            lines.append(f"![{name}]({name})" if problem is None else f"{name}: not drawn ({problem})")
        lines.append("")
    verify = (steps.get("verify") or {}).get("data")
    if verify:
        lines += [
            "## Verify",
            "",
            f"{'PASSED' if verify['passed'] else 'FAILED'} on {verify.get('device')}; backends "
            f"{', '.join(verify.get('backends') or [])}; fingerprint `{verify.get('fingerprint')}`",
            "",
            "| kind/dtype | checks | passed |",
            "|---|---:|---:|",
        ]
        lines += [f"| {key} | {c['checks']} | {c['passed']} |" for key, c in sorted(verify["counts"].items())]
        for name, why in (verify.get("skipped") or {}).items():
            lines.append(f"\nskipped {name}: {'; '.join(why)}")
        for row in verify["mismatches"][:20]:
            worst = {n: f"{row['errors'][n]:.2e} > {row['bounds'][n]:.2e}" for n in row["errors"]}
            lines.append(f"- MISMATCH {row['case']} {row['dtype']} {row['backend']}: {worst}")
        lines.append("")
    tests = (steps.get("tests") or {}).get("data")
    if tests:
        lines += [
            "## GPU tests",
            "",
            f"{tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
            f"{tests['skipped']} skipped",
            "",
        ]
        lines += [f"- {f['kind']}: `{f['test']}`: {f['message']}" for f in tests["failed"][:30]]
        lines.append("")
    tune = steps.get("tune")
    if tune:
        files = (tune.get("data") or {}).get("files") or []
        lines += ["## Tune", "", f"{tune['status']}: {tune.get('detail', '')}"]
        if files:
            lines.append(
                f"\nTuned configurations: {', '.join(f'`{f}`' for f in files)} (use with `FLASH_RECIPE_TUNE_CACHE=DIR`)"
            )
        if tune.get("output_tail"):
            lines += ["", "```", tune["output_tail"], "```"]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    _write_json(str(out / "campaign.json"), report)
    (out / "campaign.md").write_text(render_markdown(report))


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def new_report(plan: list, command: str, dry_run: bool) -> dict:
    import flash_recipe

    return {
        "format": 1,
        "command": command,
        "dry_run": dry_run,
        "started": _now(),
        "finished": None,
        "flash_recipe": flash_recipe.__version__,
        "budget_s": {"steps": sum(step.budget_s for step in plan), "total": TOTAL_BUDGET_S},
        "plan": [step.as_dict() for step in plan],
        "environment": None,
        "steps": {},
        "targets": [],
        "plots": {},
    }


def run_campaign(plan: list, out: Path, command: str, progress: Callable[[str], None] = print) -> int:
    """Run the plan, writing the report into ``out`` after every step; returns the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    report = new_report(plan, command, dry_run=False)
    scratch = Path(tempfile.mkdtemp(prefix="flash-recipe-campaign-"))
    env = step_environment(scratch)
    try:
        (out / "campaign.log").write_bytes(b"")
        # Unbuffered and appending: the steps write to the same file between the campaign's lines.
        with open(out / "campaign.log", "ab", buffering=0) as log:
            log.write(f"flash-recipe campaign, {report['started']}\n$ {command}\n".encode())
            for index, step in enumerate(plan, 1):
                if step.skip:
                    report["steps"][step.name] = {"name": step.name, "status": "skipped", "detail": step.skip}
                    progress(f"[{index}/{len(plan)}] {step.name}: skipped ({step.skip})")
                    continue
                progress(f"[{index}/{len(plan)}] {step.name}: {step.title} (budget {step.budget_s} s)")
                dropped = []
                available = (report["environment"] or {}).get("bench_peers")
                if step.name == "bench" and available is not None:
                    step, dropped = without_unavailable_peers(step, available)
                record = run_step(step, scratch, log, env)
                if dropped:
                    record["dropped_peers"] = dropped
                try:
                    record = collect(step, record, scratch, out, log)
                except Exception as exc:  # a result that cannot be read is the step's failure, not the campaign's
                    record.update(status="failed", detail=f"{record['detail']}; reading its result: {exc!r}")
                if dropped:
                    record["detail"] += f"; not available here: {', '.join(dropped)}"
                report["steps"][step.name] = record
                if step.name == "env":
                    report["environment"] = record.get("data")
                if step.name == "bench" and record.get("data", {}).get("rows"):
                    report["plots"] = make_plots(record["data"]["rows"], out)
                try:
                    report["targets"] = build_targets(report["steps"])
                except Exception as exc:  # malformed rows: said in the report, the campaign goes on
                    report["targets"] = [{"target": "all", "verdict": "MISS", "ratio": None, "note": repr(exc)}]
                write_report(report, out)
                progress(f"    {record['status']} in {record.get('seconds')} s: {record['detail']}")
        report["finished"] = _now()
        write_report(report, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for target in report["targets"]:
        ratio = f"{target['ratio']:.3f}x" if target.get("ratio") is not None else "n/a"
        progress(f"{target['verdict']:<4} {target['target']:<22} {target.get('shape', ''):<40} {ratio}")
    progress(f"report: {out / 'campaign.md'}, {out / 'campaign.json'}; output of every step: {out / 'campaign.log'}")
    failed = [name for name, step in report["steps"].items() if step["status"] not in ("passed", "skipped")]
    return 1 if failed else 0


def cuda_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) device; creates no context on it."""
    import torch

    return torch.cuda.is_available()


def _budget(text: str) -> tuple:
    name, _, seconds = text.partition("=")
    if name not in BUDGETS_S or not seconds.isdigit() or int(seconds) <= 0:
        raise argparse.ArgumentTypeError(f"expected STEP=SECONDS with STEP one of {', '.join(BUDGETS_S)}, got {text!r}")
    return name, int(seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flash_recipe.tools.campaign",
        description="The GPU campaign: verify, bench with peers, peak memory, GPU tests and tune, "
        "within 20 minutes; writes campaign.md, campaign.json, campaign.log and PNGs into --out.",
    )
    parser.add_argument("--out", required=True, help="folder for the report (created if missing)")
    parser.add_argument("--dry-run", action="store_true", help="print and write the plan; run nothing (no GPU needed)")
    names = lambda text: [name for name in text.split(",") if name]  # noqa: E731
    parser.add_argument("--only", type=names, help=f"comma-separated steps to run, of {','.join(STEP_NAMES)}")
    parser.add_argument("--skip", type=names, help="comma-separated steps not to run")
    parser.add_argument(
        "--budget",
        type=_budget,
        action="append",
        metavar="STEP=SECONDS",
        help="time budget of one step (repeatable), e.g. tune=400 on a slower GPU; "
        f"defaults {', '.join(f'{k}={v}' for k, v in BUDGETS_S.items())}",
    )
    parser.add_argument(
        "--tune-first",
        action="store_true",
        help="run tune before the other steps, so that they use the configurations it found",
    )
    return parser


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].split("=")[0] == "--step":
        return _worker(argv)
    args = build_parser().parse_args(argv)
    command = shlex.join([sys.executable, "-m", "flash_recipe.tools.campaign", *argv])
    try:
        plan = build_plan(test_tree=find_test_tree(), tune_first=args.tune_first, budgets=dict(args.budget or []))
        plan = select(plan, args.only, args.skip)
    except ValueError as exc:
        print(f"flash-recipe campaign: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.dry_run:
        print(f"flash-recipe campaign plan (dry run: nothing runs); report into {out}/: {', '.join(OUTPUT_FILES)}")
        print(format_plan(plan))
        out.mkdir(parents=True, exist_ok=True)
        report = new_report(plan, command, dry_run=True)
        write_report(report, out)
        (out / "campaign.md").write_text(render_markdown(report) + "\n## Plan\n\n```\n" + format_plan(plan) + "\n```\n")
        return 0
    if not cuda_available():
        print(
            "flash-recipe campaign: no CUDA device (torch.cuda.is_available() is False); the campaign measures a GPU. "
            "See the plan with --dry-run.",
            file=sys.stderr,
        )
        return 2
    print(format_plan(plan))
    return run_campaign(plan, out, command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
