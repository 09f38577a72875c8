"""Packed variable-length sequences: flash_attn_varlen_func and its helpers."""

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


def _offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


CASES = [
    # (lengths_q, lengths_k, nheads, nheads_k, head_dim, causal, window)
    ([5, 0, 37, 1, 33], [7, 3, 33, 1, 0], 4, 2, 24, True, (-1, -1)),  # empty and single-token sequences
    ([40, 17], [40, 60], 2, 1, 59, False, (-1, -1)),
    ([64, 33], [64, 33], 2, 2, 32, True, (9, 0)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("case", CASES, ids=["empty-and-single", "mqa", "window"])
def test_varlen_matches_each_sequence_alone(case, dtype, device, nan_outputs):
    """Every sequence obeys the accuracy rule against the reference run on that sequence alone."""
    lengths_q, lengths_k, nheads, nheads_k, head_dim, causal, window = case
    cu_q, cu_k = _offsets(lengths_q, device), _offsets(lengths_k, device)
    q = _rand(sum(lengths_q), nheads, head_dim, dtype=dtype, device=device, seed=1)
    k, v = (_rand(sum(lengths_k), nheads_k, head_dim, dtype=dtype, device=device, seed=s) for s in (2, 3))
    dout = _rand(*q.shape, dtype=dtype, device=device, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with flash_recipe.use_backend("triton"):
        out, lse, _ = flash_recipe.flash_attn_varlen_func(
            *leaves,
            cu_q,
            cu_k,
            max(lengths_q),
            max(lengths_k),
            causal=causal,
            window_size=window,
            return_attn_probs=True,
        )
    out.backward(dout)
    assert lse.shape == (nheads, sum(lengths_q))
    high = compute_dtype(dtype, upcast=True)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts = [t[None] for t in (q[rows], k[keys], v[keys])]
        truth_in = [t.to(high).requires_grad_() for t in parts]
        same_in = [t.clone().requires_grad_() for t in parts]
        truth, truth_lse = attention_reference(*truth_in, causal=causal, window=window)
        same, _ = attention_reference(*same_in, causal=causal, window=window, upcast=False)
        if truth.numel():
            truth.backward(dout[rows][None].to(high))
            same.backward(dout[rows][None])
        got = [out[rows], leaves[0].grad[rows], leaves[1].grad[keys], leaves[2].grad[keys]]
        want = [truth[0], *(t.grad[0] if t.grad is not None else torch.zeros_like(t[0]) for t in truth_in)]
        base = [same[0], *(t.grad[0] if t.grad is not None else torch.zeros_like(t[0]) for t in same_in)]
        for name, factor, g, w, s in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), got, want, base):
            if g.numel() == 0:
                continue
            assert_accurate(f"sequence {b} {name}", g, w, s, factor)
        torch.testing.assert_close(lse[:, rows], truth_lse[0], atol=1e-4, rtol=1e-4)


def test_varlen_backends_agree(device, monkeypatch):
    lengths = [3, 0, 20, 9]
    cu = _offsets(lengths, device)
    qkv = _rand(sum(lengths), 3, 2, 16, device=device, seed=5)
    results = {}
    for backend in ("triton", "sdpa", "reference"):
        with flash_recipe.use_backend(backend):
            results[backend] = flash_recipe.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=True)
    torch.testing.assert_close(results["triton"], results["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["sdpa"], results["reference"], atol=1e-5, rtol=1e-5)


def test_unpad_then_varlen_then_pad_equals_masked_dense(device):
    """The padded-batch recipe: unpad, attend per sequence, pad back; padding rows come back 0."""
    batch, seqlen = 3, 21
    mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
    mask[0, :21], mask[1, :4], mask[2, :13] = True, True, True
    x = _rand(batch, seqlen, 3, 2, 16, device=device, seed=6)  # (B, S, 3, H, D)
    packed, indices, cu, max_len, seqused = flash_recipe.unpad_input(x, mask)
    assert packed.shape == (38, 3, 2, 16) and cu.tolist() == [0, 21, 25, 38] and max_len == 21
    assert seqused.tolist() == [21, 4, 13]
    with flash_recipe.use_backend("triton"):
        out = flash_recipe.flash_attn_varlen_qkvpacked_func(packed, cu, max_len, causal=True)
    padded = flash_recipe.pad_input(out, indices, batch, seqlen)
    assert padded.shape == (batch, seqlen, 2, 16)
    for b, n in enumerate((21, 4, 13)):
        q, k, v = x[b : b + 1, :n].unbind(2)
        ref, _ = attention_reference(q, k, v, causal=True)
        torch.testing.assert_close(padded[b, :n], ref[0].float(), atol=1e-5, rtol=1e-5)
        assert (padded[b, n:] == 0).all()


BAD = [
    (
        "cu-dtype",
        dict(cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int64)),
        TypeError,
        ["cu_seqlens_q", "int32", "torch.int64"],
    ),
    (
        "cu-values",
        dict(cu_seqlens_q=torch.tensor([0, 2, 1, 4], dtype=torch.int32)),
        ValueError,
        ["cu_seqlens_q", "from 0", "[0, 2, 1, 4]"],
    ),
    (
        "cu-total",
        dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)),
        ValueError,
        ["cu_seqlens_k", "(4)", "[0, 5]"],
    ),
    (
        "cu-batch",
        dict(cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32)),
        ValueError,
        ["cu_seqlens_k", "as many entries"],
    ),
    ("max-too-small", dict(max_seqlen_q=2), ValueError, ["max_seqlen_q", "longest", "(4)", "2"]),
    ("max-type", dict(max_seqlen_k=4.0), TypeError, ["max_seqlen_k", "int", "float"]),
    ("max-float-tensor", dict(max_seqlen_k=torch.tensor(4.0)), TypeError, ["max_seqlen_k", "int", "Tensor"]),
    (
        "block-table-rank",
        dict(block_table=torch.zeros(1, dtype=torch.int32), k=torch.zeros(2, 16, 2, 8), v=torch.zeros(2, 16, 2, 8)),
        ValueError,
        ["block_table", "(batch_size, max_num_blocks_per_seq)"],
    ),
    (
        "paged-k-rank",
        dict(block_table=torch.zeros(1, 1, dtype=torch.int32)),
        ValueError,
        ["k", "4 dimensions", "(num_blocks, page_block_size, nheads_k, headdim)"],
    ),
    ("rank", dict(q=torch.zeros(1, 4, 2, 8)), ValueError, ["q", "3 dimensions", "(total_tokens, nheads, headdim)"]),
]


