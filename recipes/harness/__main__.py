"""Command line of the install matrix: ``python -m recipes.harness COMMAND``.

- ``prepare``: build the tools environment, the project's sdist and wheel, and the wheelhouse;
- ``run [PATH ...]``: run paths (all by default) into a run directory, one result file each;
- ``report``: the table of a run, written as install-matrix.md and install-matrix.json; fails
  when a path failed or the fingerprints differ;
- ``list``: the path ids.

A run is identified by ``--run-id`` (or FLASH_RECIPE_MATRIX_RUN), so that separate ``run``
invocations (one nox session per path) add up to one report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from recipes.harness import report
from recipes.harness.checks import triton_interpret
from recipes.harness.config import add_option_arguments, add_source_argument, options_from_args
from recipes.harness.paths import PATH_IDS, PATHS, get
from recipes.harness.prepare import log, project_build, tools_env, wheelhouse
from recipes.harness.runner import Context, run_path


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def prepare(options, run_id: str) -> Context:
    started = time.monotonic()
    run_dir = options.cache_dir / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / "meta.json"
    # Later sessions of a run test the build the first one made.
    rev = json.loads(meta_path.read_text())["rev"] if meta_path.exists() else None
    tools = tools_env(options)
    build = project_build(options, tools, rev=rev)
    house = wheelhouse(options, tools, build)
    ctx = Context(options, tools, build, house, run_dir)
    meta = {
        "run_id": run_id,
        "torch_index": options.torch_index,
        "torch_index_url": options.torch_index_url,
        "torch_version": options.torch_version,
        "python": options.python,
        "python_version": ctx.python_version,
        "flash_recipe_version": build.version,
        "rev": build.rev,
        "wheel": build.wheel.name,
        "wheelhouse": str(house.root),
        "wheelhouse_mb": round(house.size_mb(), 1),
        "triton_interpret": triton_interpret(options),
        "source": options.source,
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    log(
        f"ready in {time.monotonic() - started:.1f} s: flash-recipe {build.version} at {build.rev[:12]}, "
        f"wheelhouse {meta['wheelhouse_mb']} MB ({house.root})"
    )
    return ctx


def cmd_run(args) -> int:
    options = options_from_args(args)
    ids = args.paths or list(PATH_IDS)
    paths = [get(i) for i in ids]
    ctx = prepare(options, args.run_id)
    results = ctx.run_dir / "results"
    results.mkdir(exist_ok=True)
    failed = 0
    for number, path in enumerate(paths, 1):
        log(f"[{number}/{len(paths)}] {path.id}: {path.summary}")
        row = run_path(ctx, path)
        (results / f"{path.id}.json").write_text(json.dumps(row, indent=2) + "\n")
        status = "pass" if row["passed"] else "FAIL"
        log(
            f"[{number}/{len(paths)}] {path.id}: {status} (install {row['install_s']} s, verify {row['verify_s']} s, "
            f"{row['env_mb']} MB, fingerprint {(row['fingerprint'] or '-')[:12]})"
        )
        if not row["passed"]:
            failed += 1
            for text in report.failures(row):
                log(f"    {text}")
            log(f"    log: {row['log']}")
            tail = Path(row["log"]).read_text(errors="replace").strip().splitlines()[-25:]
            print("\n".join(f"    | {line}" for line in tail), file=sys.stderr)
    if args.report:
        return cmd_report(args)
    return 1 if failed else 0


def cmd_report(args) -> int:
    options = options_from_args(args)
    run_dir = options.cache_dir / "runs" / args.run_id
    results = run_dir / "results"
    rows = []
    for path in PATHS:
        result = results / f"{path.id}.json"
        if result.exists():
            rows.append(json.loads(result.read_text()))
    if not rows:
        print(f"no results in {results}", file=sys.stderr)
        return 1
    meta = json.loads((run_dir / "meta.json").read_text())
    summary = report.summarize(rows, meta)
    md_path, json_path = report.write(summary, options.report_dir)
    print()
    print(report.table(rows))
    print()
    for problem in summary["problems"]:
        print(f"problem: {problem}")
    status = "pass" if summary["passed"] else "FAIL"
    print(f"install matrix: {status} ({len(rows)} paths); report: {md_path}, {json_path}")
    return 0 if summary["passed"] else 1


def cmd_prepare(args) -> int:
    prepare(options_from_args(args), args.run_id)
    return 0


def cmd_list(args) -> int:
    for path in PATHS:
        print(f"{path.id:24} {path.summary}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in (
        ("run", cmd_run, "run install paths (all by default)"),
        ("report", cmd_report, "write and print the report of a run"),
        ("prepare", cmd_prepare, "build tools, project and wheelhouse only"),
        ("list", cmd_list, "list the install paths"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=func)
        if name == "list":
            continue
        add_option_arguments(p)
        p.add_argument("--run-id", default=os.environ.get("FLASH_RECIPE_MATRIX_RUN") or new_run_id())
        if name in ("run", "prepare", "report"):
            add_source_argument(p)
        if name == "run":
            p.add_argument("paths", nargs="*", metavar="PATH", help="path ids (default: all)")
            p.add_argument("--report", action="store_true", help="write and print the report afterwards")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        log("interrupted; servers stopped and temporary files removed")
        return 130


if __name__ == "__main__":
    # nox ends a session's command with SIGTERM after Ctrl-C: clean up as for Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
