"""The user's project, read from its files: which installer manages it, whether it declares
flash-attn (and, for uv, a build setting for it), and the index it takes torch from. The doctor's
``project`` facts (:class:`~flash_recipe.env.facts.ProjectFacts`); nothing here imports torch."""

from __future__ import annotations

import os
import re
from typing import Optional

from .facts import ProjectFacts, TorchIndex


def probe_project(directory: Optional[str] = None) -> ProjectFacts:
    """The project in ``directory`` (default: the current one): which installer manages it and
    whether it declares flash-attn (and, for uv, a build setting for it)."""
    root = os.path.abspath(directory or os.getcwd())
    path = os.path.join(root, "pyproject.toml")
    text = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    exists = lambda name: os.path.exists(os.path.join(root, name))  # noqa: E731
    if exists("poetry.lock") or "[tool.poetry" in text or "poetry.core.masonry" in text:
        installer, why = "poetry", "poetry.lock or [tool.poetry] in pyproject.toml"
    elif exists("uv.lock") or "[tool.uv" in text:
        installer, why = "uv", "uv.lock or [tool.uv] in pyproject.toml"
    elif os.environ.get("UV") or (os.environ.get("VIRTUAL_ENV") and exists(".venv") and exists("uv.lock")):
        installer, why = "uv", "running under uv"
    else:
        installer, why = "pip", "no Poetry or uv project files here"
    declares = _declares_flash_attn(text)
    uv_config = bool(re.search(r"no-build-isolation-package\s*=\s*\[[^\]]*flash[-_]attn", text)) or bool(
        re.search(r"extra-build-dependencies\][^\[]*flash[-_]attn", text, re.DOTALL)
    )
    return {
        "directory": root,
        "pyproject": os.path.isfile(path),
        "installer": installer,
        "installer_reason": why,
        "declares_flash_attn": declares,
        "uv_flash_attn_build_config": uv_config,
        "torch_index": _torch_index(text),
    }


def _torch_index(text: str) -> Optional[TorchIndex]:
    """The package index this pyproject.toml takes torch from: ``{"name", "url", "pinned"}`` of the uv index
    or Poetry source that ``[tool.uv.sources]`` / ``[tool.poetry.dependencies]`` names for torch,
    else of one on download.pytorch.org; None when there is none (or no TOML parser). Credentials
    in the URL are dropped."""
    if not text:
        return None
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        return None
    try:
        tool = tomllib.loads(text).get("tool", {})
    except ValueError:
        return None
    uv, poetry = tool.get("uv", {}), tool.get("poetry", {})
    declared = list(uv.get("index", [])) + list(poetry.get("source", []))
    indexes = [i for i in declared if isinstance(i, dict) and i.get("url")]
    wanted = set()
    sources = uv.get("sources", {}).get("torch")
    for entry in sources if isinstance(sources, list) else [sources]:
        if isinstance(entry, dict) and entry.get("index"):
            wanted.add(entry["index"])
    dep = poetry.get("dependencies", {}).get("torch")
    for entry in dep if isinstance(dep, list) else [dep]:
        if isinstance(entry, dict) and entry.get("source"):
            wanted.add(entry["source"])
    chosen = next((i for i in indexes if i.get("name") in wanted), None)
    pinned = chosen is not None
    chosen = chosen or next((i for i in indexes if "download.pytorch.org" in str(i["url"])), None)
    if chosen is None:
        return None
    url = re.sub(r"^(\w+://)[^/@]*@", r"\1", str(chosen["url"]))
    # pinned: torch names this index (uv sources / Poetry source), so a plain `add` keeps it there
    return {"name": str(chosen.get("name") or "pytorch"), "url": url, "pinned": pinned}


_REQ_NAME = re.compile(r"^\s*flash[-_]attn\s*($|[\[<>=!~;@ (])", re.IGNORECASE)


def _declares_flash_attn(text: str) -> bool:
    """Does this pyproject.toml list flash-attn as a dependency (any table Poetry, uv or PEP 621 use)?"""
    if not text:
        return False
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        tomllib = None
    if tomllib is None:
        # no TOML parser: a requirement string or a Poetry key that starts with the name
        return bool(re.search(r"""^\s*(["']flash[-_]attn\b|flash[-_]attn\s*=)""", text, re.MULTILINE | re.IGNORECASE))
    try:
        data = tomllib.loads(text)
    except ValueError:
        return False
    project = data.get("project", {})
    requirements = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        requirements += group
    for group in data.get("dependency-groups", {}).values():
        requirements += [r for r in group if isinstance(r, str)]
    poetry = data.get("tool", {}).get("poetry", {})
    keys = list(poetry.get("dependencies", {}))
    for group in poetry.get("group", {}).values():
        keys += list(group.get("dependencies", {}))
    return any(_REQ_NAME.match(r) for r in requirements) or any(re.fullmatch(r"flash[-_]attn", k, re.I) for k in keys)