@pytest.mark.parametrize("changes,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_varlen_bad_input(changes, exc, words):
    args = dict(
        q=torch.zeros(4, 2, 8),
        k=torch.zeros(4, 2, 8),
        v=torch.zeros(4, 2, 8),
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
        max_seqlen_q=4,
        max_seqlen_k=4,
    )
    args.update(changes)
    with pytest.raises(exc) as info:
        flash_recipe.flash_attn_varlen_func(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_strided_offsets_and_index_like_lengths(device):
    """cu_seqlens given as strided views (every other entry of a larger tensor) and max_seqlen given
    as a numpy int or a 0-dim tensor give exactly the result of plain arguments, backward included."""
    import numpy as np

    lengths_q, lengths_k = [5, 0, 37, 1], [7, 3, 33, 1]
    q = _rand(sum(lengths_q), 2, 24, device=device, seed=1)
    k, v = (_rand(sum(lengths_k), 1, 24, device=device, seed=s) for s in (2, 3))
    dout = _rand(*q.shape, device=device, seed=4)

    def run(cu_q, cu_k, max_q, max_k):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with flash_recipe.use_backend("triton"):
            out = flash_recipe.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True)
        out.backward(dout)
        return out, *(t.grad for t in leaves)

    cu_q, cu_k = _offsets(lengths_q, device), _offsets(lengths_k, device)
    want = run(cu_q, cu_k, 37, 33)
    gaps = 10_000  # what a stride-1 read of the views would see between the entries
    strided = [torch.stack((cu, torch.full_like(cu, gaps)), 1).view(-1)[::2] for cu in (cu_q, cu_k)]
    assert not any(cu.is_contiguous() for cu in strided)
    got = run(*strided, np.int64(37), torch.tensor(33))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
