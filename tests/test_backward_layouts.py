"""The backward's one layout per tensor pair (``backward_launch.shared_layout``): its kernels read
dout through q's strides and v through k's, so a call whose pairs differ gets one of each pair
copied, and gradients equal, bit for bit, those of the same call on contiguous tensors, on each of
the three backward paths."""

from __future__ import annotations

import pytest
import torch

from flash_recipe.ops import choose
from flash_recipe.ops.backward_launch import attention_backward, shared_layout
from flash_recipe.ops.forward import attention_forward
from flash_recipe.ops.options import ScoreOptions

PATHS = ("three_kernels", "one_pass", "one_launch")


def _rand(*shape, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=torch.float16)


def _options() -> ScoreOptions:
    return ScoreOptions(
        softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )


def test_a_pair_that_shares_strides_is_not_copied():
    a, b = torch.zeros(2, 5, 3, 8), torch.ones(2, 5, 3, 8)
    assert all(x is y for x, y in zip(shared_layout(a, b), (a, b)))
    wide = torch.zeros(2, 5, 3, 3, 8)
    q, k = wide[:, :, 0], wide[:, :, 1]  # views of a packed tensor, one layout
    assert all(x is y for x, y in zip(shared_layout(q, k), (q, k)))


def test_a_dense_layout_is_kept_and_the_other_copied_into_it():
    a = torch.randn(2, 3, 5, 8).transpose(1, 2)  # (2, 5, 3, 8), dense, heads outermost
    b = torch.randn(2, 5, 3, 8)
    got_a, got_b = shared_layout(a, b)
    assert got_a is a and got_b.stride() == a.stride() and torch.equal(got_b, b)


def test_a_view_into_a_wider_tensor_makes_both_contiguous():
    a = torch.randn(2, 5, 3, 3, 8)[:, :, 0]  # q of a packed qkv: not dense
    b = torch.randn(2, 3, 5, 8).transpose(1, 2)
    got_a, got_b = shared_layout(a, b)
    assert got_a.is_contiguous() and got_b.is_contiguous()
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_mixed_layouts_equal_those_of_contiguous_ones(path, device):
    """q from a packed qkv (not dense), dout with heads outermost (dense, q's order differs), GQA
    k contiguous and v with heads outermost: each pair differs, each differently."""
    options = _options()
    qkv = _rand(2, 37, 3, 4, 32, seed=1, device=device)
    q = qkv[:, :, 0]
    dout = _rand(2, 4, 37, 32, seed=2, device=device).transpose(1, 2)
    k = _rand(2, 29, 2, 32, seed=3, device=device)
    v = _rand(2, 2, 29, 32, seed=4, device=device).transpose(1, 2)
    out, lse = attention_forward(q.contiguous(), k, v.contiguous(), options, pack_gqa=False)
    with choose.taking_path(path):
        got = attention_backward(dout, q, k, v, out, lse, options)
        want = attention_backward(dout.contiguous(), q.contiguous(), k, v.contiguous(), out, lse, options)
    assert dout.stride() != q.stride() and v.stride() != k.stride()  # the inputs were not rewritten
    for name, g, w in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert g.stride() == w.stride(), name
        assert torch.equal(g, w), name
