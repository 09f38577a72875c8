"""Options of an install-matrix run and where its files live."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"

# The official torch indexes, by the shorthand the options accept.
TORCH_INDEXES = {
    "cpu": "https://download.pytorch.org/whl/cpu",
    "cu126": "https://download.pytorch.org/whl/cu126",
    "cu128": "https://download.pytorch.org/whl/cu128",
    "cu130": "https://download.pytorch.org/whl/cu130",
}
# "Whatever pip's own configuration serves" (pip.conf, PIP_* variables).
PIP_CONFIG = "pip-config"

DEFAULT_TORCH_INDEX = PIP_CONFIG
DEFAULT_TORCH_VERSION = "2.13.0"

# The tools a run installs into its own cached environment. Pinned, so that a run on a fresh
# machine uses the versions the matrix was last checked with.
TOOLS = {
    "poetry": "2.5.1",
    "uv": "0.13.9",
    "pypiserver": "2.4.2",
    "waitress": "3.0.2",
    "passlib": "1.7.4",  # pypiserver's htpasswd reader: uploads need the run's password
    "build": "1.6.1",
}

_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$")


def torch_index_url(value: str) -> str | None:
    """The URL for a ``--torch-index`` value, or None for ``pip-config``.

    >>> torch_index_url("cu128")
    'https://download.pytorch.org/whl/cu128'
    """
    if value == PIP_CONFIG:
        return None
    if value in TORCH_INDEXES:
        return TORCH_INDEXES[value]
    if re.match(r"^(https?|file)://", value):
        return value.rstrip("/")
    allowed = ", ".join([PIP_CONFIG, *TORCH_INDEXES])
    raise ValueError(f"torch index must be one of {allowed} or a URL, got {value!r}")


def slug(text: str) -> str:
    """A file-name-safe form of ``text`` that stays readable and unique."""
    readable = re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:40]
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def default_python() -> str:
    """The base interpreter (not a virtualenv's) of the Python running the harness."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLASH_RECIPE_MATRIX_CACHE") or REPO_ROOT / ".nox" / "install-matrix")


@dataclass(frozen=True)
class Options:
    torch_index: str = DEFAULT_TORCH_INDEX
    torch_version: str = DEFAULT_TORCH_VERSION
    python: str = field(default_factory=default_python)
    cache_dir: Path = field(default_factory=default_cache_dir)
    report_dir: Path = REPO_ROOT
    keep: bool = False
    triton_interpret: str = "auto"
    source: str = "worktree"

    def __post_init__(self) -> None:
        torch_index_url(self.torch_index)  # validates
        if not _VERSION_RE.match(self.torch_version):
            raise ValueError(f"torch version must look like 2.13.0, got {self.torch_version!r}")
        if self.triton_interpret not in ("auto", "0", "1"):
            raise ValueError(f"--triton-interpret must be auto, 0 or 1, got {self.triton_interpret!r}")

    @property
    def torch_index_url(self) -> str | None:
        return torch_index_url(self.torch_index)

    @property
    def wheelhouse_key(self) -> str:
        """One wheelhouse per (torch version, torch index, interpreter)."""
        return slug(f"torch-{self.torch_version}-{self.torch_index}-{self.python}")


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every harness command shares; environment variables give the defaults."""
    env = os.environ.get
    parser.add_argument(
        "--torch-index",
        default=env("FLASH_RECIPE_TORCH_INDEX", DEFAULT_TORCH_INDEX),
        help=f"where torch comes from: {PIP_CONFIG} (pip's configuration), "
        f"{', '.join(TORCH_INDEXES)} (the official torch indexes) or a URL "
        "(default: %(default)s; env FLASH_RECIPE_TORCH_INDEX)",
    )
    parser.add_argument(
        "--torch-version",
        default=env("FLASH_RECIPE_TORCH_VERSION", DEFAULT_TORCH_VERSION),
        help="torch release under test (default: %(default)s; env FLASH_RECIPE_TORCH_VERSION)",
    )
    parser.add_argument(
        "--python",
        default=env("FLASH_RECIPE_MATRIX_PYTHON") or default_python(),
        help="interpreter every path builds its environment from (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="tools, wheelhouse, builds and run logs (default: %(default)s; env FLASH_RECIPE_MATRIX_CACHE)",
    )
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=REPO_ROOT,
        help="where install-matrix.md and install-matrix.json go (default: the repository root)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each path's directory and environment instead of removing it once verified",
    )
    parser.add_argument(
        "--triton-interpret",
        default=env("FLASH_RECIPE_TRITON_INTERPRET", "auto"),
        choices=["auto", "0", "1"],
        help="run verify with TRITON_INTERPRET=1: auto means when no GPU is visible (default: %(default)s)",
    )


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        default=os.environ.get("FLASH_RECIPE_MATRIX_SOURCE", "worktree"),
        help="what to build and install: the working tree as it is (tracked and untracked files, "
        "not ignored ones), or a git revision such as HEAD (default: %(default)s)",
    )


def options_from_args(args: argparse.Namespace) -> Options:
    return Options(
        torch_index=args.torch_index,
        torch_version=args.torch_version,
        python=args.python,
        cache_dir=args.cache_dir.resolve(),
        report_dir=args.report_dir.resolve(),
        keep=args.keep,
        triton_interpret=args.triton_interpret,
        source=getattr(args, "source", "worktree"),
    )
