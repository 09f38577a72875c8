"""flash_recipe: FlashAttention-2 in Triton behind flash-attn's and torch SDPA's APIs.

Importing this package selects, compiles and probes nothing: backends are chosen per call.

Public names::

    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func   # flash-attn 2 layout
    scaled_dot_product_attention                                          # torch SDPA layout
    use_backend, explain, available_backends                              # backend selection
"""

from flash_recipe.api import (
    explain,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    scaled_dot_product_attention,
)
from flash_recipe.dispatch import BackendUnavailableError, available_backends, use_backend

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "__version__",
    "available_backends",
    "explain",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "scaled_dot_product_attention",
    "use_backend",
]
