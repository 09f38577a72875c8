"""The install paths the matrix runs, and what each one must prove.

Every path is a folder ``recipes/<id>/`` with ``README.md`` and ``recipe.sh``, the literal
commands a user types. The recipe runs with ``bash`` in the project directory that ``given``
names (prepared by the harness: ``workspace.prepare_given``) and leaves the environment it built
in ``.venv`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipes.harness.config import RECIPES_DIR

# What a recipe starts from, made by the harness before the recipe's first line:
GIVEN = {
    "nothing": "an empty directory",
    "poetry-project": "a Poetry project (`poetry init`) whose source is the package index",
    "pip-project-pinning-torch": "a `.venv` with torch installed from a requirements.txt that pins it",
    "checkout": "a clone of this repository",
}


@dataclass(frozen=True)
class RecipePath:
    id: str
    tool: str  # pip, uv or poetry: the tool that installs flash-recipe, named in INSTALLER
    summary: str
    # Where flash-recipe comes from, as the installed distribution records it (PEP 610):
    # "index" (no direct_url.json), "git" (the repository URL at the tested commit), "file".
    source: str = "index"
    # The run's main index leaves torch out, so torch can only come from the torch index.
    torch_from_torch_index: bool = False
    # What the user has before typing the recipe (one of GIVEN).
    given: str = "nothing"
    editable: bool = False
    # Re-resolve the project's poetry.lock against the local index before the recipe runs
    # (see recipes/poetry-lock-dev/README.md).
    relock: bool = False

    def __post_init__(self) -> None:
        if self.given not in GIVEN:
            raise ValueError(f"given must be one of {', '.join(GIVEN)}, got {self.given!r}")

    @property
    def folder(self) -> Path:
        return RECIPES_DIR / self.id

    @property
    def script(self) -> Path:
        return self.folder / "recipe.sh"

    @property
    def readme(self) -> Path:
        return self.folder / "README.md"


PATHS: tuple[RecipePath, ...] = (
    RecipePath("poetry-index", "poetry", "poetry add from a package index", given="poetry-project"),
    RecipePath("poetry-path", "poetry", "poetry add from a local clone", source="file", given="poetry-project"),
    RecipePath("poetry-git", "poetry", "poetry add git+<url>", source="git", given="poetry-project"),
    RecipePath("pip-no-build-isolation", "pip", "pip install --no-build-isolation of the sdist"),
    RecipePath("pip-git", "pip", "pip install git+<url>@<rev>", source="git"),
    RecipePath("uv-project", "uv", "uv add in a uv project"),
    RecipePath("uv-pip", "uv", "uv pip install into a plain venv"),
    RecipePath(
        "pinned-torch-pip",
        "pip",
        "pip: a project that pins torch adds flash-recipe",
        given="pip-project-pinning-torch",
    ),
    RecipePath(
        "torch-index-poetry",
        "poetry",
        "torch from its own index: Poetry explicit source",
        torch_from_torch_index=True,
        given="poetry-project",
    ),
    RecipePath(
        "torch-index-uv",
        "uv",
        "torch from its own index: uv explicit index",
        torch_from_torch_index=True,
    ),
    RecipePath(
        "torch-index-pip",
        "pip",
        "torch from its own index: pip, torch first",
        torch_from_torch_index=True,
    ),
    # The development environment installs the project itself in editable mode: that is what
    # `poetry install` does with the root project, and what a developer wants.
    RecipePath(
        "poetry-lock-dev",
        "poetry",
        "poetry install from poetry.lock (development)",
        source="file",
        given="checkout",
        editable=True,
        relock=True,
    ),
)

PATH_IDS: tuple[str, ...] = tuple(p.id for p in PATHS)


def get(path_id: str) -> RecipePath:
    for path in PATHS:
        if path.id == path_id:
            return path
    raise ValueError(f"unknown install path {path_id!r}; known: {', '.join(PATH_IDS)}")
