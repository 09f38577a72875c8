"""The project's own files agree with each other: the pre-commit hook runs the ruff release that
``nox -s lint`` installs (pyproject.toml's ``lint`` dependency group)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pinned(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    group = re.search(r"^lint = \[(.*?)\]$", text, re.M | re.S)  # one line or several
    assert group, "pyproject.toml has no `lint` dependency group"
    found = re.search(rf'"{re.escape(name)}==([^";\s]+)[";]', group.group(1))  # before any marker
    assert found, f"the lint group does not pin {name}"
    return found.group(1)


def test_pre_commit_runs_the_ruff_that_lint_pins():
    config = (ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    revisions = re.findall(r"repo: https://github.com/astral-sh/ruff-pre-commit\s+rev: v(\S+)", config)
    assert revisions == [_pinned("ruff")], revisions


def test_the_lint_group_pin_is_read():
    """The reader above finds what it should (so the comparison cannot pass on two misses)."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", _pinned("ruff"))
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", _pinned("import-linter"))
