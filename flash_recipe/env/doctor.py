"""``flash-recipe doctor``: read the environment, recognise known install failures, print the fix.

The report puts findings first, then the binary coupling a compiled flash-attn must match
(Python ABI x torch x CUDA x C++ ABI), then the facts behind it. ``--json`` prints the same as
one JSON object. Exit status: 0 when no finding is an error, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Union

from . import probes, release
from .facts import BackendsFacts, Facts, FlashAttnFacts, ProbeError, TritonFacts
from .project import probe_project
from .published import LATEST
from .rules import Context, Finding, evaluate
from .wheels import inspect_wheel_file, release_tuple

FLEX_FACTS = (
    "FlexAttention has no ahead-of-time build step and no build_flex_attention_kernels() function: "
    "torch.compile generates its kernels with Triton on first use."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--flash-attn-wheel",
        nargs="?",
        const=LATEST,
        default=None,
        metavar="VERSION",
        help=f"print the upstream flash-attn wheel for this environment (default release {LATEST})",
    )
    parser.add_argument(
        "--flex", action="store_true", help="say what FlexAttention needs and whether this machine has it"
    )
    parser.add_argument(
        "--log", metavar="FILE", help="also read an install log (pip, uv or Poetry output; '-' for stdin)"
    )
    parser.add_argument("--wheel", metavar="FILE", help="also check a downloaded flash-attn wheel file")
    parser.add_argument(
        "--online", action="store_true", help="check that the upstream release download host can be reached"
    )
    parser.add_argument(
        "--installer", choices=("pip", "uv", "poetry"), help="installer to write fixes for (default: detected)"
    )
    parser.add_argument("--project", metavar="DIR", help="project directory to detect the installer from (default: .)")


def diagnose(args: argparse.Namespace, facts: Optional[Facts] = None) -> dict[str, Any]:
    """Collect facts (unless given), evaluate the rules, and return the whole report as a dict."""
    if facts is None:
        facts = probes.collect()
        facts["project"] = probes.run_probe("project", lambda: probe_project(args.project))
        facts["release"] = probes.run_probe("release", release.probe_release)
        if args.online:
            facts["network"] = probes.run_probe("network", probes.probe_network)
    project = facts.get("project") if isinstance(facts.get("project"), dict) else {}
    installer = args.installer or project.get("installer") or "pip"
    log_text = None
    if args.log:
        log_text = sys.stdin.read() if args.log == "-" else _read(args.log)
    wheel = None
    if args.wheel:
        try:
            wheel = inspect_wheel_file(args.wheel)
        except ValueError as exc:
            wheel = {"error": str(exc)}
    ctx = Context(
        facts=facts,
        log=log_text,
        wheel=wheel,
        flash_attn_version=args.flash_attn_wheel,
        installer=installer,
        project=project,
    )
    findings = evaluate(ctx)
    report: dict[str, Any] = {
        "healthy": not any(f.severity == "error" for f in findings),
        "installer": installer,
        "findings": [f.to_dict() for f in findings],
        "coupling": coupling(facts),
        "facts": facts,
    }
    if args.flash_attn_wheel or args.wheel:
        report["upstream_wheel"] = ctx.resolved()
    if wheel:
        report["wheel_file"] = wheel
    if args.flex:
        report["flex"] = flex_report(facts)
    return report


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def coupling(facts: Facts) -> dict[str, Optional[str]]:
    """The four things a compiled flash-attn wheel must match, read off this environment."""
    plat = facts.get("platform", {})
    torch = facts.get("torch", {})
    if torch.get("cuda"):
        device = f"CUDA {torch['cuda']}"
    elif torch.get("hip"):
        device = f"ROCm {torch['hip']}"
    elif torch.get("installed") and "build" in torch:
        device = "none (CPU build)"
    else:
        device = None
    abi = torch.get("cxx11abi")
    return {
        "python_abi": plat.get("python_tag"),
        "torch": torch.get("version") if torch.get("installed") else None,
        "cuda": device,
        "cxx11abi": None if abi is None else ("TRUE" if abi else "FALSE"),
        "platform": plat.get("wheel_platform"),
    }


def flex_report(facts: Facts) -> dict[str, Any]:
    """What FlexAttention needs, each requirement with whether this machine meets it."""
    flex = facts.get("flex", {})
    torch = facts.get("torch", {})
    needs = [
        {
            "need": "torch >= 2.5 (torch.nn.attention.flex_attention)",
            "met": bool(flex.get("torch_ok") and flex.get("module")),
        },
        {"need": "a CUDA device for the compiled fast path", "met": bool(flex.get("device"))},
        {"need": "fp16 or bf16 inputs for the fast path; head dim >= 16", "met": None},
        {
            "need": "Triton, used by torch.compile to generate the kernels on first use",
            "met": bool(facts.get("triton", {}).get("installed")),
        },
    ]
    ready = all(n["met"] is not False for n in needs)
    return {"statement": FLEX_FACTS, "torch": torch.get("version"), "needs": needs, "ready": ready}


# -- terminal report ---------------------------------------------------------------------------
def _section(lines: list[str], title: str) -> None:
    lines.append("")
    lines.append(title.upper())


def _fmt_finding(f: dict[str, Any]) -> list[str]:
    out = [f"  [{f['severity']}] {f['rule']}: {f['title']}"]
    for item in f["evidence"]:
        out.append(f"      saw: {item}")
    if f.get("note"):
        out.append(f"      note: {f['note']}")
    if f.get("command"):
        out.append(f"      fix (recipes/{f['recipe']}):" if f["recipe"] else "      fix:")
        out += [f"        {line}" for line in f["command"].splitlines()]
    return out


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def format_report(report: dict[str, Any]) -> str:
    """The report of :func:`diagnose` as the terminal text ``flash-recipe doctor`` prints: one
    section per part of the report, the installer's line last."""
    facts: Facts = report["facts"]
    lines = ["flash-recipe doctor"]
    _section(lines, "findings")
    lines += [line for f in report["findings"] for line in _fmt_finding(f)] or [
        "  none: no known install failure applies to this environment"
    ]
    _section(lines, "coupling (what a compiled flash-attn wheel must match)")
    lines += _coupling_lines(report["coupling"])
    if "upstream_wheel" in report:
        _section(lines, f"upstream flash-attn {report['upstream_wheel']['version']} wheel")
        lines += _wheel_lines(report["upstream_wheel"])
    _section(lines, "machine")
    lines += _machine_lines(facts) + _gpu_lines(facts) + _triton_lines(facts.get("triton", {})) + _build_lines(facts)
    _section(lines, "upstream flash-attn")
    lines += _flash_attn_lines(facts.get("flash_attn", {}))
    _section(lines, "flash_recipe backends")
    lines += _backend_lines(facts.get("backends", {}))
    if "flex" in report:
        _section(lines, "FlexAttention")
        lines += _flex_lines(report["flex"])
    proj = facts.get("project", {})
    if proj:
        status = 0 if report["healthy"] else 1
        lines += ["", f"installer: {report['installer']} ({proj.get('installer_reason')}); exit status {status}"]
    return "\n".join(lines) + "\n"


