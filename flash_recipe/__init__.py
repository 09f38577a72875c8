"""flash_recipe: FlashAttention-2 in Triton behind flash-attn's and torch SDPA's APIs.

Public names::

    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func   # flash-attn 2 layout
    flash_attn_varlen_func (and its qkv/kv-packed forms), unpad_input, pad_input
    flash_attn_with_kvcache                                               # decoding over a KV cache
    scaled_dot_product_attention                                          # torch SDPA layout
    use_backend, explain, available_backends, BackendUnavailableError     # backend selection
    install_as_flash_attn                                                 # `import flash_attn` gives flash_recipe
    sageattn, sageattn_varlen                                             # 8-bit attention (inference)
    install_as_sageattention                                              # `import sageattention`: 8-bit attention

Importing this package selects, compiles and probes nothing, and does not even import torch:
each public name loads its module on first use (PEP 562), so ``flash-recipe doctor`` runs in an
environment whose torch is missing or broken.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:  # pyproject.toml states the version; the installed metadata carries it here
    __version__ = metadata.version("flash-recipe")
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "flash_attn_func": "flash_recipe.api",
    "flash_attn_kvpacked_func": "flash_recipe.api",
    "flash_attn_qkvpacked_func": "flash_recipe.api",
    "flash_attn_varlen_func": "flash_recipe.api",
    "flash_attn_varlen_kvpacked_func": "flash_recipe.api",
    "flash_attn_varlen_qkvpacked_func": "flash_recipe.api",
    "flash_attn_with_kvcache": "flash_recipe.decoding",
    "pad_input": "flash_recipe.padding",
    "unpad_input": "flash_recipe.padding",
    "scaled_dot_product_attention": "flash_recipe.api",
    "explain": "flash_recipe.api",
    "available_backends": "flash_recipe.dispatch",
    "use_backend": "flash_recipe.dispatch",
    "BackendUnavailableError": "flash_recipe.dispatch",
    "install_as_flash_attn": "flash_recipe.alias",
    "sageattn": "flash_recipe.sage",
    "sageattn_varlen": "flash_recipe.sage",
    "install_as_sageattention": "flash_recipe.alias",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from flash_recipe.alias import install_as_flash_attn, install_as_sageattention
    from flash_recipe.api import (
        explain,
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        scaled_dot_product_attention,
    )
    from flash_recipe.decoding import flash_attn_with_kvcache
    from flash_recipe.dispatch import BackendUnavailableError, available_backends, use_backend
    from flash_recipe.padding import pad_input, unpad_input
    from flash_recipe.sage import sageattn, sageattn_varlen


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flash_recipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
