"""``flash-recipe doctor`` on a flash_attn that imports badly, as users meet it: real fake packages
on ``PYTHONPATH`` (no GPU needed), the doctor in a subprocess on this CPU-only torch.

- a ``flash_attn`` package with no dist-info (vendored, on PYTHONPATH, metadata removed) whose
  ``__init__`` raises the undefined-symbol ImportError a torch upgrade leaves behind;
- the same failure with dist-info present (an installed flash-attn built for another torch);
- a vendored ``flash_attn`` that imports, which is no failure.

On a CPU-only torch the doctor must never propose building flash-attn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SO = "/opt/venv/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so"
UNDEFINED = f"{SO}: undefined symbol: _ZN3c104cuda9SetDeviceEi"
RAISES = f"raise ImportError({UNDEFINED!r})\n"
# What a build proposal looks like; none of it may appear on a CPU-only torch.
BUILD_WORDS = ("--no-build-isolation", "FLASH_ATTENTION_FORCE_BUILD", "MAX_JOBS", "setup.py install")


def fake_flash_attn(root: Path, init: str, dist_info: bool = False, cuda_module: str | None = None) -> Path:
    """A ``flash_attn`` package under ``root``; with ``dist_info``, the metadata of flash-attn 2.8.3
    as pip leaves it; with ``cuda_module``, a ``flash_attn_2_cuda`` module with that source."""
    package = root / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    if cuda_module is not None:
        (root / "flash_attn_2_cuda.py").write_text(cuda_module)
    if dist_info:
        info = root / "flash_attn-2.8.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "WHEEL").write_text("Wheel-Version: 1.0\nTag: cp311-cp311-linux_x86_64\n")
        (info / "RECORD").write_text("flash_attn/__init__.py,,\nflash_attn_2_cuda.py,,\n")
    return package


def doctor(tmp_path: Path, path_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(path_dir)])
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "flash_recipe", "doctor", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def section(out: str, title: str) -> str:
    start = out.index(title + "\n")
    end = out.find("\n\n", start)
    return out[start : end if end != -1 else None]


def is_cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None and torch.version.hip is None


cpu_only = pytest.mark.skipif(not is_cpu_only_torch(), reason="the scenario is a CPU-only torch")


@cpu_only
def test_unowned_broken_flash_attn_is_an_error_with_its_error_location_and_fix(tmp_path):
    site = tmp_path / "vendored"
    package = fake_flash_attn(site, RAISES)
    proc = doctor(tmp_path, site)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    findings = section(out, "FINDINGS")
    assert "[error] flash-attn-unowned-module" in findings
    assert f"import flash_attn: ImportError: {UNDEFINED}" in findings  # verbatim
    assert f"finds {package}" in findings
    assert f"rm -rf {package}" in findings
    assert "install_as_flash_attn()" in findings
    # CPU-only torch: say why, give the CUDA torch, never a flash-attn build
    assert "flash-attn needs a CUDA build of torch" in findings
    assert "flash_recipe runs without one" in findings
    assert "--index-url https://download.pytorch.org/whl/cu" in findings
    assert not any(word in out for word in BUILD_WORDS), out
    # the upstream and backends sections tell the same story
    upstream = section(out, "UPSTREAM FLASH-ATTN")
    backends = section(out, "FLASH_RECIPE BACKENDS")
    assert "not installed" not in upstream and str(package) in upstream
    assert UNDEFINED in upstream and UNDEFINED in backends
    assert "flash_attn_2_cuda is not installed" not in backends


@cpu_only
def test_unowned_broken_flash_attn_in_json_and_for_each_installer(tmp_path):
    site = tmp_path / "vendored"
    fake_flash_attn(site, RAISES)
    report = json.loads(doctor(tmp_path, site, "--json").stdout)
    assert report["healthy"] is False
    (finding,) = [f for f in report["findings"] if f["rule"] == "flash-attn-unowned-module"]
    assert finding["evidence"][0] == f"import flash_attn: ImportError: {UNDEFINED}"
    fa = report["facts"]["flash_attn"]
    assert fa["installed"] is False and fa["module_location"] == str(site / "flash_attn")
    # the same facts, the fix written for the other installers
    from flash_recipe.env.rules import Context, evaluate

    for installer, torch_command in (
        ("uv", "uv pip install torch --index-url"),
        ("poetry", "poetry add --source pytorch torch"),
    ):
        found = evaluate(Context(facts=report["facts"], installer=installer, project=report["facts"]["project"]))
        (finding,) = [f for f in found if f.rule == "flash-attn-unowned-module"]
        assert torch_command in finding.command, finding.command
        assert not any(word in finding.command for word in BUILD_WORDS)


@cpu_only
def test_installed_flash_attn_for_another_torch_on_cpu_torch_proposes_no_build(tmp_path):
    """With dist-info the mismatch is diagnosed by the torch-version rule; its fix on a CPU-only torch
    is a CUDA torch, not a source build of flash-attn."""
    site = tmp_path / "site"
    fake_flash_attn(site, "import flash_attn_2_cuda\n", dist_info=True, cuda_module=RAISES)
    proc = doctor(tmp_path, site)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    findings = section(out, "FINDINGS")
    assert "torch-version-mismatch" in findings and UNDEFINED in findings
    assert "flash-attn-unowned-module" not in findings  # a distribution owns it
    assert "flash-attn needs a CUDA build of torch" in findings
    assert not any(word in out for word in BUILD_WORDS), out
    assert "2.8.3 installed by pip" in section(out, "UPSTREAM FLASH-ATTN")


@cpu_only
def test_a_flash_attention_source_tree_is_never_to_be_deleted(tmp_path):
    """Run inside a flash-attention clone: its unbuilt flash_attn imports first; the fix moves away from it."""
    clone = tmp_path / "flash-attention"
    fake_flash_attn(clone, "import flash_attn_2_cuda\n")
    (clone / "setup.py").write_text("")
    report = json.loads(doctor(tmp_path, clone, "--json").stdout)
    (finding,) = [f for f in report["findings"] if f["rule"] == "flash-attn-unowned-module"]
    assert "No module named 'flash_attn_2_cuda'" in finding["evidence"][0]
    assert f"{clone} is a source tree" in finding["evidence"][2]
    assert "rm -rf" not in finding["command"] and "outside the source tree" in finding["command"]


def test_vendored_flash_attn_that_imports_is_no_finding(tmp_path):
    site = tmp_path / "vendored"
    fake_flash_attn(site, "__version__ = '2.8.3'\n")
    report = json.loads(doctor(tmp_path, site, "--json").stdout)
    assert not [f for f in report["findings"] if f["rule"] == "flash-attn-unowned-module"]
    assert report["facts"]["flash_attn"]["package_error"] is None


# -- the flash-recipe install command: from the index only where it is there ---------------------------
@pytest.mark.parametrize(
    "release, expected",
    [
        (
            {"on_index": True, "checkout": "/src/flash-recipe", "repository": "https://example.org/fr"},
            {
                "pip": "python -m pip install flash-recipe",
                "uv": "uv add flash-recipe",
                "poetry": "poetry add flash-recipe",
            },
        ),
        (
            {"on_index": False, "checkout": "/src/flash-recipe", "repository": "https://example.org/fr"},
            {
                "pip": "python -m pip install /src/flash-recipe",
                "uv": "uv add /src/flash-recipe",
                "poetry": "poetry add /src/flash-recipe",
            },
        ),
        (
            {"on_index": None, "checkout": None, "repository": "https://example.org/fr"},
            {
                "pip": 'python -m pip install "flash-recipe @ git+https://example.org/fr"',
                "uv": 'uv add "flash-recipe @ git+https://example.org/fr"',
                "poetry": 'poetry add "git+https://example.org/fr"',
            },
        ),
    ],
    ids=["on-index", "checkout", "git"],
)
def test_install_command_takes_the_index_only_where_it_serves_flash_recipe(release, expected):
    from flash_recipe.env import commands

    for installer, command in expected.items():
        assert commands.install_flash_recipe(installer, release) == command


def test_repository_url_is_pyprojects():
    import re

    from flash_recipe.env import release

    text = (ROOT / "pyproject.toml").read_text()
    assert release.repository_url() == re.search(r'^Repository = "(.+)"', text, re.M).group(1)
    import flash_recipe

    from_checkout = Path(flash_recipe.__file__).resolve().parents[1] == ROOT
    assert release.checkout_dir() == (str(ROOT) if from_checkout else None)


@cpu_only
def test_readme_sample_is_the_doctors_output(tmp_path):
    """README's sample is this scenario's real FINDINGS section (the vendored copy at /tmp/demo/vendor)."""
    import re

    readme = (ROOT / "README.md").read_text()
    sample = re.search(r"```text\n(FINDINGS\n.*?)```", readme, re.S).group(1)
    site = tmp_path / "vendor"
    fake_flash_attn(site, RAISES)
    out = doctor(tmp_path, site).stdout.replace(str(site), "/tmp/demo/vendor")
    findings = section(out, "FINDINGS").splitlines()
    for line in sample.splitlines():
        assert line in findings, line