def _coupling_lines(c: dict[str, Any]) -> list[str]:
    """The Python ABI, torch, CUDA, C++11 ABI and platform a compiled flash-attn wheel must match."""
    return _table(
        [
            ["Python ABI", "torch", "CUDA", "C++11 ABI", "platform"],
            [
                c["python_abi"] or "?",
                c["torch"] or "not installed",
                c["cuda"] or "-",
                c["cxx11abi"] or "-",
                c["platform"] or "?",
            ],
        ]
    )


def _wheel_lines(w: dict[str, Any]) -> list[str]:
    """The upstream wheel this environment needs: its file, address, status and nearest published one."""
    lines = [f"  file:   {w['filename'] or '(none can be named)'}"]
    if w["url"]:
        lines.append(f"  url:    {w['url']}")
    lines.append(f"  status: {w['status']}: {w['reason']}")
    if w.get("nearest"):
        n = w["nearest"]
        lines.append(f"  nearest published: {n['filename']}")
        if n["differs"]:
            lines.append(f"    differs: {'; '.join(n['differs'])} (it loads only where those match)")
    if w["status"] in ("not-published", "not-confirmed", "unknown-release"):
        lines.append(
            "  or build from source against this torch: see recipes/pip-no-build-isolation and "
            "recipes/upstream-flash-attn"
        )
    return lines


