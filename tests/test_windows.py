"""flash-recipe's dependencies per platform: on Windows, Triton comes from triton-windows.

Triton publishes Linux wheels only. triton-windows, on PyPI, builds the same Triton releases for
Windows and installs the same ``triton`` module; pyproject.toml requires it under
``sys_platform == 'win32'``. These tests resolve the declared dependencies with uv for platforms
other than the one running them (``uv pip compile --python-platform``), and read poetry.lock:

- Windows gets triton-windows at a Triton release the kernels support (``TRITON_MIN``), never
  Linux's triton, and Python 3.9 gets the last release built for it;
- Linux gets triton and never triton-windows; macOS gets neither (torch SDPA runs there);
- a triton-windows older than ``TRITON_MIN`` does not satisfy the requirement;
- poetry.lock pins triton-windows for Windows only, and triton for Linux only.

Nothing runs on Windows here: this proves what an installer resolves, not that the kernels run.

The resolution is hermetic: uv reads a local directory of wheels only (``--no-index
--find-links``), none of the network. The Triton wheels in it are stand-ins that carry the name,
version, wheel tags and Requires-Python of real releases (``RELEASES``, as PyPI lists them) and no
code; torch and numpy are stand-ins without dependencies, since only flash-recipe's own
requirements are under test. Resolving against PyPI itself would make the suite depend on the
network and change its answer with every release; the README's Windows section gives that
resolution, run by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from flash_recipe.env import versions

ROOT = Path(__file__).resolve().parents[1]

WINDOWS = "x86_64-pc-windows-msvc"
LINUX = "x86_64-manylinux_2_28"
LINUX_ARM = "aarch64-manylinux_2_28"
MACOS = "aarch64-apple-darwin"


def _tags(pythons, platforms) -> list[str]:
    return [f"cp3{minor}-cp3{minor}-{platform}" for minor in pythons for platform in platforms]


MANYLINUX = ("manylinux_2_27_x86_64.manylinux_2_28_x86_64", "manylinux_2_27_aarch64.manylinux_2_28_aarch64")
# (name, version, Requires-Python, wheel tags) of real releases, as PyPI lists their files
# (https://pypi.org/pypi/triton-windows/json, https://pypi.org/pypi/triton/json; 2026-11-24).
RELEASES = [
    ("triton-windows", "3.8.0.post29", ">=3.10,<3.15", [
        *_tags([10], ["win_amd64"]), *_tags([11, 12, 13, 14], ["win_amd64", "win_arm64"])]),
    ("triton-windows", "3.4.0.post21", ">=3.9,<3.14", _tags([9, 10, 11, 12, 13], ["win_amd64"])),
    ("triton-windows", "3.1.0.post17", None, _tags([9, 10, 11, 12], ["win_amd64"])),
    ("triton", "3.7.1", ">=3.10,<3.15", _tags([10, 11, 12, 13, 14], MANYLINUX)),
]  # fmt: skip
STAND_INS = [("torch", "2.13.0"), ("numpy", "2.3.0")]  # py3-none-any, no dependencies


def _write_wheel(directory: Path, name: str, version: str, tag: str, requires_python=None) -> None:
    """A wheel holding only its dist-info: uv reads the metadata and the tags, nothing else."""
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires_python:
        metadata += f"Requires-Python: {requires_python}\n"
    python, abi, platforms = tag.split("-")
    tags = "".join(f"Tag: {python}-{abi}-{platform}\n" for platform in platforms.split("."))
    files = {
        f"{dist}.dist-info/METADATA": metadata,
        f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: flash-recipe tests\nRoot-Is-Purelib: false\n{tags}",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(directory / f"{dist}-{tag}.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


@pytest.fixture(scope="module")
def uv() -> str:
    """The uv of the test dependency group (``uv`` on PyPI ships the binary), or one on PATH."""
    try:
        from uv import find_uv_bin
    except ImportError:
        found = shutil.which("uv")
        if found is None:
            pytest.skip("uv is not installed (the test dependency group of pyproject.toml installs it)")
        return found
    return find_uv_bin()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("wheels")
    for name, version, requires_python, tags in RELEASES:
        for tag in tags:
            _write_wheel(directory, name, version, tag, requires_python)
    for name, version in STAND_INS:
        _write_wheel(directory, name, version, "py3-none-any")
    return directory


def _compile(uv: str, tmp_path: Path, wheels: Path, platform: str, python: str, source: Path) -> dict[str, str]:
    """``uv pip compile source`` for ``platform`` and Python ``python`` against ``wheels`` only:
    the resolved distributions as {name: version}."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("UV_")}
    env.update(UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_PYTHON_DOWNLOADS="never", NO_COLOR="1")
    command = [
        uv, "pip", "compile", str(source), "--no-config", "--no-index", "--find-links", str(wheels),
        "--python-platform", platform, "--python-version", python, "--no-header", "--no-annotate",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"uv pip compile failed for {platform}, Python {python}:\n{done.stderr}")
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", done.stdout, re.M))
    assert pins, f"uv printed no pins:\n{done.stdout}\n{done.stderr}"
    return pins


