"""The report: ``campaign.md`` and ``campaign.json`` from the steps' records and the targets."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Optional

from flash_recipe import __version__
from flash_recipe.atomic_json import write_json
from flash_recipe.tools.bench import to_markdown
from flash_recipe.tools.bench_decode import markdown

from .plan import BENCH_MODES, REFERENCE, SUBJECT, TARGET, TOTAL_BUDGET_S, bench_shapes
from .targets import (
    decode_targets,
    memory_table,
    memory_targets,
    speed_targets,
    summarize_targets,
)

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
    decode_step = steps.get("decode")
    if decode_step is not None and decode_step.get("status") != "skipped":
        data = decode_step.get("data") or {}
        rows = data.get("rows", [])
        if rows:
            targets += decode_targets(rows, data.get("context"))
        else:
            targets.append({"target": "decode", "verdict": "MISS", "ratio": None, "note": "no decoding measurement"})
    return targets


def _bound(target: str) -> str:
    """How a target's ratio is judged: memory at most the required ratio, speed at least."""
    return "≤ " if "memory" in target else "≥ "


def step_summary(report: dict) -> list:
    """The report's first lines: which steps proved something, which failed, which were skipped and why."""
    steps = report.get("steps") or {}
    planned = {step["name"]: step for step in report.get("plan") or []}
    passed = [name for name, step in steps.items() if step.get("status") == "passed" and name != "env"]
    failed = [f"{name} ({step.get('status')}: {step.get('detail', '')})" for name, step in steps.items()
              if step.get("status") not in ("passed", "skipped")]  # fmt: skip
    skipped = [f"{name} ({step.get('skip')})" for name, step in planned.items() if step.get("skip")]
    not_yet = [name for name, step in planned.items() if not step.get("skip") and name not in steps]
    lines = [f"- passed: {', '.join(passed) or 'none'}"]
    check = steps.get("check") or {}
    if check.get("data"):
        lines.insert(0, f"- correctness on the GPU ({check.get('status')}): {check['data'].get('summary', '')}")
    elif check.get("status") not in (None, "skipped"):
        lines.insert(0, f"- correctness on the GPU: not proven ({check.get('status')}: {check.get('detail', '')})")
    if failed:
        lines.append(f"- failed: {'; '.join(failed)}")
    if skipped:
        lines.append(f"- skipped: {'; '.join(skipped)}")
    if not_yet and not report.get("dry_run"):
        lines.append(f"- not run (the campaign stopped before them): {', '.join(not_yet)}")
    return lines


def render_markdown(report: dict) -> str:
    """``campaign.md`` from the report (the same dictionary as ``campaign.json``): one section per
    part of the report, each empty where its step left nothing."""
    steps = report.get("steps") or {}

    def data(name: str) -> dict:
        return (steps.get(name) or {}).get("data") or {}

    lines = _header(report) + _targets_section(report.get("targets") or []) + _steps_section(report, steps)
    lines += _memory_section(data("memory")) + _bench_section(data("bench"), report.get("plots") or {})
    lines += _check_section(data("check")) + _shootout_section(steps.get("shootout")) + _warmup_section(data("warmup"))
    lines += _host_section(data("host")) + _capture_section(data("capture")) + _decode_section(data("decode"))
    lines += _verify_section(data("verify")) + _tests_section(data("tests")) + _tune_section(steps.get("tune"))
    return "\n".join(lines)


def _header(report: dict) -> list:
    """The title, the step summary and the run's device, date, versions, command and environment."""
    env = report.get("environment") or {}
    versions = env.get("versions") or {}
    lines = ["# flash-recipe GPU campaign", ""]
    if report.get("dry_run"):
        lines += ["**Dry run: the plan only; nothing was run or measured.**", ""]
    lines += [*step_summary(report), ""]
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
    return lines


def _targets_section(targets: list) -> list:
    """``## Targets``: each target group's verdict, then every target's measurement against its bound."""
    if not targets:
        return []
    passed = sum(t["verdict"] == "PASS" for t in targets)
    lines = [f"## Targets: {passed} PASS, {len(targets) - passed} MISS", ""]
    for group in summarize_targets(targets):
        bound = _bound(group["target"]) + f"{_fmt(group['required'], 2)}x"
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
        bound = _bound(t["target"]) + f"{_fmt(t.get('required'), 2)}x"
        verdict = t["verdict"] + (f" ({t['note']})" if t.get("note") else "")
        lines.append(
            f"| {t['target']} | {t.get('shape', '')} | {_quantity(t.get('subject'), unit)} | "
            f"{_quantity(t.get('reference'), unit)} | "
            f"{_quantity(t.get('ratio'), 'x')} | {bound} | {verdict} |"
        )
    lines.append("")
    return lines


