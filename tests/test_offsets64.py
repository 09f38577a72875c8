"""Every launcher addresses tensors whose far rows lie past 2**31 elements (``ops/tiles.py``'s rule).

Each tensor here is a strided view of a lazily committed ``torch.empty`` buffer of several
billion elements: only the pages the view's few elements touch are ever committed, so a test
holds well under a gigabyte of real memory (``test_far_views_commit_only_the_touched_pages``).
The interpreter runs CPU tensors in place (Triton 3.9's ``GridExecutor._init_args_hst`` wraps the
same storage, and its copy back after the launch copies a storage onto itself, a no-op), so the
buffer is never copied either.

The strides are below 2**31, so Triton passes them as int32, and each index that multiplies one
reaches past 2**31 on its own: batch entry 2 and head 2 (``HUGE``, just over 2**30), the split
index 2 of the split-KV merge, and the rows of a tile that starts past row ``block`` (``rows_past``:
a row stride just under ``2**31 / block``, so a tile's in-tile offsets stay below 2**31 as the rule
requires). A 32-bit product of any of them wraps and the bounds checker (``tests/bounds.py``)
raises ``OutOfBoundsAccess``; results that come back are compared with the same computation on a
small contiguous copy: attention outputs by the accuracy rule (``flash_recipe.testing``) against
the reference, the other kernels' outputs exactly with the launcher on the contiguous copy. (A far view may
alias its own elements, batch 1 onto head 1 say: the contiguous copy is taken from the view, so
both sides read the same values; views that kernels write, the caches, do not alias.)
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flash_recipe.ops import choose, dropout, int8_attention, quantize, split_merge
from flash_recipe.ops.backward_launch import attention_backward
from flash_recipe.ops.forward import attention_forward
from flash_recipe.ops.kvcache import Cache, Rotary, attention_kvcache
from flash_recipe.ops.launch import layout, lse_buffer
from flash_recipe.ops.options import ScoreOptions, Varlen
from flash_recipe.reference import attention_reference
from flash_recipe.testing import FORWARD_FACTOR, assert_accurate

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="lazily committed host buffers under Triton's interpreter"),
    pytest.mark.usefixtures("bounds_checked", "int_overflow_checked"),
]

HUGE = 2**30 + 256  # a batch or head stride: index 2 lies past 2**31 elements, the stride itself is int32
SLOT = 256  # every stride is a multiple of it: tensors sharing a buffer at offsets 0, 32, ... never overlap


def rows_past(block: int) -> int:
    """A row stride whose row ``block + 1`` lies past 2**31 elements while ``block`` rows span less."""
    return (2**31 // block // SLOT - 1) * SLOT


class Far:
    """One lazily committed buffer that far views of small tensors share, each at its own offset."""

    def __init__(self, dtype: torch.dtype, numel: int = 7 * 2**30):
        self.buffer = torch.empty(numel, dtype=dtype)
        self.used = 0

    def view(self, x: torch.Tensor, strides: tuple) -> torch.Tensor:
        """``x`` copied into a view with these element strides (last 1), at the next free offset
        (where the view aliases itself, a later element's value wins: read it back with ``contiguous``)."""
        assert x.shape[-1] <= 32 and self.used < SLOT, "a far view holds at most 32 columns, 8 views a buffer"
        reach = self.used + sum((n - 1) * s for n, s in zip(x.shape, strides)) + 1
        assert reach <= self.buffer.numel(), f"the view reaches element {reach}, past the buffer"
        view = self.buffer.as_strided(x.shape, strides, self.used)
        view.copy_(x)
        self.used += 32
        return view


def _strides4(seqlen: int, block: int) -> tuple:
    """(batch, row, head, 1) strides of a far ``(3, seqlen, 3, D)`` view: batch 2, head 2 and the
    rows past ``block`` each past 2**31."""
    return (HUGE, rows_past(block), HUGE, 1)


def _rand(*shape, seed, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _options(causal=False, **kw) -> ScoreOptions:
    return ScoreOptions(
        softmax_scale=0.25,
        diag_offset=0,
        window_left=-1,
        window_right=0 if causal else -1,
        softcap=0.0,
        alibi_slopes=None,
        **kw,
    )


def _check_attention(name, got, q, k, v, causal=False, diag_offset=0):
    """The accuracy rule for ``got (B, Sq, H, D)`` against the fp32 reference on contiguous copies."""
    truth, _ = attention_reference(q, k, v, 0.25, causal, diag_offset)
    same, _ = attention_reference(q, k, v, 0.25, causal, diag_offset, upcast=False)
    assert_accurate(name, got, truth, same, FORWARD_FACTOR)


def test_far_views_commit_only_the_touched_pages():
    """A far view costs the pages its elements touch, not the buffer (7 * 2**30 fp16 = 14 GiB)."""

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    far = Far(torch.float16)
    view = far.view(_rand(3, 34, 3, 16, seed=0), _strides4(34, 32))
    assert view.storage_offset() + (view.shape[1] - 1) * view.stride(1) > 2**31
    assert resident() - before < 64 * 2**20


def test_forward_dense():
    far = Far(torch.float16)
    fq, fk, fv = (far.view(_rand(3, 34, 3, 16, seed=s), _strides4(34, 32)) for s in range(3))
    out, lse = attention_forward(fq, fk, fv, _options(causal=True), pack_gqa=False)
    _check_attention("out", out, fq.contiguous(), fk.contiguous(), fv.contiguous(), causal=True)


def test_forward_packed_gqa():
    """The packed tile gathers rows ``position * stride_qm + head * stride_qh``: head 2 of the group
    lies past 2**31, and so does position 2 (a row stride of ``HUGE``)."""
    far = Far(torch.float16)
    fq = far.view(_rand(3, 3, 3, 16, seed=0), (4 * SLOT, HUGE, HUGE + 2**20, 1))
    fk, fv = (far.view(_rand(3, 20, 1, 16, seed=s), (HUGE, 2**16, HUGE, 1)) for s in (1, 2))
    out, lse = attention_forward(fq, fk, fv, _options(), pack_gqa=True)
    _check_attention("out", out, fq.contiguous(), fk.contiguous(), fv.contiguous())


def test_forward_varlen():
    lengths = [40, 30]
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    far = Far(torch.float16)
    fq, fk, fv = (far.view(_rand(sum(lengths), 3, 16, seed=s), (rows_past(32), HUGE, 1)) for s in range(3))
    out, _ = attention_forward(fq, fk, fv, _options(causal=True), Varlen(cu, cu, 40, 40))
    q, k, v = fq.contiguous(), fk.contiguous(), fv.contiguous()
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        _check_attention(f"out[{b}]", out[None, lo:hi], q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], causal=True)


@pytest.mark.parametrize("path", ["one_pass", "three_kernels"])
def test_backward(path):
    options = _options(causal=True)
    far = Far(torch.float16)
    # The preprocess kernel's tiles are 64 rows: rows past 64 lie past 2**31.
    fq, fk, fv, fdout = (far.view(_rand(3, 66, 3, 16, seed=s), _strides4(66, 64)) for s in range(4))
    q, k, v, dout = (t.contiguous() for t in (fq, fk, fv, fdout))
    out, lse = attention_forward(q, k, v, options, pack_gqa=False)
    fout = far.view(out, _strides4(66, 64))
    out = fout.contiguous()
    with choose.taking_path(path):
        got = attention_backward(fdout, fq, fk, fv, fout, lse, options)
        want = attention_backward(dout, q, k, v, out, lse, options)
    for name, g, w in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert torch.equal(g, w), name


def _cache_step(paged: bool, num_splits: int, rotary: bool):
    """One ``attention_kvcache`` step on far and on contiguous tensors: (far result, contiguous result,
    the caches after it)."""
    batch, hk, cap = 3, 1, 40
    seqlens = torch.tensor([30, 5, 36], dtype=torch.int32)
    if paged:  # pages of 8 rows, entry b's pages scattered from the far end
        k_cache, v_cache = (_rand(16, 8, hk, 16, seed=s) for s in (3, 4))
        table = torch.tensor([[15, 3, 9, 1, 12], [0, 2, 4, 6, 8], [14, 13, 11, 10, 7]], dtype=torch.int32)
        cache_strides = (2**28, 2**20, HUGE, 1)  # page 8 onward lies past 2**31
    else:  # dense: entry b is page b
        k_cache, v_cache = (_rand(batch, cap, hk, 16, seed=s) for s in (3, 4))
        table = torch.arange(batch, dtype=torch.int32)[:, None]
        cache_strides = (HUGE, rows_past(32), HUGE, 1)
    cos = sin = None
    if rotary:
        angles = torch.arange(64)[:, None] * torch.linspace(0.1, 1.0, 8)[None, :]
        cos, sin = angles.cos(), angles.sin()
    far = Far(torch.float16)
    fq = far.view(_rand(batch, 1, 3, 16, seed=0), (HUGE, SLOT, HUGE + 2**20, 1))
    fk_new, fv_new = (far.view(_rand(batch, 2, hk, 16, seed=s), (HUGE, rows_past(16), HUGE, 1)) for s in (1, 2))
    fk_cache, fv_cache = (far.view(t, cache_strides) for t in (k_cache, v_cache))
    q, k_new, v_new = fq.contiguous(), fk_new.contiguous(), fv_new.contiguous()
    results = []
    for args in ((fq, fk_new, fv_new, fk_cache, fv_cache), (q, k_new, v_new, k_cache, v_cache)):
        rot = Rotary(cos, sin, False) if rotary else None
        cache = Cache(args[3], args[4], table, seqlens, None)
        results.append(attention_kvcache(*args[:3], cache, rot, _options(causal=True), num_splits=num_splits))
    return results, (fk_cache, fv_cache, k_cache, v_cache)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_decode(paged, num_splits):
    (got, want), _ = _cache_step(paged, num_splits, rotary=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_append():
    """The appended rows, rotated, land in the far cache as in the contiguous one."""
    (got, want), (fk, fv, k, v) = _cache_step(paged=True, num_splits=1, rotary=True)
    assert torch.equal(fk, k) and torch.equal(fv, v)
    assert torch.equal(got[0], want[0])


def test_split_merge():
    """The merge reads split 2 of its partials past 2**31 elements (strides ``HUGE``)."""
    splits, batch, seqlen, heads = 3, 2, 5, 2
    o_split = torch.randn(splits, batch, seqlen, heads, 16)
    lse_split = torch.randn(splits, batch, heads, seqlen)
    lse_split[1, 0, 0] = float("inf")  # a share that saw no key
    far = Far(torch.float32, 3 * 2**30)
    f_o = far.view(o_split, (HUGE, 2**20, 4 * SLOT, SLOT, 1))
    f_lse = far.view(lse_split, (HUGE,) + lse_split.stride()[1:])  # each split laid out as the merged lse
    q = torch.empty(batch, seqlen, heads, 16, dtype=torch.float16)
    dims = layout(q, q, None)
    results = []
    for o_s, l_s in ((f_o, f_lse), (o_split, lse_split)):
        out = torch.empty(q.shape, dtype=torch.float16)
        lse, stride_lb, stride_lh = lse_buffer(out, None, dims)
        merge = split_merge.plan_split_merge(o_s, l_s, out, lse, None, dims, stride_lb, stride_lh, 0, 16, q.device)
        split_merge.launch_split_merge(merge, o_s, l_s, out, lse, None)
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_quantize():
    far = Far(torch.float16)
    fx = far.view(_rand(3, 70, 3, 16, seed=0) * 3, _strides4(70, 64))
    x = fx.contiguous()
    got = quantize.quantize_blocks(fx, 64, 0.3)
    want = quantize.quantize_blocks(x, 64, 0.3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_int8_attention():
    """The 8-bit kernel on far views of quantized inputs (``attention_quantized``), and the whole
    method (quantizer included) on far fp16 inputs."""
    far8 = Far(torch.int8)
    far16 = Far(torch.float16)
    fq, fk, fv = (far16.view(_rand(3, 34, 3, 16, seed=s), _strides4(34, 32)) for s in range(3))
    q, k, v = fq.contiguous(), fk.contiguous(), fv.contiguous()
    plan = int8_attention.plan_int8(q.device, 16, False)
    x = int8_attention.quantize_inputs(q, k, v, 0.25, True, plan)
    q8, k8 = (far8.view(t, _strides4(34, 32)) for t in (x.q8, x.k8))
    v16 = far16.view(x.v, _strides4(34, 32))
    fx = x._replace(q8=q8, k8=k8, v=v16)
    x = x._replace(q8=q8.contiguous(), k8=k8.contiguous(), v=v16.contiguous())
    got = int8_attention.attention_quantized(fx, plan, True, torch.float16)
    want = int8_attention.attention_quantized(x, plan, True, torch.float16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = int8_attention.int8_attention(fq, fk, fv, 0.25, True)
    want = int8_attention.int8_attention(q, k, v, 0.25, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@triton.jit
def _keep_definition_kernel(KEEP, SEED, OFFSETS, dropout_p, N: tl.constexpr):
    """``KEEP[i] = rand(seed, OFFSETS[i]) >= dropout_p``: the mask's definition at int64 offsets."""
    o_i = tl.arange(0, N)
    tl.store(KEEP + o_i, (tl.rand(tl.load(SEED), tl.load(OFFSETS + o_i)) >= dropout_p).to(tl.int8))


def test_dropout_mask():
    """The mask kernel's first tile of head 1 starts at element ``Sq * Sk = 2**32`` (the whole mask
    would be 8 GiB; only that tile and head 0's are launched and committed)."""
    seqlen_q = seqlen_k = 2**16
    keep = torch.empty(2 * seqlen_q * seqlen_k, dtype=torch.int8)
    seed = torch.tensor([1234], dtype=torch.int64)
    dropout.dropout_mask_kernel[(1, 1, 2)](
        KEEP=keep,
        SEED=seed,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        dropout_p=0.5,
        fold_batch=2,
        BLOCK_M=32,
        BLOCK_N=32,
        GRID_FOLD=1,
    )
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    offsets = (seqlen_q * seqlen_k + rows * seqlen_k + cols).reshape(-1)
    want = torch.empty(32 * 32, dtype=torch.int8)
    _keep_definition_kernel[(1,)](want, seed, offsets, 0.5, N=32 * 32)
    got = keep.as_strided((32, 32), (seqlen_k, 1), seqlen_q * seqlen_k).reshape(-1)
    assert torch.equal(got, want)
    assert 0 < int(got.sum()) < 32 * 32


@triton.jit
def _row_offset_kernel(X, OUT, row, stride):
    """``OUT[0] = X[row * stride]`` with the product in int32, as a planted 32-bit offset computes it."""
    tl.store(OUT, tl.load(X + row * stride))


def test_the_overflow_check_is_on_and_catches_a_32_bit_product(int_overflow_checked):
    """The interpreter's overflow check that this module and the kernel tests run under is switched
    on (on the CPU, with a Triton whose interpreter has it), and a row offset multiplied in int32
    past 2**31 fails the launch instead of wrapping: row 2 of a row stride 2**30 + 1 (both int32)."""
    if int_overflow_checked is None:
        pytest.skip("no interpreter overflow check here (a GPU, or a Triton before 3.3)")
    x, out = torch.zeros(4), torch.zeros(1)
    _row_offset_kernel[(1,)](x, out, 0, 2**30 + 1)  # within int32: runs
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _row_offset_kernel[(1,)](x, out, 2, 2**30 + 1)
