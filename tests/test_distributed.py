"""Ring attention (``flash_recipe.distributed``) on 2 and 4 gloo processes on loopback.

Each case shards full-sequence tensors across the ranks, runs ``ring_attention`` forward and
backward, gathers the shards and compares them with the fp32 reference of the whole sequence by
the accuracy rule (``ring_worker.py``). Every run has a hard timeout (``multiprocess.run_ranks``).
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import assert_within_bounds, run_ranks

from flash_recipe.distributed import _blocks, merge_partial, ring_attention
from flash_recipe.reference import attention_reference, visible_keys


def _case(layout, causal, nheads_k, dtype="float32", **extra):
    return dict(
        kind="builtin",
        layout=layout,
        causal=causal,
        batch=2,
        seqlen=32,
        nheads=4,
        nheads_k=nheads_k,
        headdim=16,
        dtype=dtype,
        **extra,
    )


CASES = [
    _case("zigzag", True, 4),
    _case("zigzag", True, 2, "float16"),
    _case("zigzag", False, 1),
    _case("contiguous", True, 2),
    _case("contiguous", False, 4, "float16", softcap=3.0),
    _case("zigzag", True, 2, "bfloat16", sum=True),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_matches_single_process_attention(world_size):
    """MHA, GQA and MQA, causal and not, both layouts, fp32, fp16 and bf16, on the reference backend;
    one case's backward starts from ``out.sum()`` (an output gradient of stride 0)."""
    assert_within_bounds(run_ranks(world_size, {"cases": CASES}), CASES)


@pytest.mark.slow
def test_ring_attention_on_the_triton_kernels():
    """The Triton kernels as the local kernel (through the interpreter on a CPU)."""
    cases = [
        dict(_case("zigzag", True, 2, "float16"), batch=1, backend="triton"),
        dict(_case("contiguous", False, 1), batch=1, backend="triton"),
    ]
    assert_within_bounds(run_ranks(2, {"cases": cases}, env={"TRITON_INTERPRET": "1"}), cases)


def test_the_comparison_fails_a_wrong_layout():
    """Shards laid out contiguously but attended as zigzag: the check must fail."""
    case = dict(_case("contiguous", True, 2), call_layout="zigzag")
    results = run_ranks(2, {"cases": [case]})
    with pytest.raises(AssertionError, match="error"):
        assert_within_bounds(results, [case])


def test_blocks_cover_exactly_the_causal_mask():
    """Over every (rank, source) pair, the blocks ``_blocks`` assigns cover each visible
    (query, key) pair of the full causal mask exactly once, in both layouts."""
    seqlen = 24
    for world in (1, 2, 3, 4):
        chunk = seqlen // (2 * world)
        for layout in ("zigzag", "contiguous"):

            def positions(rank, layout=layout, chunk=chunk, world=world):
                if layout == "contiguous":
                    return torch.arange(rank * 2 * chunk, (rank + 1) * 2 * chunk)
                return torch.cat(
                    [
                        torch.arange(rank * chunk, (rank + 1) * chunk),
                        torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk),
                    ]
                )

            covered = torch.zeros(seqlen, seqlen, dtype=torch.int64)
            for rank in range(world):
                for source in range(world):
                    for rows_q, rows_k, causal in _blocks(layout, True, rank, source, 2 * chunk):
                        pq, pk = positions(rank)[rows_q], positions(source)[rows_k]
                        seen = pk[None, :] <= pq[:, None] if causal else torch.ones(len(pq), len(pk), dtype=torch.bool)
                        covered[pq[:, None], pk[None, :]] += seen.long()
            assert torch.equal(covered, visible_keys(seqlen, seqlen, 0, (-1, 0), "cpu").long()), (world, layout)


def test_merge_partial_is_attention_over_the_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 3, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 12, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    full, full_lse = attention_reference(q, k, v, 0.25)
    out = torch.zeros(2, 5, 3, 16, dtype=torch.float32)
    lse = torch.full((2, 3, 5), float("-inf"))
    for keys in (slice(0, 4), slice(4, 12)):
        block_out, block_lse = attention_reference(q, k[:, keys], v[:, keys], 0.25)
        merge_partial(out, lse, block_out, block_lse)
    assert (out.double() - full).abs().max() < 1e-6 and (lse.double() - full_lse).abs().max() < 1e-6
    # A block in which a row sees no key (lse = +inf, output 0) leaves that row unchanged.
    empty_lse = torch.full((2, 3, 5), float("inf"))
    merge_partial(out, lse, torch.zeros(2, 5, 3, 16), empty_lse)
    assert (out.double() - full).abs().max() < 1e-6


def test_ring_attention_errors():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="shard length must be even"):
        ring_attention(q[:, :7], q[:, :7], q[:, :7], causal=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)
