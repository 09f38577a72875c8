"""``install_as_flash_attn()``: let code that imports ``flash_attn`` run on flash_recipe.

Many libraries import flash-attn by name (ring-flash-attn, yunchang, ColossalAI, Unsloth, ...).
After ``install_as_flash_attn()`` these imports resolve to ``flash_recipe.flash_attn``, the way
``pymysql.install_as_MySQLdb()`` stands in for MySQLdb::

    flash_attn                       -> flash_recipe.flash_attn (``__version__`` "2.8.3")
    flash_attn.flash_attn_interface  -> public and internal functions (``_flash_attn_forward``, ...)
    flash_attn.bert_padding          -> unpad_input, pad_input, index_first_axis, index_put_first_axis
    flash_attn.layers.rotary         -> apply_rotary_emb

Any other ``flash_attn`` module or name raises ImportError (AttributeError for an attribute)
naming what is missing and what is provided. While it is installed, ``importlib.metadata`` answers
for flash-attn in this process (``flash_recipe.flash_attn.distribution``; nothing on disk), so
libraries that check the version at import time (diffusers, transformers) see it: install the
stand-in before importing them. A working upstream flash-attn is never shadowed
unless ``force=True``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

PACKAGE = "flash_attn"  # the name code imports
STAND_IN = "flash_recipe.flash_attn"
# The modules the stand-in provides, by the names code imports.
PROVIDED = (
    "flash_attn",
    "flash_attn.flash_attn_interface",
    "flash_attn.bert_padding",
    "flash_attn.layers",
    "flash_attn.layers.rotary",
)


def missing(module: str, name: str, provided) -> AttributeError:
    """The error for a name the stand-in's ``module`` does not have (``from module import name``
    turns it into an ImportError naming ``name``)."""
    if name.startswith("__") and name.endswith("__"):  # Python's own probes (__path__, __file__, ...)
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(
        f"flash_recipe's stand-in for flash-attn does not provide {module}.{name}; {module} provides: "
        f"{', '.join(sorted(provided))} (install the flash-attn package for the rest)"
    )


class _MissingModules(importlib.abc.MetaPathFinder):
    """Raises a clear ImportError for a ``flash_attn.*`` module the stand-in does not provide."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(PACKAGE + ".") and is_installed():
            raise ModuleNotFoundError(
                f"flash_recipe's stand-in for flash-attn does not provide the module {fullname}; "
                f"it provides {', '.join(PROVIDED)} (install the flash-attn package for the rest)",
                name=fullname,
            )
        return None


_FINDER = _MissingModules()


def is_installed() -> bool:
    """Whether ``import flash_attn`` gives flash_recipe's stand-in in this process."""
    return getattr(sys.modules.get(PACKAGE), "__flash_recipe__", False)


def _upstream_problem() -> tuple:
    """``(found, error)``: whether a flash_attn other than the stand-in is installed, and why it
    fails to import (None if it imports)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return False, None
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:  # a broken build raises anything from ImportError to OSError
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


def install_as_flash_attn(force: bool = False) -> bool:
    """Make ``import flash_attn`` and the modules in ``PROVIDED`` resolve to flash_recipe.

    Arguments:
        force: install even when an upstream flash-attn imports and works; modules of it already
            imported in this process are replaced for later imports (objects taken from them
            before stay what they are).

    Returns:
        True when the stand-in is installed (now or before); False when a working upstream
        flash-attn was found and left in place (a warning says so).

    Call it before the imports of the library that needs flash-attn. It affects this process only.
    """
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__}")
    if is_installed():
        return True
    if not force:
        found, error = _upstream_problem()
        if found and error is None:
            version = getattr(sys.modules.get(PACKAGE), "__version__", "?")
            warnings.warn(
                f"flash-attn {version} is installed and imports; install_as_flash_attn() leaves it in place "
                "(force=True replaces it in this process)",
                stacklevel=2,
            )
            return False
        if found:
            warnings.warn(
                f"flash-attn is installed but fails to import ({error}); flash_recipe stands in for it", stacklevel=2
            )
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    for name in PROVIDED:
        sys.modules[name] = importlib.import_module(STAND_IN + name[len(PACKAGE) :])
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    metadata = importlib.import_module(STAND_IN + ".distribution").FINDER  # the stand-in's metadata finder
    if metadata not in sys.meta_path:
        sys.meta_path.insert(0, metadata)
    return True
