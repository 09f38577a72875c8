"""How an installed distribution got here: version, location, installer, editable or not.

Reads only the distribution's metadata files (PEP 376 ``INSTALLER``, PEP 610 ``direct_url.json``),
so it works for any package, installed or not, without importing it.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

from ..alias import INSTALLER
from .facts import LibrariesFacts

# The INSTALLER text of the metadata that a stand-in (``install_as_flash_attn()``,
# ``install_as_sageattention()``) answers in its own process.
STAND_IN_INSTALLER = INSTALLER


def distribution_info(name: str) -> dict[str, Any]:
    """Describe the installed distribution ``name``.

    Returns a dict with ``installed`` (bool; False, with ``stand_in`` True, for the stand-in's
    in-process metadata) and, when installed: ``version``, ``location`` (the
    site directory), ``installer`` (``pip``, ``uv``, ``poetry``, ... or None when unrecorded),
    ``editable`` (bool), ``direct_url`` (the PEP 610 URL or None) and ``vcs`` (the VCS info dict
    for git installs, or None).
    """
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return {"installed": False, "name": name}
    installer = (dist.read_text("INSTALLER") or "").strip() or None
    if installer == STAND_IN_INSTALLER:  # flash_recipe's in-process stand-in: nothing is installed
        return {"installed": False, "name": name, "stand_in": True}
    direct: dict[str, Any] = {}
    raw = dist.read_text("direct_url.json")
    if raw:
        try:
            direct = json.loads(raw)
        except ValueError:
            direct = {}
    location = getattr(dist, "_path", None)
    return {
        "installed": True,
        "name": dist.metadata["Name"],
        "version": dist.version,
        "location": str(location.parent) if location is not None else None,
        "installer": installer,
        "editable": bool(direct.get("dir_info", {}).get("editable", False)),
        "direct_url": direct.get("url"),
        "vcs": direct.get("vcs_info"),
    }


def probe_libraries() -> LibrariesFacts:
    """The ``libraries`` probe: the installed transformers and kernels (Hub kernels,
    ``attn_implementation="org/repo"``), from their metadata alone."""
    return {
        "transformers": distribution_info("transformers").get("version"),
        "kernels": distribution_info("kernels").get("version"),
    }
