"""The ``flash-recipe`` command line and the package version: the version is stated once (in
pyproject.toml) and read from the installed metadata; a subcommand that fails to import raises
its own error rather than a message that blames the version."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

import flash_recipe
from flash_recipe.tools import cli

ROOT = Path(__file__).resolve().parents[1]


def _declared_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert found, "pyproject.toml states no [project] version"
    return found.group(1)


def test_the_version_is_stated_once_in_pyproject():
    version = _declared_version()
    package = Path(flash_recipe.__file__).parent
    written = [
        p.name
        for p in package.rglob("*.py")
        if any(isinstance(n, ast.Constant) and n.value == version for n in ast.walk(ast.parse(p.read_bytes())))
    ]
    assert written == [], f"the version {version} is written in {written}; pyproject.toml alone states it"


def test_the_version_comes_from_the_installed_metadata():
    try:
        installed = metadata.version("flash-recipe")
    except metadata.PackageNotFoundError:
        assert flash_recipe.__version__ == "0+unknown"  # a source tree that was never installed
        return
    assert flash_recipe.__version__ == installed == _declared_version()


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flash-recipe {flash_recipe.__version__}"


def test_a_subcommand_whose_import_fails_raises_that_error(monkeypatch):
    """A subcommand's module that cannot be imported is a broken install or a bug: its own
    ModuleNotFoundError reaches the user, naming the module that is missing."""
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("flash_recipe.tools.broken_tool_missing", "a missing module"))
    monkeypatch.delitem(sys.modules, "flash_recipe.tools.broken_tool_missing", raising=False)
    with pytest.raises(ModuleNotFoundError, match="broken_tool_missing"):
        cli.main(["broken"])
