"""``flash_attn.flash_attn_interface`` of the stand-in: flash-attn 2.8.3's public functions, and
the internal ones that other libraries import (``internal``, where their shapes are given):

- the public functions, which also take attention sinks (newer flash-attn's ``learnable_sink``,
  or ``s_aux`` as vLLM's flash-attention passes them): ``(nheads,)`` float, forward and backward;
- ``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ``_flash_attn_backward``,
  ``_flash_attn_varlen_backward``, and the same as ``_wrapped_*`` (upstream's torch.library entry
  points);
- ``flash_attn_gpu``: the compiled extension's four functions on these (``extension``).
"""

from __future__ import annotations

import functools

from .. import api, decoding
from . import extension as flash_attn_gpu
from .internal import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_forward",
    "_wrapped_flash_attn_varlen_backward",
    "_wrapped_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_gpu",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _sink_names(function):
    """``function`` (a public flash-attn style function taking ``learnable_sink``) that also takes the
    sinks as ``s_aux``, the name vLLM-style callers use. Passing both is an error."""

    @functools.wraps(function)
    def taking_s_aux(*args, s_aux=None, **kwargs):
        if s_aux is not None:
            if kwargs.get("learnable_sink") is not None:
                raise ValueError("pass the attention sinks once: learnable_sink or s_aux (the same tensor), not both")
            kwargs["learnable_sink"] = s_aux
        return function(*args, **kwargs)

    return taking_s_aux


# The public functions, which take attention sinks as ``learnable_sink`` or ``s_aux``.
flash_attn_func = _sink_names(api.flash_attn_func)
flash_attn_kvpacked_func = _sink_names(api.flash_attn_kvpacked_func)
flash_attn_qkvpacked_func = _sink_names(api.flash_attn_qkvpacked_func)
flash_attn_varlen_func = _sink_names(api.flash_attn_varlen_func)
flash_attn_varlen_kvpacked_func = _sink_names(api.flash_attn_varlen_kvpacked_func)
flash_attn_varlen_qkvpacked_func = _sink_names(api.flash_attn_varlen_qkvpacked_func)
flash_attn_with_kvcache = _sink_names(decoding.flash_attn_with_kvcache)

# Upstream registers the four as torch.library ops and exports those as ``_wrapped_*``; here the
# functions themselves serve (torch.compile traces them through flash_recipe's own custom ops).
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward


def __getattr__(name: str):
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn.flash_attn_interface", name, __all__)
