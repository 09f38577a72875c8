"""The matrix report: one row per path, as a terminal table, Markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

COLUMNS = (
    ("path", "path"),
    ("tool", "tool"),
    ("install s", "install_s"),
    ("verify s", "verify_s"),
    ("env MB", "env_mb"),
    ("torch", "torch"),
    ("triton", "triton"),
    ("backend", "backend"),
    ("verify", "passed"),
    ("fingerprint", "fingerprint"),
)


def fingerprint_problems(rows: Sequence[dict]) -> list[str]:
    """Problems with the fingerprints: a path that printed none, or paths that disagree."""
    problems = []
    seen: dict[str, list[str]] = {}
    for row in rows:
        if row.get("fingerprint"):
            seen.setdefault(row["fingerprint"], []).append(row["path"])
        else:
            problems.append(f"{row['path']}: no fingerprint")
    if len(seen) > 1:
        groups = "; ".join(f"{fp[:12]}: {', '.join(paths)}" for fp, paths in seen.items())
        problems.append(f"fingerprints differ across paths: {groups}")
    return problems


def cell(row: dict, key: str, short: bool = True) -> str:
    value = row.get(key)
    if key == "tool":
        return f"{row['tool']} {row.get('tool_version') or ''}".strip()
    if key == "passed":
        return "pass" if value else "FAIL"
    if key == "fingerprint" and value and short:
        return value[:12]
    if value is None or value == "":
        return "-"
    return str(value)


def table(rows: Sequence[dict], markdown: bool = False) -> str:
    headers = [title for title, _ in COLUMNS]
    body = [[cell(row, key) for _, key in COLUMNS] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in body]
    return "\n".join(lines)


def failures(row: dict) -> list[str]:
    out = [row["error"]] if row.get("error") else []
    out += [f"{c['name']}: {c['detail']}" for c in row.get("checks", []) if not c["ok"]]
    return out


def summarize(rows: Sequence[dict], meta: dict) -> dict:
    problems = fingerprint_problems(rows)
    for row in rows:
        problems += [f"{row['path']}: {text}" for text in failures(row)]
    return {**meta, "passed": bool(rows) and not problems, "problems": problems, "paths": list(rows)}


def markdown(summary: dict) -> str:
    rows = summary["paths"]
    lines = [
        "# Install matrix",
        "",
        f"torch {summary.get('torch_version')} from `{summary.get('torch_index')}`, "
        f"Python {summary.get('python_version')}, flash-recipe {summary.get('flash_recipe_version')} "
        f"at `{(summary.get('rev') or '')[:12]}`; verify with TRITON_INTERPRET={summary.get('triton_interpret')}.",
        "",
        table(rows, markdown=True),
        "",
        f"Result: **{'pass' if summary['passed'] else 'FAIL'}**",
    ]
    if summary["problems"]:
        lines += ["", "Problems:", ""] + [f"- {p}" for p in summary["problems"]]
    fingerprints = {r["fingerprint"] for r in rows if r.get("fingerprint")}
    if len(fingerprints) == 1:
        lines += ["", f"Fingerprint (all paths): `{fingerprints.pop()}`"]
    return "\n".join(lines) + "\n"


def write(summary: dict, report_dir: Path) -> tuple[Path, Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = report_dir / "install-matrix.md", report_dir / "install-matrix.json"
    md_path.write_text(markdown(summary))
    json_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return md_path, json_path
