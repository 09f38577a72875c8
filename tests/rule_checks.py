"""What the stand-ins' direct-call tests share (``test_xformers.py``, ``test_flash_attn_3.py``):
seeded inputs, the fp32 and input-dtype results of the plain-torch reference, and the accuracy rule
over the outputs and gradients a call returned."""

from __future__ import annotations

import torch

from flash_recipe.reference import attention_reference
from flash_recipe.testing import FACTORS, assert_accurate

SCALE = 0.25


def tensors(shape_q, shape_k, seed=0, dtype=torch.float16):
    """``q, k, v, dout``: q and dout shaped ``shape_q``, k and v ``shape_k``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(*shape_q, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(*shape_k, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def truths(q, k, v, dout, causal=False, window=(-1, -1), sinks=None):
    """fp32 math (``truth``) and the same in the input dtype (``same``): out, lse, dq, dk, dv, at
    ``SCALE``."""
    results = []
    for dtype in (torch.float32, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = attention_reference(*leaves, softmax_scale=SCALE, causal=causal, window=window, sinks=sinks,
                                       upcast=False)  # fmt: skip
        out.backward(dout.to(dtype))
        results.append((out.detach(), lse.detach(), *(t.grad for t in leaves)))
    return results


def check(got: dict, truth, same) -> None:
    """The rule for each of out, lse, dq, dk, dv that ``got`` holds."""
    for index, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name in got:
            assert_accurate(name, got[name].float(), truth[index].float(), same[index].float(), FACTORS[name])
