"""The install paths the matrix runs, and what each one must prove.

Every path is a folder ``recipes/<id>/`` with ``README.md`` and ``recipe.sh``. The recipe runs
with ``bash`` in an empty project directory (or, where ``project`` says ``checkout``, in a copy
of the repository) and leaves the environment it built in ``.venv`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipes.harness.config import RECIPES_DIR


@dataclass(frozen=True)
class RecipePath:
    id: str
    tool: str  # pip, uv or poetry: the tool that installs flash-recipe, named in INSTALLER
    summary: str
    # Where flash-recipe comes from, as the installed distribution records it (PEP 610):
    # "index" (no direct_url.json), "git" (the served repository at the tested commit), "file".
    source: str = "index"
    # The run's main index leaves torch out, so torch can only come from the torch index.
    torch_from_torch_index: bool = False
    needs_git: bool = False
    # "empty": an empty project directory; "checkout": a copy of the repository.
    project: str = "empty"
    editable: bool = False
    # Re-resolve the project's poetry.lock against the local index before the recipe runs
    # (see recipes/poetry-lock-dev/README.md).
    relock: bool = False

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
    RecipePath("poetry-index", "poetry", "poetry add from a package index"),
    RecipePath("poetry-path", "poetry", "poetry add from a local checkout", source="file"),
    RecipePath("poetry-git", "poetry", "poetry add git+<url>", source="git", needs_git=True),
    RecipePath(
        "pip-no-build-isolation",
        "pip",
        "pip install --no-build-isolation of the sdist",
        source="file",
    ),
    RecipePath("pip-git", "pip", "pip install git+<url>@<rev>", source="git", needs_git=True),
    RecipePath("uv-project", "uv", "uv add in a uv project"),
    RecipePath("uv-pip", "uv", "uv pip install into a plain venv"),
    RecipePath("pinned-torch-pip", "pip", "pip: a project that pins torch adds flash-recipe"),
    RecipePath(
        "torch-index-poetry",
        "poetry",
        "torch from its own index: Poetry explicit source",
        torch_from_torch_index=True,
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
        project="checkout",
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
