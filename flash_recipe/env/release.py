"""Where flash-recipe can be installed from, for the install commands the doctor and
``flash-recipe recipe`` print: the package index (only where the configured index has it), the
git repository, or the local checkout this flash_recipe runs from.

The repository URL is written once, as ``Repository`` in ``[project.urls]`` of pyproject.toml;
an installed flash-recipe carries it in its metadata (``Project-URL``), a checkout in that file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from typing import Optional

from .facts import ReleaseFacts

DISTRIBUTION = "flash-recipe"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_dir() -> Optional[str]:
    """The flash-recipe checkout this flash_recipe is imported from (a PYTHONPATH or editable
    install of a source tree), or None for an installed wheel."""
    root = os.path.dirname(_PACKAGE_DIR)
    pyproject = os.path.join(root, "pyproject.toml")
    if not os.path.isfile(pyproject):
        return None
    with open(pyproject, encoding="utf-8") as handle:
        text = handle.read()
    return root if re.search(r'^name\s*=\s*"flash-recipe"', text, re.MULTILINE) else None


def repository_url() -> Optional[str]:
    """``Repository`` of ``[project.urls]``: from the checkout's pyproject.toml when running from
    one, else from the installed distribution's metadata; None when neither says."""
    root = checkout_dir()
    if root is not None:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as handle:
            match = re.search(r'^Repository\s*=\s*"([^"]+)"', handle.read(), re.MULTILINE)
        if match:
            return match.group(1)
    try:
        urls = metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository":
            return url.strip()
    return None


def on_index(timeout: float = 20.0) -> tuple[Optional[bool], Optional[str]]:
    """Whether the index pip is configured with (pip.conf, ``PIP_INDEX_URL``) serves flash-recipe:
    ``(True, None)``, ``(False, None)``, or ``(None, why it could not be asked)``."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", DISTRIBUTION, "--retries", "0", "--timeout", "10"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    text = proc.stdout + proc.stderr
    if proc.returncode == 0 and re.search(rf"^{DISTRIBUTION} \(", proc.stdout, re.MULTILINE):
        return True, None
    if "No matching distribution found" in text:
        return False, None
    if "No module named pip" in text:
        return None, "pip is not installed in this environment"
    return None, (text.strip().splitlines() or [f"pip exited with status {proc.returncode}"])[-1][:240]


def probe_release() -> ReleaseFacts:
    """Where flash-recipe can come from here: ``repository``, ``checkout``, ``on_index``."""
    found, error = on_index()
    out: ReleaseFacts = {"repository": repository_url(), "checkout": checkout_dir(), "on_index": found}
    if error:
        out["index_error"] = error
    return out
