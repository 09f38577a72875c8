"""``flash-recipe recipe``: the install recipe for this environment, ready to paste.

The installer (Poetry, uv or pip) is detected from the current project directory (lock files and
``[tool.poetry]`` / ``[tool.uv]`` tables) unless ``--installer`` names one. The recipe installs
torch from the index that matches this machine when torch is missing or is a CPU build on a GPU
machine, then flash-recipe; the name of the recipe folder under ``recipes/`` says where the full
story (and its failure modes) is written down.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from . import commands, probes, release
from .project import probe_project


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--installer", choices=commands.INSTALLERS, help="installer to write the recipe for (default: detected)"
    )
    parser.add_argument("--project", metavar="DIR", help="project directory to detect the installer from (default: .)")
    parser.add_argument("--json", action="store_true", help="print the recipe as one JSON object")


def recommend(facts: dict[str, Any], installer: Optional[str] = None) -> dict[str, Any]:
    """Choose the recipe for these probe facts; returns ``installer``, ``recipe``, ``why`` and ``steps``."""
    project = facts.get("project") or {}
    chosen = installer or project.get("installer") or "pip"
    if chosen not in commands.INSTALLERS:
        raise ValueError(f"installer must be one of {', '.join(commands.INSTALLERS)}, got {chosen!r}")
    torch = facts.get("torch") or {}
    gpus = facts.get("gpus") or {}
    has_gpu = bool(gpus.get("devices") or gpus.get("driver"))
    steps = []
    why = []
    if not torch.get("installed") or torch.get("import_error"):
        recipe = f"torch-index-{chosen}"
        why.append("torch is not installed: take it from the PyTorch index that matches this machine first")
        steps.append(commands.install_torch(facts, chosen))
    elif torch.get("build") == "cpu" and has_gpu:
        recipe = f"torch-index-{chosen}"
        why.append(f"torch {torch.get('version')} is a CPU build but this machine has an NVIDIA GPU")
        steps.append(commands.install_torch(facts, chosen))
    else:
        uv_recipe = "uv-project" if project.get("pyproject") else "uv-pip"
        recipe = {"pip": "torch-index-pip", "uv": uv_recipe, "poetry": "poetry-index"}[chosen]
        release = facts.get("release") if isinstance(facts.get("release"), dict) else {}
        if not release.get("on_index"):  # the recipe of the source the command takes
            if release.get("checkout") and chosen == "poetry":
                recipe = "poetry-path"
            elif release.get("repository") and not release.get("checkout"):
                recipe = {"pip": "pip-git", "poetry": "poetry-git"}.get(chosen, recipe)
        why.append(
            f"torch {torch.get('version')} ({torch.get('build', '?')} build) is already installed; "
            f"flash-recipe is pure Python"
        )
    release = facts.get("release") if isinstance(facts.get("release"), dict) else {}
    steps.append(commands.install_flash_recipe(chosen, release, uv_project=bool(project.get("pyproject"))))
    steps.append("flash-recipe doctor   # check the result")
    return {
        "installer": chosen,
        "installer_reason": project.get("installer_reason") if not installer else "named with --installer",
        "recipe": recipe,
        "why": why,
        "steps": steps,
    }


def run(args: argparse.Namespace) -> int:
    facts = {
        "torch": probes.run_probe("torch", probes.probe_torch),
        "gpus": probes.run_probe("gpus", probes.probe_gpus),
        "project": probes.run_probe("project", lambda: probe_project(args.project)),
        "release": probes.run_probe("release", release.probe_release),
    }
    result = recommend(facts, args.installer)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    lines = [
        f"# recipe: recipes/{result['recipe']}  (installer: {result['installer']}, {result['installer_reason']})",
        *(f"# {line}" for line in result["why"]),
        *result["steps"],
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