def _steps_section(report: dict, steps: dict) -> list:
    """``## Steps``: each planned step's status, time, budget and detail, then the commands."""
    lines = ["## Steps", "", "| step | status | time | budget | detail |", "|---|---|---:|---:|---|"]
    for step in report["plan"]:
        done = steps.get(step["name"], {})
        status = done.get("status", "skipped: " + step["skip"] if step.get("skip") else "not run")
        seconds = f"{done['seconds']} s" if done.get("seconds") is not None else ""
        detail = str(done.get("detail", "")).replace("|", "\\|")
        lines.append(f"| {step['name']} | {status} | {seconds} | {step['budget_s']} s | {detail} |")
    lines += ["", "Commands (`{scratch}`: a temporary folder; full output in `campaign.log`):", ""]
    lines += [f"- {step['name']}: `{step['command']}`" for step in report["plan"] if step["command"]]
    lines.append("")
    return lines


def _memory_section(memory: dict) -> list:
    """``## Peak memory``: MiB per mode, mask and peer at each sequence length, and the growth."""
    if not memory.get("rows"):
        return []
    seqlens = sorted({row["seqlen"] for row in memory["rows"]})
    lines = [
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
    return lines


def _bench_section(bench_data: dict, plots: dict) -> list:
    """``## Bench``: the bench step's table and its plots."""
    if not bench_data.get("rows"):
        return []
    context = bench_data.get("context", "")
    lines = ["## Bench", "", to_markdown(bench_data["rows"], bench_data.get("modes", BENCH_MODES), context)]
    for name, problem in plots.items():
        lines.append(f"![{name}]({name})" if problem is None else f"{name}: not drawn ({problem})")
    lines.append("")
    return lines


def _host_section(host_data: dict) -> list:
    """``## Host cost per call``: Python calls and microseconds per case, then the profiles."""
    if not host_data.get("rows"):
        return []
    lines = [
        "## Host cost per call",
        "",
        f"{host_data.get('shape', '')}: Python function calls and microseconds per call issued back to back "
        "(no synchronisation in the timed region), Triton's launch stubbed or real, torch SDPA beside.",
        "",
        "| case | launches | Python calls | us per call | SDPA us per call | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in host_data["rows"]:
        lines.append(
            f"| {row['case']} | {'stubbed' if row.get('stubbed') else 'real'} | {row['calls']} | {row['us']} | "
            f"{row['sdpa_us']} | {row['ratio']} |"
        )
    lines.append("")
    for case, entries in (host_data.get("profiles") or {}).items():
        lines += [f"{case}, torch.profiler's top entries by self CPU time, per call:", "",
                  "| entry | calls | self CPU us |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| {e['name']} | {e['calls']} | {e['self_cpu_us']} |" for e in entries]
        lines.append("")
    return lines


def _capture_section(capture_data: dict) -> list:
    """``## CUDA-graph capture``: each capture check's status."""
    if not capture_data.get("rows"):
        return []
    lines = ["## CUDA-graph capture", "", "| check | status | detail |", "|---|---|---|"]
    lines += [f"| {row['check']} | {row['status']} | {row['detail']} |" for row in capture_data["rows"]]
    lines.append("")
    return lines


def _decode_section(decode_data: dict) -> list:
    """``## Decoding``: the decode step's bandwidth tables, called and replayed."""
    if not decode_data.get("rows"):
        return []
    lines = ["## Decoding", "", markdown(decode_data), ""]
    if any("graph_bytes_per_s" in row for row in decode_data["rows"]):
        lines += [markdown(decode_data, "graph_bytes_per_s"), ""]
    return lines


def _verify_section(verify: dict) -> list:
    """``## Verify``: the verdict, the checks per kind and dtype, what was skipped and the mismatches."""
    if not verify:
        return []
    lines = [
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
    return lines


def _tests_section(tests: dict) -> list:
    """``## GPU tests``: the counts and the failures."""
    if not tests:
        return []
    lines = [
        "## GPU tests",
        "",
        f"{tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped",
        "",
    ]
    lines += [f"- {f['kind']}: `{f['test']}`: {f['message']}" for f in tests["failed"][:30]]
    lines.append("")
    return lines


def _tune_section(tune: Optional[dict]) -> list:
    """``## Tune``: the tune step's status and the files it wrote."""
    if not tune:
        return []
    files = (tune.get("data") or {}).get("files") or []
    lines = ["## Tune", "", f"{tune['status']}: {tune.get('detail', '')}"]
    if files:
        lines.append(
            f"\nTuned configurations: {', '.join(f'`{f}`' for f in files)} (use with `FLASH_RECIPE_TUNE_CACHE=DIR`)"
        )
    if tune.get("output_tail"):
        lines += ["", "```", tune["output_tail"], "```"]
    lines.append("")
    return lines


def _shootout_section(step: Optional[dict]) -> list:
    """``## Backward shoot-out``: per head dim, the path kept and each path's time, then the
    configurations kept, and the measured-defaults file to commit."""
    if not step:
        return []
    data = step.get("data") or {}
    found = data.get("report") or {}
    lines = ["## Backward shoot-out", "", f"{step['status']}: {step.get('detail', '')}", ""]
    if found.get("backward"):
        lines += [
            "| head dim | bytes | kept | table's default | speed-up | ms per path (geomean) |",
            "|---:|---:|---|---|---:|---|",
        ]
        for entry in found["backward"]:
            times = ", ".join(
                f"{path} {math.exp(sum(math.log(v) for v in ms.values()) / len(ms)):.4g}"
                for path, ms in sorted((entry.get("ms") or {}).items())
                if ms
            )
            lines.append(
                f"| {entry['head_dim']} | {entry['element_size']} | {entry['path']} | {entry.get('default', '-')} "
                f"| {entry.get('speedup', '-')} | {times} |"
            )
        lines.append("")
    for entry in found.get("configs") or []:
        lines.append(
            f"- {entry['kernel']} d{entry['head_dim']}: {entry['block_m']}x{entry['block_n']} w{entry['num_warps']} "
            f"s{entry['num_stages']}, {entry.get('speedup', '-')}x the table's {entry.get('table')}"
        )
    if found.get("not_reached"):
        groups = ", ".join(f"d{g['head_dim']} ({'/'.join(g['dtypes'])})" for g in found["not_reached"])
        lines.append(f"\nNot started within the step's budget: {groups}; `--budget shootout=S` gives it more.")
    for name in data.get("files") or []:
        lines.append(f"\nMeasured defaults: `{name}`; commit it as `flash_recipe/{name}` to ship it for this GPU.")
    if step["status"] != "passed" and step.get("output_tail"):
        lines += ["", "```", step["output_tail"], "```"]
    return lines + [""]


def _check_section(data: dict) -> list:
    """``## Correctness on the GPU``: each table check's worst error as a fraction of its bound."""
    if not data.get("rows"):
        return []
    lines = [
        "## Correctness on the GPU",
        "",
        f"{data.get('summary', '')}",
        "",
        "Error over the rule's bound (at most 1 passes): output 2x, gradients 3x the peer's error against fp32 "
        "math, plus the floor; `kept`: dropout's kept fraction within 6 standard deviations.",
        "",
        "| case | dtype | peer | out | dq | dk | dv | other | verdict |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in data["rows"]:
        errors, bounds = row.get("errors") or {}, row.get("bounds") or {}
        cells = [_share(errors.get(n), bounds.get(n)) for n in ("out", "dq", "dk", "dv")]
        other = ", ".join(
            f"{n} {_share(errors[n], bounds.get(n))}" for n in errors if n not in ("out", "dq", "dk", "dv")
        )
        verdict = "PASS" if row.get("passed") else f"FAIL {row.get('error', '')}".strip()
        lines.append(f"| {row['case']} | {row['dtype']} | {row.get('peer', '')} | {' | '.join(cells)} | {other} | "
                     f"{verdict} |")  # fmt: skip
    for failure in (data.get("fuzz") or {}).get("failed", [])[:10]:
        lines.append(
            f"\n- fuzz FAIL {failure['case']} {failure['dtype']}: {failure.get('error', failure.get('errors'))}"
        )
    if data.get("not_reached"):
        lines.append(f"\nNot reached in {data.get('seconds_bound')} s: {', '.join(data['not_reached'])}")
    lines.append("")
    return lines


def _share(error, bound) -> str:
    if error is None:
        return ""
    if not bound:
        return "exact" if error == 0 else f"{error:.2g} (exact required)"
    return f"{error / bound:.2f}"


def _warmup_section(data: dict) -> list:
    """``## Compiled ahead``: first-call seconds per kernel family from the warmup step."""
    if not data.get("families"):
        return []
    lines = [
        "## Compiled ahead",
        "",
        f"`flash-recipe warmup --for {data.get('step')}` on {data.get('device')}: {data.get('variants')} variants, "
        f"{data.get('sum_s')} s of first calls in {data.get('wall_s')} s wall with {data.get('jobs')} processes.",
        "",
        "| family | variants | first-call s (sum) | longest s |",
        "|---|---:|---:|---:|",
    ]
    for name, entry in sorted(data["families"].items()):
        lines.append(f"| {name} | {entry['variants']} | {entry['sum_s']:.1f} | {entry['max_s']:.2f} |")
    lines.append("")
    return lines


def write_report(report: dict, out: Path) -> None:
    write_json(str(out / "campaign.json"), report)
    (out / "campaign.md").write_text(render_markdown(report))


def timestamp() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def new_report(plan: list, command: str, dry_run: bool, minutes: Optional[float] = None) -> dict:
    return {
        "format": 1,
        "command": command,
        "dry_run": dry_run,
        "started": timestamp(),
        "finished": None,
        "flash_recipe": __version__,
        "budget_s": {
            "steps": sum(step.budget_s for step in plan if not step.skip),
            "total": TOTAL_BUDGET_S if minutes is None else minutes * 60,
        },
        "plan": [step.as_dict() for step in plan],
        "environment": None,
        "steps": {},
        "targets": [],
        "plots": {},
    }
