"""Ulysses attention (``flash_recipe.distributed.ulysses_attention``) on 2 and 4 gloo processes on
loopback, alone and composed with ring attention into USP (Ulysses 2 x ring 2).

Each case shards full-sequence tensors, runs forward and backward, gathers the shards and compares
them with the fp32 reference of the whole sequence (fp64 for fp32 inputs) by the accuracy rule
(``ring_worker.ulysses``). Every run has a hard timeout (``multiprocess.run_ranks``).
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import assert_within_bounds, run_ranks

from flash_recipe.distributed import ulysses_attention


def _case(ulysses, causal, nheads_k, dtype="float32", ring_layout="zigzag"):
    return dict(
        kind="ulysses",
        ulysses=ulysses,
        causal=causal,
        ring_layout=ring_layout,
        batch=2,
        seqlen=32,
        nheads=4,
        nheads_k=nheads_k,
        headdim=16,
        dtype=dtype,
    )


def test_ulysses_on_two_ranks():
    """MHA and GQA, causal and not, fp32 and fp16."""
    cases = [_case(2, True, 4), _case(2, False, 2, "float16"), _case(2, True, 2), _case(2, False, 1)]
    assert_within_bounds(run_ranks(2, {"cases": cases}), cases)


def test_ulysses_and_usp_on_four_ranks():
    """Ulysses over 4 ranks (GQA with fewer key heads than ranks: repeated), and USP as Ulysses 2 x
    ring 2 with both ring layouts."""
    cases = [
        _case(4, True, 4),
        _case(4, False, 2, "float16"),
        _case(2, True, 2),
        _case(2, True, 4, "float16"),
        _case(2, False, 2, ring_layout="contiguous"),
        _case(2, True, 1, ring_layout="contiguous"),
    ]
    assert_within_bounds(run_ranks(4, {"cases": cases}), cases)


def test_the_comparison_fails_a_wrong_mask():
    """Ulysses run without the causal mask, compared with causal attention: the check must fail."""
    case = dict(_case(2, True, 2), call_causal=False)
    results = run_ranks(2, {"cases": [case]})
    with pytest.raises(AssertionError, match="error"):
        assert_within_bounds(results, [case])


def test_ulysses_errors():
    q = torch.randn(1, 8, 3, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ulysses_attention(q, q, q)
    with pytest.raises(ValueError, match="shards as long"):
        ulysses_attention(q, q[:, :4], q[:, :4])