def _machine_lines(facts: Facts) -> list[str]:
    """The OS, libc, cores, memory, Python and torch."""
    plat = facts.get("platform", {})
    libc = f"{plat.get('libc') or 'libc ?'} {plat.get('libc_version') or ''}"
    lines = [
        f"  {plat.get('os', '?')} {plat.get('machine', '?')}, {libc}".rstrip()
        + f", {plat.get('cpu_count', '?')} cores, {plat.get('mem_available_gib', '?')} GiB free",
        f"  Python {plat.get('python', '?')} ({plat.get('executable', '?')})",
    ]
    torch = facts.get("torch", {})
    if torch.get("error") or torch.get("import_error"):
        lines.append(f"  torch: {torch.get('error') or torch.get('import_error')}")
    elif torch.get("installed"):
        kind = torch.get("build", "?")
        lines.append(f"  torch {torch.get('version')}: {kind} build, GPU usable: {torch.get('cuda_available')}")
    else:
        lines.append("  torch: not installed")
    return lines


def _gpu_lines(facts: Facts) -> list[str]:
    """The GPUs, torch SDPA's kernels on them, the driver and nvcc."""
    lines = []
    gpus = facts.get("gpus", {})
    for d in gpus.get("devices") or []:
        smem = d.get("shared_memory_per_block")
        lines.append(
            f"  GPU {d['name']}: sm{d['capability'][0]}{d['capability'][1]}"
            + (f", {smem} bytes shared memory per block" if smem else "")
        )
    if not gpus.get("devices"):
        lines.append("  GPU: none found" + (f" ({gpus['error']})" if gpus.get("error") else ""))
    kernels = facts.get("sdpa", {}).get("kernels") or {}
    if kernels and "error" not in kernels:
        parts = []
        for name, label in (("FLASH_ATTENTION", "flash"), ("EFFICIENT_ATTENTION", "memory-efficient")):
            result = kernels.get(name)
            if result:
                parts.append(f"{label} {'runs' if result.get('ok') else 'fails: ' + str(result.get('error'))}")
        lines.append("  torch SDPA, one kernel at a time on this GPU: " + "; ".join(parts))
    if gpus.get("driver"):
        lines.append(
            f"  driver {gpus['driver']}" + (f" (CUDA {gpus['driver_cuda']})" if gpus.get("driver_cuda") else "")
        )
    nvcc = facts.get("nvcc", {})
    lines.append(
        f"  nvcc: {nvcc.get('path') or 'not found'}"
        + (f" (CUDA {nvcc['version']})" if nvcc.get("version") else "")
        + f", CUDA_HOME={nvcc.get('cuda_home') or 'unset'}"
    )
    return lines


