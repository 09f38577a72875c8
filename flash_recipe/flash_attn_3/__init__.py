"""The stand-in for FlashAttention-3 (``flash_attn_3`` 3.0.0, Dao-AILab/flash-attention's
``hopper/``) that ``flash_recipe.install_as_flash_attn_3()`` installs.

FA3 installs three top-level modules: ``flash_attn_3`` (this package: ``__version__``),
``flash_attn_interface`` (its functions: ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_with_kvcache``) and ``flash_attn_config`` (its build
flags). After ``install_as_flash_attn_3()`` each resolves to the module here of the same name, and
``flash_attn_3.flash_attn_interface`` and ``flash_attn_3.flash_attn_config`` to the same modules.
Importing it installs nothing.
"""

from __future__ import annotations

# The FA3 release whose API this stand-in provides.
__version__ = "3.0.0"
# Marks the stand-in, so that flash_recipe never mistakes it for upstream FA3.
__flash_recipe__ = True

__all__ = ["__version__"]


def __getattr__(name: str):
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn_3", name, ("flash_attn_interface", "flash_attn_config", "__version__"))
