"""The stand-in for the ``flash_attn`` package that ``flash_recipe.install_as_flash_attn()`` installs.

After ``install_as_flash_attn()``, ``import flash_attn`` gives this module and
``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding`` and ``flash_attn.layers.rotary``
give the modules beside it: flash-attn 2.8.3's functions, by the same names and arguments,
computed by flash_recipe's backends. Importing it installs nothing.
"""

from __future__ import annotations

from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# The flash-attn release whose API this stand-in provides: version checks read it
# (``flash_attn.__version__ >= "2.1"`` and the like).
__version__ = "2.8.3"
# Marks the stand-in, so that flash_recipe never mistakes it for upstream flash-attn.
__flash_recipe__ = True

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def __getattr__(name: str):
    # A subpackage another distribution installs beside the stand-in (flash-attn-4's ``flash_attn.cute``,
    # found by ``alias._MissingModules``) is bound here under the name code imports it by: Python binds
    # it under this module's own name (flash_recipe.flash_attn), so ``import flash_attn.cute.x as y``
    # inside it would not find it.
    import sys  # not at the top, where `sys` would become a name of the stand-in

    found = sys.modules.get(f"flash_attn.{name}")
    if found is not None and not name.startswith("__"):
        return found
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn", name, __all__)
