"""Dropout in the Triton kernels: the mask, its rate, and gradients through the same mask."""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe.reference import attention_reference, compute_dtype
from flash_recipe.testing import assert_accurate

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")


def _rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_reference_with_the_same_mask(dtype, causal, device, nan_outputs):
    """The returned probabilities give the mask; the reference with that mask obeys the accuracy rule."""
    p = 0.17
    q, k, v = (_rand(2, 45, 4, 32, dtype=dtype, device=device, seed=s) for s in (1, 2, 3))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA
    dout = _rand(*q.shape, dtype=dtype, device=device, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    with flash_recipe.use_backend("triton"):
        out, lse, s_dmask = flash_recipe.flash_attn_func(*leaves, dropout_p=p, causal=causal, return_attn_probs=True)
    out.backward(dout)
    assert s_dmask.shape == (2, 4, 45, 45)
    keep = s_dmask >= 0
    high = compute_dtype(dtype, upcast=True)
    truth_in = [t.to(high).requires_grad_() for t in (q, k, v)]
    same_in = [t.clone().requires_grad_() for t in (q, k, v)]
    truth, _ = attention_reference(*truth_in, causal=causal, dropout_p=p, dropout_mask=keep)
    same, _ = attention_reference(*same_in, causal=causal, dropout_p=p, dropout_mask=keep, upcast=False)
    truth.backward(dout.to(high))
    same.backward(dout)
    for name, factor, g, w, s in zip(
        ("out", "dq", "dk", "dv"),
        (2, 3, 3, 3),
        (out, *(t.grad for t in leaves)),
        (truth, *(t.grad for t in truth_in)),
        (same, *(t.grad for t in same_in)),
    ):
        assert_accurate(name, g, w, s, factor)


def test_kept_fraction_and_reproducibility(device):
    p = 0.3
    q, k, v = (_rand(2, 64, 4, 16, device=device, seed=s) for s in (1, 2, 3))
    with flash_recipe.use_backend("triton"):
        torch.manual_seed(123)
        first, _, mask = flash_recipe.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
        torch.manual_seed(123)
        again = flash_recipe.flash_attn_func(q, k, v, dropout_p=p)
        other = flash_recipe.flash_attn_func(q, k, v, dropout_p=p)
    kept = (mask >= 0).float().mean().item()
    # 32768 Bernoulli(0.7) draws: the standard deviation of the mean is 0.0025.
    assert abs(kept - (1 - p)) < 0.0125, kept
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_no_dropout_in_other_backends_returns_probs(monkeypatch):
    q = _rand(1, 8, 2, 16)
    reasons = flash_recipe.explain(q, q, q, dropout_p=0.1, return_attn_probs=True)
    assert "dropped-out probabilities" in reasons["reference"] and "log-sum-exp" in reasons["sdpa"]
