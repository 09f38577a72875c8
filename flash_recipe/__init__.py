"""flash_recipe: FlashAttention-2 in Triton behind flash-attn's and torch SDPA's APIs.

Public names::

    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func   # flash-attn 2 layout
    flash_attn_varlen_func (and its qkv/kv-packed forms), unpad_input, pad_input
    flash_attn_with_kvcache                                               # decoding over a KV cache
    scaled_dot_product_attention                                          # torch SDPA layout
    use_backend, explain, available_backends, BackendUnavailableError     # backend selection
    install_as_flash_attn                                                 # `import flash_attn` gives flash_recipe
    install_as_flash_attn_3                                               # FlashAttention-3's API
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


def _version() -> str:
    """The release: a Hub copy, imported under its build's id, records the one it was built from
    (``_hub.py``, written by ``flash-recipe hub-build``); the wheel's comes from its installed
    metadata (pyproject.toml)."""
    if __name__ != "flash_recipe":
        return str(importlib.import_module("._hub", __name__).__version__)
    try:
        return metadata.version("flash-recipe")
    except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _version()

_EXPORTS = {
    "flash_attn_func": ".api",
    "flash_attn_kvpacked_func": ".api",
    "flash_attn_qkvpacked_func": ".api",
    "flash_attn_varlen_func": ".api",
    "flash_attn_varlen_kvpacked_func": ".api",
    "flash_attn_varlen_qkvpacked_func": ".api",
    "flash_attn_with_kvcache": ".decoding",
    "pad_input": ".padding",
    "unpad_input": ".padding",
    "scaled_dot_product_attention": ".api",
    "explain": ".api",
    "available_backends": ".dispatch",
    "use_backend": ".dispatch",
    "BackendUnavailableError": ".dispatch",
    "install_as_flash_attn": ".alias",
    "install_as_flash_attn_3": ".alias",
    "sageattn": ".sage",
    "sageattn_varlen": ".sage",
    "install_as_sageattention": ".alias",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from .alias import install_as_flash_attn, install_as_flash_attn_3, install_as_sageattention
    from .api import (
        explain,
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        scaled_dot_product_attention,
    )
    from .decoding import flash_attn_with_kvcache
    from .dispatch import BackendUnavailableError, available_backends, use_backend
    from .padding import pad_input, unpad_input
    from .sage import sageattn, sageattn_varlen


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
