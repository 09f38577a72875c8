"""The bounds checker (``tests/bounds.py``) and the kernels' memory safety on bad metadata.

The first half shows that the ``bounds_checked`` fixture catches what it should (a load past the
end, a store before the start, an element that straddles the end, an address inside a tensor the
launch was not given) and nothing else (addresses that the mask switches off). The second half
calls the launchers directly, below the public API's validation, with metadata that no valid
call has: page indices outside the cache, lengths past the capacity, negative left padding,
``cu_seqlens`` past the packed totals. Whatever the kernels compute from such input, they must
not touch memory outside the tensors they were given.

The checker instruments Triton's CPU interpreter: with a GPU these tests are skipped.
"""

from __future__ import annotations

import bounds
import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the bounds checker instruments Triton's CPU interpreter"
)


@triton.jit
def _shifted_copy_kernel(X, Y, n, load_shift, store_shift, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Copy ``X[i + load_shift]`` to ``Y[i + store_shift]`` for ``i < n`` (all of ``BLOCK`` without ``MASKED``)."""
    o_i = tl.arange(0, BLOCK)
    if MASKED:
        b_x = tl.load(X + o_i + load_shift, mask=o_i < n, other=0.0)
        tl.store(Y + o_i + store_shift, b_x, mask=o_i < n)
    else:
        b_x = tl.load(X + o_i + load_shift)
        tl.store(Y + o_i + store_shift, b_x)


@triton.jit
def _wide_load_kernel(X, Y, index):
    """Read element ``index`` of ``X`` (float32) as an int64, i.e. 8 bytes at ``X + 8 * index``."""
    b_x = tl.load(X.to(tl.pointer_type(tl.int64)) + index)
    tl.store(Y, b_x)


@triton.jit
def _atomic_kernel(X, index, CAS: tl.constexpr):
    """``atomic_add`` (or ``atomic_cas``) on ``X[index]``."""
    if CAS:
        tl.atomic_cas(X + index, 0, 1)
    else:
        tl.atomic_add(X + index, 1)


def _copy(n, block, load_shift=0, store_shift=0, masked=True):
    x = torch.arange(n, dtype=torch.float32)
    y = torch.zeros(n, dtype=torch.float32)
    _shifted_copy_kernel[(1,)](x, y, n, load_shift, store_shift, BLOCK=block, MASKED=masked)
    return y


def _expect_violation(checker, run, *words):
    """``run()`` raises ``OutOfBoundsAccess`` naming ``words``; the checker recorded it (taken back here)."""
    with pytest.raises(bounds.OutOfBoundsAccess) as info:
        run()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    assert checker.take_violations() == [message]
    return message


def test_in_bounds_copy_passes_and_is_checked(bounds_checked):
    assert torch.equal(_copy(16, 16, masked=False), torch.arange(16, dtype=torch.float32))
    assert bounds_checked.launches == 1 and bounds_checked.accesses == 2


def test_masked_off_addresses_are_not_flagged(bounds_checked):
    """BLOCK = 64 over 5 elements: 59 lanes address past both tensors, all masked off."""
    assert torch.equal(_copy(5, 64), torch.arange(5, dtype=torch.float32))
    # Shifted far outside both tensors, but every lane masked off (n = 0): nothing is accessed.
    x, y = torch.zeros(4), torch.zeros(4)
    _shifted_copy_kernel[(1,)](x, y, 0, -(2**20), 2**20, BLOCK=16, MASKED=True)
    assert bounds_checked.accesses == 4 and not bounds_checked.violations


def test_load_past_the_end_is_flagged(bounds_checked):
    message = _expect_violation(
        bounds_checked,
        lambda: _copy(16, 16, load_shift=1),
        "out-of-bounds load",
        "_shifted_copy_kernel",
        "program (0, 0, 0)",
        "nearest: X [",
        "ends 4 bytes past it",
        "(1 of 16 active addresses)",
    )
    assert "address 0x" in message


def test_unmasked_block_past_the_end_is_flagged(bounds_checked):
    _expect_violation(
        bounds_checked,
        lambda: _copy(5, 16, masked=False),
        "out-of-bounds load",
        "(11 of 16 active addresses)",
        "ends 4 bytes past it",
    )


def test_store_before_the_start_is_flagged(bounds_checked):
    _expect_violation(
        bounds_checked,
        lambda: _copy(16, 16, store_shift=-3),
        "out-of-bounds store",
        "_shifted_copy_kernel",
        "nearest: Y [",
        "starts 12 bytes before it",
        "(3 of 16",
    )


def test_an_element_straddling_the_end_is_flagged(bounds_checked):
    """Element 1 of 12 bytes read as int64 is bytes [8, 16): its address is inside, its end is not."""
    x, y = torch.zeros(3, dtype=torch.float32), torch.zeros(1, dtype=torch.int64)
    _wide_load_kernel[(1,)](x, y, 0)
    _expect_violation(bounds_checked, lambda: _wide_load_kernel[(1,)](x, y, 1), "(8 bytes)", "ends 4 bytes past it")


def test_memory_of_a_tensor_not_passed_is_flagged(bounds_checked):
    """An address inside a live tensor that this launch was not given is out of bounds too."""
    x, y, other = torch.zeros(8), torch.zeros(8), torch.zeros(1024)
    shift = (other.data_ptr() + 256 * 4 - x.data_ptr()) // 4
    _expect_violation(bounds_checked, lambda: _copy_from(x, y, shift), "out-of-bounds load", "(8 of 8")


def _copy_from(x, y, shift):
    _shifted_copy_kernel[(1,)](x, y, 8, shift, 0, BLOCK=8, MASKED=True)


def test_views_may_reach_the_rest_of_their_storage(bounds_checked):
    """The allowed region is the whole storage: a view's neighbours in its base tensor are not strays."""
    base = torch.arange(32, dtype=torch.float32)
    x, y = base[8:16], torch.zeros(8)
    _shifted_copy_kernel[(1,)](x, y, 8, 16, 0, BLOCK=8, MASKED=True)  # reads base[24:32]
    assert torch.equal(y, base[24:32])
    _expect_violation(
        bounds_checked, lambda: _shifted_copy_kernel[(1,)](x, y, 8, 17, 0, BLOCK=8, MASKED=True), "bytes past it"
    )


@pytest.mark.parametrize("cas", [False, True], ids=["atomic_add", "atomic_cas"])
def test_atomics_are_checked(bounds_checked, cas):
    x = torch.zeros(4, dtype=torch.int32)
    _atomic_kernel[(1,)](x, 3, CAS=cas)
    assert x[3] == 1
    kind = "atomic_cas" if cas else "atomic_rmw"
    _expect_violation(
        bounds_checked,
        lambda: _atomic_kernel[(1,)](x, 4, CAS=cas),
        f"out-of-bounds {kind}",
        "_atomic_kernel",
        "nearest: X [",
    )


def test_a_swallowed_violation_still_fails_the_test(bounds_checked):
    with pytest.raises(bounds.OutOfBoundsAccess):
        _copy(16, 16, load_shift=100)
    with pytest.raises(bounds.OutOfBoundsAccess, match="1 out-of-bounds access"):
        bounds_checked.verify()
    bounds_checked.take_violations()
    bounds_checked.verify()


def test_missing_interpreter_internals_are_reported():
    from triton.runtime import interpreter

    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(interpreter.InterpreterBuilder, "create_masked_load")
        with pytest.raises(bounds.HooksUnavailable, match="InterpreterBuilder.create_masked_load is missing"):
            bounds.BoundsChecker().install(patch)
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(interpreter.GridExecutor, "_init_args_hst")
        with pytest.raises(bounds.HooksUnavailable, match="GridExecutor._init_args_hst is missing"):
            bounds.BoundsChecker().install(patch)


def test_hooks_that_see_no_access_are_reported():
    checker = bounds.BoundsChecker()
    checker.launches = 1
    with pytest.raises(bounds.HooksUnavailable, match="no memory access"):
        checker.verify()


def test_hooks_are_removed_after_the_test():
    from triton.runtime import interpreter

    for name in ("create_masked_load", "create_masked_store", "create_load", "create_store"):
        assert getattr(interpreter.InterpreterBuilder, name).__module__ == interpreter.__name__


# -- bad metadata, given to the launchers directly -----------------------------------------------
#
# Every case runs under ``bounds_checked``: passing means no access left the launch's tensors.
# The launchers trust their metadata (the public API checks it where it lives on the host), so
# these are the values a GPU-resident tensor could hold unchecked.


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


BIG = 2**31 - 1
PAGE, NUM_PAGES, WIDTH = 16, 6, 2  # a paged cache of 6 pages of 16 rows; 2 pages (32 rows) per sequence
GOOD_TABLE = [[0, 1], [2, 3], [4, 5]]

CACHES = [
    # id, table, seqlens, leftpad
    ("page-past-the-end", [[0, 1], [2, 99], [4, BIG]], [3, 20, 30], None),
    ("page-negative", [[0, -1], [-(2**31), 3], [-16, 5]], [20, 5, 17], None),
    ("unused-pages-bad", [[0, 99], [2, -1], [4, BIG]], [3, 10, 0], None),
    ("seqlens-past-capacity", GOOD_TABLE, [31, 40, BIG], None),
    ("seqlens-negative", GOOD_TABLE, [-1, -20, -(2**31)], None),
    ("leftpad-negative", GOOD_TABLE, [3, 20, 10], [-4, -100, -(2**31)]),
    ("leftpad-past-seqlens", GOOD_TABLE, [3, 20, 10], [10, 32, BIG]),
    ("everything-bad", [[-1, 99], [0, 1], [2, -7]], [40, -3, 31], [-5, 50, -1]),
]


@pytest.mark.parametrize("splits", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("table,seqlens,leftpad", [c[1:] for c in CACHES], ids=[c[0] for c in CACHES])
def test_kvcache_bad_metadata_stays_in_bounds(table, seqlens, leftpad, splits, bounds_checked):
    """``attention_kvcache`` (append with rotary, then split-KV attention over pages) on bad tables,
    lengths and padding: the append kernel, the forward kernel and the split merge stay in bounds."""
    from flash_recipe.ops.kvcache import Cache, Rotary, attention_kvcache
    from flash_recipe.ops.options import ScoreOptions

    q = _rand(3, 2, 2, 16, seed=1)
    k_cache, v_cache = _rand(NUM_PAGES, PAGE, 1, 16, seed=2), _rand(NUM_PAGES, PAGE, 1, 16, seed=3)
    k_new, v_new = _rand(3, 2, 1, 16, seed=4), _rand(3, 2, 1, 16, seed=5)
    angle = _rand(24, 4, seed=6)  # rotary positions [0, 24): fewer than the capacity
    rotary = Rotary(angle.cos(), angle.sin(), interleaved=False)
    cache = Cache(k_cache, v_cache, _i32(table), _i32(seqlens), None if leftpad is None else _i32(leftpad))
    var = ScoreOptions(
        softmax_scale=0.25, diag_offset=0, window_left=8, window_right=0, softcap=0.0, alibi_slopes=None
    )  # causal, a left window: q moves
    out, lse = attention_kvcache(q, k_new, v_new, cache, rotary, var, num_splits=splits)
    assert out.shape == q.shape and lse.shape == (3, 2, 2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the rows of a bad entry are NaN, as designed
@pytest.mark.parametrize("table", [[[0], [99], [-1]], [[BIG], [1], [-(2**31)]]], ids=["index-out", "index-extreme"])
def test_dense_cache_bad_batch_index_stays_in_bounds(table, bounds_checked):
    """A dense cache is one page per entry (``cache_batch_idx`` becomes a one-column table)."""
    from flash_recipe.ops.kvcache import Cache, attention_kvcache
    from flash_recipe.ops.options import ScoreOptions

    q = _rand(3, 1, 2, 16, seed=1)
    k_cache, v_cache = _rand(2, 32, 1, 16, seed=2), _rand(2, 32, 1, 16, seed=3)
    k_new, v_new = _rand(3, 1, 1, 16, seed=4), _rand(3, 1, 1, 16, seed=5)
    cache = Cache(k_cache, v_cache, _i32(table), _i32([4, 31, 7]), None)
    attention_kvcache(
        q,
        k_new,
        v_new,
        cache,
        None,
        ScoreOptions(
            softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None
        ),
        num_splits=2,
    )


KEY_RANGES = [
    # id, start, end
    ("start-negative", [-5, -(2**31), 0], [10, 20, 32]),
    ("end-past-table", [0, 10, 31], [33, 64, BIG]),
    ("end-before-start", [20, 10, 0], [3, 9, -1]),
]


@pytest.mark.parametrize("splits", [1, 2], ids=["split1", "split2"])
@pytest.mark.parametrize("start,end", [c[1:] for c in KEY_RANGES], ids=[c[0] for c in KEY_RANGES])
def test_forward_key_ranges_bad_stay_in_bounds(start, end, splits, bounds_checked):
    """``attention_forward`` with paged ``KeyRanges`` whose rows lie outside the page table."""
    from flash_recipe.ops.forward import attention_forward
    from flash_recipe.ops.options import KeyRanges, ScoreOptions

    q = _rand(3, 5, 2, 16, seed=1)
    k, v = _rand(NUM_PAGES, PAGE, 1, 16, seed=2), _rand(NUM_PAGES, PAGE, 1, 16, seed=3)
    keys = KeyRanges(_i32(start), _i32(end), 32, _i32(GOOD_TABLE))
    options = ScoreOptions(
        softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )
    attention_forward(q, k, v, options, keys=keys, num_splits=splits, kernel="decode")


TOTAL_Q, TOTAL_K = 30, 40
CU_SEQLENS = [
    # id, cu_seqlens_q, cu_seqlens_k (3 sequences over 30 query and 40 key rows)
    ("q-past-total", [0, 10, 25, 60], [0, 10, 20, 40]),
    ("k-past-total", [0, 10, 20, 30], [0, 10, 30, 80]),
    ("start-past-total", [0, 50, 60, 70], [0, 45, 90, 100]),
    ("decreasing", [0, 20, 5, 30], [0, 30, 10, 40]),
    ("negative", [-10, 5, 20, 30], [-7, 0, 20, 40]),
    ("extreme", [0, BIG, -(2**31), 30], [-(2**31), 0, BIG, 40]),
]


def _varlen_inputs(cu_q, cu_k):
    from flash_recipe.ops.options import ScoreOptions, Varlen

    q = _rand(TOTAL_Q, 2, 16, seed=1)
    k, v = _rand(TOTAL_K, 1, 16, seed=2), _rand(TOTAL_K, 1, 16, seed=3)
    varlen = Varlen(_i32(cu_q), _i32(cu_k), 40, 40)
    return (
        q,
        k,
        v,
        ScoreOptions(softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None),
        varlen,
    )


@pytest.mark.parametrize("cu_q,cu_k", [c[1:] for c in CU_SEQLENS], ids=[c[0] for c in CU_SEQLENS])
def test_varlen_forward_bad_cu_seqlens_stays_in_bounds(cu_q, cu_k, bounds_checked):
    from flash_recipe.ops.forward import attention_forward

    q, k, v, var, varlen = _varlen_inputs(cu_q, cu_k)
    attention_forward(q, k, v, var, varlen)


@pytest.mark.parametrize("cu_q,cu_k", [c[1:] for c in CU_SEQLENS], ids=[c[0] for c in CU_SEQLENS])
def test_varlen_backward_bad_cu_seqlens_stays_in_bounds(cu_q, cu_k, bounds_checked):
    """The three backward kernels, given an ``out`` and ``lse`` of the right shapes."""
    from flash_recipe.ops.backward_launch import attention_backward

    q, k, v, var, varlen = _varlen_inputs(cu_q, cu_k)
    out, lse, dout = _rand(*q.shape, seed=4), _rand(2, TOTAL_Q, seed=5), _rand(*q.shape, seed=6)
    attention_backward(dout, q, k, v, out, lse, var, varlen)


@pytest.mark.parametrize("table", [GOOD_TABLE, [[0, 99], [-1, 3], [BIG, -(2**31)]]], ids=["table-good", "table-bad"])
@pytest.mark.parametrize("cu_q,cu_k", [c[1:] for c in CU_SEQLENS], ids=[c[0] for c in CU_SEQLENS])
def test_paged_varlen_bad_metadata_stays_in_bounds(cu_q, cu_k, table, bounds_checked):
    """Paged varlen keys (as ``flash_attn_varlen_func`` with ``block_table`` launches them): key
    lengths from ``cu_seqlens_k``, rows through the page table."""
    from flash_recipe.ops.forward import attention_forward
    from flash_recipe.ops.options import KeyRanges

    q, _, _, var, varlen = _varlen_inputs(cu_q, cu_k)
    k, v = _rand(NUM_PAGES, PAGE, 1, 16, seed=2), _rand(NUM_PAGES, PAGE, 1, 16, seed=3)
    lengths = varlen.cu_seqlens_k[1:] - varlen.cu_seqlens_k[:-1]
    keys = KeyRanges(torch.zeros_like(lengths), lengths, 40, _i32(table))
    attention_forward(q, k, v, var, varlen, keys)
