"""Running one step in its own process group within its budget, and collecting what it left."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from flash_recipe.tools import bench
from flash_recipe.tools.verify import format_table

from .. import gpu_check
from .plan import STOP_GRACE_S, Step, package_root
from .targets import parse_junit, summarize_verify

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
            env=step.environment(env, str(scratch)),
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
    if step.name in ("tune", "shootout"):
        record["data"] = {"files": _copy_tune_files(scratch, out, step.name)}
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
    elif step.name == "decode":
        rows = document.get("rows", [])
        record["data"] = document
        record["detail"] = f"{len(rows)} rows, {sum('error' in r for r in rows)} with errors ({record['detail']})"
    elif step.name == "host":
        rows = document.get("rows", [])
        record["data"] = document
        worst = max((row["us"] for row in rows if not row.get("stubbed")), default=None)
        record["detail"] = f"{len(rows)} rows" + (
            f", at most {worst:.0f} us per call with real launches" if worst else ""
        )
    elif step.name == "capture":
        rows = document.get("rows", [])
        record["data"] = document
        passed = sum(row.get("status") == "passed" for row in rows)
        record["detail"] = f"{passed} of {len(rows)} capture checks passed ({record['detail']})"
    elif step.name == "check":
        record["data"] = document
        record["detail"] = f"{gpu_check.summary(document)} ({record['detail']})"
        if record["status"] == "passed" and not document.get("passed"):
            record["status"] = "failed"
    elif step.name == "warmup":
        record["data"] = {key: value for key, value in document.items() if key != "rows"}
        families = ", ".join(
            f"{name} {entry['sum_s']:.0f} s ({entry['variants']})"
            for name, entry in sorted(document["families"].items())
        )
        record["detail"] = (
            f"{document['variants']} variants, {document['errors']} failed, {document['sum_s']:.0f} s of first calls "
            f"in {document['wall_s']:.0f} s with {document['jobs']} jobs; per family, seconds (variants): {families}"
        )
    elif step.name == "env":
        record["data"] = document
        record["detail"] = f"{document.get('device', 'no CUDA device')}"
    return record


def _copy_tune_files(scratch: Path, out: Path, step: str) -> list:
    """Copy the file ``tune`` wrote (one per GPU model: the first) next to the report, or the one
    ``shootout`` wrote into ``measured/`` there (the file to commit to ``flash_recipe/measured/``);
    the paths copied, relative to ``out``."""
    source, target = (scratch / "tune-cache", out) if step == "tune" else (scratch / "measured", out / "measured")
    copied = []
    for path in sorted(source.glob("*.tune.json"))[:1]:
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
        copied.append(str((target / path.name).relative_to(out)))
    return copied


def make_plots(rows: list, out: Path) -> dict:
    """``bench-fwd.png`` and ``bench-bwd.png`` from the bench rows; per file, None or why not."""
    problems: dict[str, Optional[str]] = {}
    for mode in ("fwd", "bwd"):
        name = f"bench-{mode}.png"
        try:
            bench.plot(rows, mode, str(out / name))  # a mode that failed has no TFLOP/s: not drawn
            problems[name] = None
        except Exception as exc:  # no matplotlib, nothing measured: noted in the report
            problems[name] = f"{type(exc).__name__}: {exc}"
    return problems