def _newest_windows_triton(python: str) -> str:
    """The newest triton-windows in RELEASES with a win_amd64 wheel for ``python``."""
    minor = python.replace(".", "")
    fits = [
        Version(version)
        for name, version, requires_python, tags in RELEASES
        if name == "triton-windows"
        and f"cp{minor}-cp{minor}-win_amd64" in tags
        and (requires_python is None or Version(python) in SpecifierSet(requires_python))
    ]
    return str(max(fits))


@pytest.mark.parametrize("python", ["3.12", "3.9"])
def test_windows_resolves_triton_windows(uv, wheels, tmp_path, python):
    pins = _compile(uv, tmp_path, wheels, WINDOWS, python, ROOT / "pyproject.toml")
    assert "triton" not in pins, pins
    assert pins.get("triton-windows") == _newest_windows_triton(python), pins
    assert Version(pins["triton-windows"]).release[:2] >= versions.TRITON_MIN
    assert {"torch", "numpy"} <= set(pins)


@pytest.mark.parametrize("platform", [LINUX, LINUX_ARM])
def test_linux_resolves_triton_and_not_triton_windows(uv, wheels, tmp_path, platform):
    pins = _compile(uv, tmp_path, wheels, platform, "3.12", ROOT / "pyproject.toml")
    assert "triton-windows" not in pins, pins
    assert pins.get("triton") == "3.7.1", pins


def test_macos_resolves_no_triton(uv, wheels, tmp_path):
    pins = _compile(uv, tmp_path, wheels, MACOS, "3.12", ROOT / "pyproject.toml")
    assert not {"triton", "triton-windows"} & set(pins), pins
    assert {"torch", "numpy"} <= set(pins)


def test_a_triton_windows_older_than_supported_is_refused(uv, wheels, tmp_path):
    """With only triton-windows 3.1 (Triton 3.1, below TRITON_MIN) to choose from, Windows does
    not resolve: the requirement's lower bound holds there too."""
    old = tmp_path / "old"
    old.mkdir()
    for wheel in wheels.iterdir():
        if not wheel.name.startswith("triton_windows-") or wheel.name.startswith("triton_windows-3.1."):
            shutil.copy(wheel, old)
    with pytest.raises(AssertionError, match="triton-windows"):
        _compile(uv, tmp_path, old, WINDOWS, "3.12", ROOT / "pyproject.toml")


def _platform_environments(python: str) -> dict[str, dict[str, str]]:
    base = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    return {
        "windows": {**base, "sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64"},
        "linux-x86_64": {**base, "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
        "linux-aarch64": {**base, "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64"},
        "macos": {**base, "sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
    }


def test_poetry_lock_pins_triton_windows_for_windows_only():
    """Every triton-windows entry of poetry.lock applies on Windows only, every triton entry on
    Linux only, and a Windows Python from 3.9 to 3.14 finds exactly one triton-windows."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    lock = tomllib.loads((ROOT / "poetry.lock").read_text(encoding="utf-8"))
    entries = {name: [p for p in lock["package"] if p["name"] == name] for name in ("triton-windows", "triton")}
    assert entries["triton-windows"], "poetry.lock has no triton-windows: run poetry lock"
    where = {"triton-windows": "windows", "triton": "linux"}
    for minor in range(9, 15):
        environments = _platform_environments(f"3.{minor}")
        for name, packages in entries.items():
            for platform, environment in environments.items():
                applies = [p["version"] for p in packages if Marker(p["markers"]).evaluate(environment)]
                if platform.startswith(where[name]):
                    assert len(applies) == 1, (name, platform, f"3.{minor}", applies)
                    assert Version(applies[0]).release[:2] >= versions.TRITON_MIN
                else:
                    assert applies == [], (name, platform, f"3.{minor}", applies)


def test_the_test_group_pins_the_harness_uv():
    """The uv these tests run is the one the install matrix runs (recipes/harness/config.py)."""
    from recipes.harness.config import TOOLS

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    test_group = re.search(r"^test = \[(.*)\]$", text, re.M).group(1)
    assert f'"uv=={TOOLS["uv"]}"' in test_group
