"""The recipes: every install path has a folder whose README shows its script verbatim."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


from recipes.harness import public_hosts  # noqa: E402
from recipes.harness.paths import PATH_IDS, PATHS  # noqa: E402

FENCE = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)


def test_path_ids_are_the_folders():
    folders = {p.name for p in (ROOT / "recipes").iterdir() if (p / "recipe.sh").exists()}
    assert folders == set(PATH_IDS)
    assert len(PATH_IDS) == 12


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_readme_shows_the_script_verbatim(path):
    script = path.script.read_text()
    blocks = FENCE.findall(path.readme.read_text())
    assert script in blocks, f"{path.readme} has no ```bash block identical to {path.script}"


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_script_is_strict_bash(path):
    script = path.script.read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in script
    subprocess.run(["bash", "-n", str(path.script)], check=True)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_script_is_literal(path):
    """What a user types: no variable, no placeholder; the URLs are the real ones."""
    script = path.script.read_text()
    assert "$" not in script and "<" not in script.replace("<<'TOML'", ""), script
    for url in re.findall(r"https://[^\s\"'#@]+", script):
        assert url.startswith((public_hosts.REPOSITORY_URL, "https://download.pytorch.org/whl/")), url
    if path.torch_from_torch_index:
        assert "https://download.pytorch.org/whl/cpu" in script


def test_the_repository_url_is_pyprojects():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nRepository = "{public_hosts.REPOSITORY_URL}"\n' in pyproject


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_script_uses_its_tool(path):
    script = path.script.read_text()
    command = {"pip": "-m pip install", "uv": "uv ", "poetry": "poetry "}[path.tool]
    assert command in script


def test_index_lists_every_path():
    index = (ROOT / "recipes" / "README.md").read_text()
    for path_id in PATH_IDS:
        assert f"({path_id}/README.md)" in index, path_id
