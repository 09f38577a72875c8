"""The recipes: every install path has a folder whose README shows its script verbatim."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


from recipes.harness.paths import PATH_IDS, PATHS  # noqa: E402

# What the harness sets for every recipe (recipes/README.md documents them).
RECIPE_VARIABLES = {
    "PYTHON",
    "PYTHON_VERSION",
    "INDEX_URL",
    "TORCH_INDEX_URL",
    "TORCH_VERSION",
    "FLASH_RECIPE_VERSION",
    "SDIST",
    "CHECKOUT",
    "GIT_URL",
    "GIT_REV",
}

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
def test_script_uses_only_the_harness_variables(path):
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", path.script.read_text()))
    assert used <= RECIPE_VARIABLES, used - RECIPE_VARIABLES
    if path.needs_git:
        assert {"GIT_URL", "GIT_REV"} <= used
    if path.torch_from_torch_index:
        assert "TORCH_INDEX_URL" in used


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_script_uses_its_tool(path):
    script = path.script.read_text()
    command = {"pip": "-m pip install", "uv": "uv ", "poetry": "poetry "}[path.tool]
    assert command in script


def test_index_lists_every_path():
    index = (ROOT / "recipes" / "README.md").read_text()
    for path_id in PATH_IDS:
        assert f"({path_id}/README.md)" in index, path_id
