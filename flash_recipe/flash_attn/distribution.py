"""Distribution metadata for the stand-in, in this process only.

Libraries decide at import time whether flash-attn is usable by asking ``importlib.metadata``
(diffusers: ``importlib.metadata.version("flash_attn") >= "2.6.3"``; transformers:
``is_flash_attn_2_available()``). The stand-in has no files on disk, so without help they answer
"not installed". ``install_as_flash_attn()`` puts ``FINDER`` on ``sys.meta_path``: while the
stand-in is installed, ``importlib.metadata.distribution("flash-attn")`` (any spelling:
``flash_attn``, ``Flash-Attn``) and ``importlib.metadata.distributions()`` give a
``StandInDistribution`` whose METADATA says ``Name: flash-attn`` and the stand-in's version.

Nothing is written to disk: other processes (``pip list``, ``pip check``, a new interpreter) still
see no flash-attn. To tell the stand-in from a real install, ``is_stand_in(dist)`` is True for
it: its ``INSTALLER`` file reads ``INSTALLER`` below (a real install reads ``pip``, ``uv``, ...).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

NAME = "flash-attn"
MODULE = "flash_attn"  # the stand-in, once installed, is this module of sys.modules
INSTALLER = "flash-recipe-stand-in"  # the INSTALLER text that marks the stand-in's metadata


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class StandInDistribution(importlib.metadata.Distribution):
    """flash-attn's metadata, answered from memory for flash_recipe's stand-in."""

    def read_text(self, filename):
        __version__ = getattr(sys.modules.get(MODULE), "__version__", "")
        files = {
            "METADATA": (
                f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {__version__}\n"
                "Summary: flash_recipe's in-process stand-in for flash-attn (install_as_flash_attn)\n"
            ),
            "INSTALLER": INSTALLER + "\n",
            "top_level.txt": "flash_attn\n",
        }
        return files.get(str(filename))

    def locate_file(self, path):
        return Path(__file__).parent / path


def is_stand_in(dist: importlib.metadata.Distribution) -> bool:
    """Whether ``dist`` is the stand-in's in-memory metadata (not an install on disk)."""
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


class _Finder(importlib.metadata.DistributionFinder):
    """Answers for flash-attn while the stand-in is installed; finds no modules."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        context = context if context is not None else importlib.metadata.DistributionFinder.Context()
        if not getattr(sys.modules.get(MODULE), "__flash_recipe__", False):  # the stand-in is not installed
            return iter(())
        if context.name is not None and _normalized(context.name) != NAME:
            return iter(())
        return iter((StandInDistribution(),))


FINDER = _Finder()
