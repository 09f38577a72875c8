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


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill its span without gaps, in some order of its dimensions."""
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size > 1 and stride != span:
            return False
        span *= size
    return True


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


@pytest.mark.parametrize(
    "view",
    [
        lambda: torch.randn(2, 5, 3, 3, 8)[:, :, 0],  # q of a packed qkv: not dense, contiguous order
        lambda: torch.randn(2, 3, 5, 16)[..., :8].transpose(1, 2),  # padded rows, heads outermost
    ],
    ids=["packed", "padded-heads-outermost"],
)
@pytest.mark.parametrize(
    "other",
    [lambda: torch.randn(2, 3, 5, 8).transpose(1, 2), lambda: torch.randn(2, 5, 3, 8)],
    ids=["heads-outermost", "contiguous"],
)
def test_a_view_into_a_wider_tensor_gets_both_copied_into_one_dense_layout(view, other):
    a, b = view(), other()
    got_a, got_b = shared_layout(a, b)
    assert got_a.stride() == got_b.stride()
    assert _dense(got_b)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


@pytest.mark.parametrize("q_layout", ["packed", "padded-heads-outermost"])
@pytest.mark.parametrize("path", PATHS)
def test_gradients_of_mixed_layouts_equal_those_of_contiguous_ones(path, q_layout, device):
    """q not dense (from a packed qkv, or rows padded with heads outermost), dout with heads
    outermost (dense), GQA k contiguous and v with heads outermost: each pair differs."""
    options = _options()
    if q_layout == "packed":
        q = _rand(2, 37, 3, 4, 32, seed=1, device=device)[:, :, 0]
    else:
        q = _rand(2, 4, 37, 48, seed=1, device=device)[..., :32].transpose(1, 2)
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