def _triton_lines(triton: Union[TritonFacts, ProbeError]) -> list[str]:
    """Triton's version and target, and whether it compiles flash_recipe's forward kernel for it."""
    if not triton.get("installed"):
        return [f"  Triton: {triton.get('error') or 'not installed'}"]
    target = triton.get("target") or f"no GPU target ({triton.get('target_error', 'unknown')})"
    lines = [f"  Triton {triton.get('version')}: {target}"]
    check = triton.get("compile")
    if check:
        if check.get("ok"):
            lines.append(
                f"    compiles flash_recipe's forward kernel for {check['arch']}: {check['shared_bytes']} of "
                f"{check['shared_limit']} bytes shared memory, {check['seconds']} s"
            )
        elif check.get("ok") is None:
            lines.append(f"    {check.get('error')}")
        else:
            error = check.get("error") or "; ".join(check.get("problems") or [])
            lines.append(f"    cannot compile flash_recipe's forward kernel for {check['arch']}: {error}")
    return lines


def _build_lines(facts: Facts) -> list[str]:
    """ninja, the missing build tools and the build variables set."""
    build = facts.get("build", {})
    missing = ", ".join(build.get("missing") or []) or "none"
    lines = [f"  ninja: {build.get('ninja') or 'not found'}; missing build tools: {missing}"]
    env = facts.get("env", {})
    if env:
        lines.append("  build variables: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    return lines


def _flash_attn_lines(fa: Union[FlashAttnFacts, ProbeError]) -> list[str]:
    """Upstream flash-attn: installed by what, from which wheel, and whether its compiled module loads."""
    if fa.get("error"):
        return [f"  probe failed: {fa['error']}"]
    if not fa.get("installed") and fa.get("module_location"):
        lines = [
            f"  no flash-attn distribution is installed, but `import flash_attn` finds {fa['module_location']}",
            f"  import flash_attn: {fa.get('package_error') or 'imports'}",
        ]
        if fa.get("package_error") is None:
            loads = "loads" if fa.get("loads") else f"fails: {fa.get('module_error')}"
            lines.append("  compiled module flash_attn_2_cuda: " + loads)
        return lines
    if not fa.get("installed"):
        return ["  not installed (flash_recipe does not need it)"]
    installer = fa.get("installer") or "an unrecorded installer"
    lines = [f"  {fa.get('version')} installed by {installer} in {fa.get('location')}"]
    if fa.get("wheel_filename"):
        lines.append(f"  from wheel {fa['wheel_filename']}")
    if fa.get("wheel_tags"):
        lines.append(f"  wheel tags: {', '.join(fa['wheel_tags'])}")
    loads = "loads" if fa.get("loads") else f"fails: {fa.get('module_error')}"
    lines.append("  compiled module flash_attn_2_cuda: " + loads)
    if fa.get("package_error"):
        lines.append(f"  import flash_attn: {fa['package_error']}")
    return lines


def _backend_lines(backends: Union[BackendsFacts, ProbeError]) -> list[str]:
    """Which of flash_recipe's backends can run the probe's call, and why the others cannot."""
    if backends.get("error"):
        return [f"  cannot tell: {backends['error']}"]
    lines = [f"  for {backends.get('call')}:"]
    for name, reason in (backends.get("explain") or {}).items():
        lines.append(f"  {name:<11} {'can run' if reason is None else reason}")
    return lines


def _flex_lines(fx: dict[str, Any]) -> list[str]:
    """What FlexAttention needs, each need met, unmet or depending on the call."""
    lines = [f"  {fx['statement']}"]
    for need in fx["needs"]:
        mark = {True: "yes", False: "NO", None: "depends on your call"}[need["met"]]
        lines.append(f"  {mark:<20} {need['need']}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.flash_attn_wheel is not None:
        try:
            release_tuple(args.flash_attn_wheel)
        except ValueError as exc:
            sys.stderr.write(f"flash-recipe doctor: error: --flash-attn-wheel: {exc}\n")
            return 2
    try:
        report = diagnose(args)
    except OSError as exc:  # an unreadable --log file
        sys.stderr.write(f"flash-recipe doctor: error: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(format_report(report))
    return 0 if report["healthy"] else 1


__all__ = ["add_arguments", "run", "diagnose", "format_report", "coupling", "Finding"]
