"""Decoding reads each cached key and value once, whatever the GQA group (a memory-traffic proxy).

A decoding step is bound by the bytes it reads from the KV cache. Under the interpreter the bounds
checker (``tests/bounds.py``) sees every load a kernel makes and counts the bytes it takes from
each launch argument; here the forward kernel's loads from ``K`` and ``V`` are compared with the
least any kernel must read: every cached row that some query row sees, once per kv head. Rows of
a key block that no query row sees (before a window's left edge, past the filled length) are not
loaded, so the bound holds at the key-row level, not only per block.

The same holds for ``flash_attn_func`` and ``flash_attn_varlen_func`` with a few query rows on GQA,
which is what transformers' ``generate`` calls at each step.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flash_recipe

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the traffic is counted by instrumenting Triton's CPU interpreter"
)

BOUND = 1.05  # KV bytes loaded / the minimum
HEAD_DIM, NHEADS_K = 16, 2
SEQLENS = (37, 90)  # filled rows before the step, per sequence
CAPACITY, PAGE = 96, 16


def _kv_bytes(checker) -> int:
    return sum(n for (kernel, arg), n in checker.loaded.items() if kernel == "attn_fwd_kernel" and arg in ("K", "V"))


def _minimum(ends, seqlen_q: int, window_left: int, element_size: int) -> int:
    """Bytes of the rows some query row sees (causal, bottom-right, window ``(window_left, 0)``),
    once per kv head, for K and V."""
    rows = 0
    for end in ends:
        first = 0 if window_left < 0 else max(end - seqlen_q - window_left, 0)
        rows += end - first
    return 2 * rows * NHEADS_K * HEAD_DIM * element_size


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


CACHE_CASES = list(itertools.product((1, 2, 4, 8), (1, 2, 4), ("dense", "paged"), (1, 4), (-1, 20)))


@pytest.mark.parametrize(
    "group,seqlen_q,cache,splits,window_left",
    CACHE_CASES,
    ids=[f"group{g}-Sq{s}-{c}-split{n}-" + ("nowindow" if w < 0 else f"window{w}") for g, s, c, n, w in CACHE_CASES],
)
def test_kvcache_reads_each_cached_row_once(group, seqlen_q, cache, splits, window_left, bounds_checked):
    batch = len(SEQLENS)
    q = _rand(batch, seqlen_q, NHEADS_K * group, HEAD_DIM, seed=1)
    k_new, v_new = (
        _rand(batch, seqlen_q, NHEADS_K, HEAD_DIM, seed=2),
        _rand(batch, seqlen_q, NHEADS_K, HEAD_DIM, seed=3),
    )
    args = dict(
        cache_seqlens=torch.tensor(SEQLENS, dtype=torch.int32),
        causal=True,
        window_size=(window_left, 0),
        num_splits=splits,
    )
    if cache == "paged":
        width = CAPACITY // PAGE
        args["block_table"] = (
            torch.randperm(batch * width, generator=torch.Generator().manual_seed(4)).view(batch, width).to(torch.int32)
        )
        shape = (batch * width, PAGE, NHEADS_K, HEAD_DIM)
    else:
        shape = (batch, CAPACITY, NHEADS_K, HEAD_DIM)
    k_cache, v_cache = _rand(*shape, seed=5), _rand(*shape, seed=6)
    out = flash_recipe.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **args)
    assert out.isfinite().all()
    ends = [n + seqlen_q for n in SEQLENS]
    ratio = _kv_bytes(bounds_checked) / _minimum(ends, seqlen_q, window_left, 2)
    assert ratio <= BOUND, f"KV bytes / minimum = {ratio:.3f}"


@pytest.mark.parametrize("group", (2, 4, 8))
@pytest.mark.parametrize("seqlen_q", (1, 4))
def test_generate_steps_read_each_key_once(group, seqlen_q, bounds_checked):
    """``flash_attn_func`` (dense) and ``flash_attn_varlen_func`` (packed) with a short GQA query."""
    batch, seqlen_k = 2, 75
    q = _rand(batch, seqlen_q, NHEADS_K * group, HEAD_DIM, seed=1)
    k, v = _rand(batch, seqlen_k, NHEADS_K, HEAD_DIM, seed=2), _rand(batch, seqlen_k, NHEADS_K, HEAD_DIM, seed=3)
    flash_recipe.flash_attn_func(q, k, v, causal=True)
    dense = _kv_bytes(bounds_checked)
    assert dense / _minimum([seqlen_k] * batch, seqlen_q, -1, 2) <= BOUND

    bounds_checked.loaded.clear()
    lengths_k = [seqlen_k, 41]
    cu_q = torch.tensor([0, seqlen_q, 2 * seqlen_q], dtype=torch.int32)
    cu_k = torch.tensor([0, lengths_k[0], sum(lengths_k)], dtype=torch.int32)
    flash_recipe.flash_attn_varlen_func(
        q.flatten(0, 1),
        k.flatten(0, 1)[: sum(lengths_k)],
        v.flatten(0, 1)[: sum(lengths_k)],
        cu_q,
        cu_k,
        seqlen_q,
        seqlen_k,
        causal=True,
    )
    packed = _kv_bytes(bounds_checked)
    assert packed / _minimum(lengths_k, seqlen_q, -1, 2) <= BOUND


def test_the_proxy_sees_unpacked_reads(bounds_checked):
    """The proxy can fail: without packing, a group of 4 reads every cached row 4 times."""
    from flash_recipe.ops import forward

    batch, group = 1, 4
    q = _rand(batch, 1, NHEADS_K * group, HEAD_DIM, seed=1)
    k, v = _rand(batch, 64, NHEADS_K, HEAD_DIM, seed=2), _rand(batch, 64, NHEADS_K, HEAD_DIM, seed=3)
    from flash_recipe.ops.options import ScoreOptions

    options = ScoreOptions(
        softmax_scale=HEAD_DIM**-0.5, diag_offset=64 - 1, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )
    forward.attention_forward(q, k, v, options, pack_gqa=False)
    unpacked = _kv_bytes(bounds_checked)
    bounds_checked.loaded.clear()
    forward.attention_forward(q, k, v, options)
    packed = _kv_bytes(bounds_checked)
    minimum = _minimum([64], 1, -1, 2)
    assert unpacked / minimum == pytest.approx(group) and packed / minimum <= BOUND
