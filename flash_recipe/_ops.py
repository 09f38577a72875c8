"""The namespace of the package's torch custom ops: the package's own top-level module name.

Installed from the wheel, the package is ``flash_recipe`` and its ops are ``flash_recipe::attn_fwd``
and ``flash_recipe::attn_bwd``. Loaded as a Hugging Face Hub kernel (``flash-recipe hub-build``),
the same files are imported under the build's id (``_flash_recipe_cuda_<uid>``), and the ops become
``<id>::attn_fwd``: both copies can live in one process without one replacing the other's ops
(torch replaces an op registered again under the same name without an error). The names follow
kernel-builder's ``_ops.py``: ``ops`` and ``add_op_namespace_prefix``.
"""

from __future__ import annotations

import torch

_OPS_NAME = __name__.split(".")[0]
ops = getattr(torch.ops, _OPS_NAME)  # the namespace object; its ops resolve when first read


def add_op_namespace_prefix(op_name: str) -> str:
    """``"<namespace>::<op_name>"``, the name a ``torch.library`` registration takes."""
    return f"{_OPS_NAME}::{op_name}"
