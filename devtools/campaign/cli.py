"""``python -m devtools.campaign``: the command line, and the run of a plan."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from .plan import (
    BUDGETS_S,
    DEFAULT_MINUTES,
    OUTPUT_FILES,
    STEP_NAMES,
    build_plan,
    find_test_tree,
    fit,
    format_plan,
    select,
)
from .report import build_targets, new_report, render_markdown, timestamp, write_report
from .steps import collect, make_plots, run_step, step_environment, without_unavailable_peers
from .workers import run_worker


def run_campaign(
    plan: list, out: Path, command: str, progress: Callable[[str], None] = print, minutes: Optional[float] = None
) -> int:
    """Run the plan, writing the report into ``out`` after every step; returns the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    report = new_report(plan, command, dry_run=False, minutes=minutes)
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
        report["finished"] = timestamp()
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
    return torch.cuda.is_available()


def _budget(text: str) -> tuple:
    name, _, seconds = text.partition("=")
    if name not in BUDGETS_S or not seconds.isdigit() or int(seconds) <= 0:
        raise argparse.ArgumentTypeError(f"expected STEP=SECONDS with STEP one of {', '.join(BUDGETS_S)}, got {text!r}")
    return name, int(seconds)


def _minutes(text: str) -> float:
    try:
        minutes = float(text)
    except ValueError:
        minutes = 0.0
    if not minutes >= 1:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, at least 1, got {text!r}")
    return minutes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.campaign",
        description="The GPU campaign: compiling ahead, correctness on the GPU, the backward's shoot-out, bench "
        "with peers, host cost, decoding, peak memory and CUDA-graph capture, verify, GPU tests and tune, fitted "
        "to --minutes; writes "
        "campaign.md, campaign.json, campaign.log and PNGs into --out.",
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
        "--minutes",
        type=_minutes,
        default=DEFAULT_MINUTES,
        help=f"fit the plan to this many minutes (default {DEFAULT_MINUTES}): in the order of value, a step "
        "whose budget does not fit in what is left is skipped, and the plan and the report say so",
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
        return run_worker(argv)
    args = build_parser().parse_args(argv)
    command = shlex.join([sys.executable, "-m", "devtools.campaign", *argv])
    try:
        plan = build_plan(test_tree=find_test_tree(), tune_first=args.tune_first, budgets=dict(args.budget or []))
        plan = fit(select(plan, args.only, args.skip), args.minutes)
    except ValueError as exc:
        print(f"flash-recipe campaign: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.dry_run:
        print(f"flash-recipe campaign plan (dry run: nothing runs); report into {out}/: {', '.join(OUTPUT_FILES)}")
        print(format_plan(plan, args.minutes))
        out.mkdir(parents=True, exist_ok=True)
        report = new_report(plan, command, dry_run=True, minutes=args.minutes)
        write_report(report, out)
        text = render_markdown(report) + "\n## Plan\n\n```\n" + format_plan(plan, args.minutes) + "\n```\n"
        (out / "campaign.md").write_text(text)
        return 0
    if not cuda_available():
        print(
            "flash-recipe campaign: no CUDA device (torch.cuda.is_available() is False); the campaign measures a GPU. "
            "See the plan with --dry-run.",
            file=sys.stderr,
        )
        return 2
    print(format_plan(plan, args.minutes))
    return run_campaign(plan, out, command, minutes=args.minutes)
