"""flash_attn_with_kvcache and paged varlen keys, against an oracle written out here.

The oracle rebuilds each batch entry's cache as one dense tensor, applies the update, rotates with
complex multiplication, and runs the fp32 reference on the visible rows; outputs follow the
accuracy rule (2x PyTorch's own same-precision error), and the cache after the call must hold
exactly the rows the oracle wrote. On the CPU the Triton kernels run in the interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import flash_recipe
from flash_recipe import memo_keys, validate
from flash_recipe.reference import attention_reference, compute_dtype
from flash_recipe.testing import FORWARD_FACTOR, assert_accurate, rotary

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")


def _rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class KV:
    batch: int = 2
    seqlen_q: int = 1
    new: int = 1  # new tokens appended (0: none)
    nheads: int = 4
    nheads_k: int = 2
    head_dim: int = 32
    seqlens: tuple = (5, 40)  # filled rows before the call
    capacity: int = 64  # rows per cache entry
    page: int = 0  # page size; 0: a dense cache
    batch_idx: bool = False
    leftpad: Optional[tuple] = None
    rotary: int = 0  # rotary_dim; 0: none
    interleaved: bool = True
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    splits: int = 1

    @property
    def id(self) -> str:
        parts = [f"q{self.seqlen_q}", f"new{self.new}", f"H{self.nheads}-{self.nheads_k}", f"D{self.head_dim}"]
        parts.append(f"page{self.page}" if self.page else "dense")
        for flag, name in (
            (self.batch_idx, "batchidx"),
            (self.leftpad, "leftpad"),
            (self.causal, "causal"),
            (self.alibi, "alibi"),
            (self.softcap, "softcap"),
        ):
            if flag:
                parts.append(name)
        if self.rotary:
            parts.append(f"rot{self.rotary}{'i' if self.interleaved else 'n'}")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}.{self.window[1]}")
        parts.append(f"split{self.splits}")
        return "-".join(parts)


CASES = [
    KV(),  # one token decoding step, GQA
    KV(seqlen_q=3, new=3, batch_idx=True, leftpad=(2, 0), rotary=16, splits=3),
    KV(page=16, rotary=16, interleaved=False, window=(8, 0), splits=2),
    KV(
        batch=3,
        seqlen_q=4,
        new=4,
        seqlens=(0, 17, 30),
        page=32,
        rotary=8,
        causal=False,
        softcap=3.0,
        alibi=True,
        nheads=2,
        nheads_k=1,
        head_dim=24,
    ),
    KV(new=0, seqlens=(64, 64), causal=False, splits=4),  # attention over a full cache, nothing appended
    KV(seqlen_q=20, new=20, seqlens=(3, 20), page=16, leftpad=(1, 7), nheads=2, nheads_k=2, head_dim=16),
    KV(head_dim=40, rotary=16, seqlens=(9, 0), capacity=48, page=16, batch_idx=False, splits=2),
    # GQA groups packed into one query tile (flash_recipe.ops.packing.gqa_packing) with every option
    # that keeps packing: group 8 with two query rows, ALiBi, softcap, a window and split-KV over pages;
    # group 3 (not a power of two) with left padding, a two-sided window and a batch index; a window
    # at the cache's edge (each row sees only its own key); group 2 at head dim 24.
    KV(seqlen_q=2, new=2, nheads=8, nheads_k=1, head_dim=40, page=16, window=(5, 0), alibi=True, softcap=2.0, splits=3),
    KV(
        seqlen_q=4,
        new=0,
        nheads=6,
        nheads_k=2,
        leftpad=(3, 0),
        window=(20, 2),
        causal=False,
        seqlens=(64, 33),
        batch_idx=True,
    ),
    KV(nheads=4, nheads_k=1, window=(0, 0), seqlens=(63, 1), splits=2),
    KV(seqlen_q=3, new=3, nheads=4, nheads_k=2, head_dim=24, rotary=8, seqlens=(0, 50), page=32, splits=4),
]


def _make(case: KV, dtype, device):
    """Inputs of one case: q, the cache (dense or paged), new k/v, rotary tables and metadata."""
    b, hk, d = case.batch, case.nheads_k, case.head_dim
    q = _rand(b, case.seqlen_q, case.nheads, d, dtype=dtype, device=device, seed=1)
    k_new = _rand(b, case.new, hk, d, dtype=dtype, device=device, seed=2) if case.new else None
    v_new = _rand(b, case.new, hk, d, dtype=dtype, device=device, seed=3) if case.new else None
    args = dict(
        cache_seqlens=torch.tensor(case.seqlens, dtype=torch.int32, device=device),
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        num_splits=case.splits,
        return_softmax_lse=True,
    )
    if case.page:
        width = case.capacity // case.page
        num_pages = b * width + 3
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(4))[: b * width]
        args["block_table"] = perm.view(b, width).to(device=device, dtype=torch.int32)
        cache_shape = (num_pages, case.page, hk, d)
    else:
        rows = b + 2 if case.batch_idx else b
        cache_shape = (rows, case.capacity, hk, d)
        if case.batch_idx:
            args["cache_batch_idx"] = torch.tensor([rows - 1 - i for i in range(b)], dtype=torch.int32, device=device)
    k_cache = _rand(*cache_shape, dtype=dtype, device=device, seed=5)
    v_cache = _rand(*cache_shape, dtype=dtype, device=device, seed=6)
    if case.leftpad:
        args["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.rotary:
        angle = _rand(case.capacity, case.rotary // 2, seed=7) * 3.0
        args.update(
            rotary_cos=angle.cos().to(device=device, dtype=dtype),
            rotary_sin=angle.sin().to(device=device, dtype=dtype),
            rotary_interleaved=case.interleaved,
        )
    if case.alibi:
        args["alibi_slopes"] = (_rand(b, case.nheads, seed=8).abs() * 0.3).to(device)
    return q, k_cache, v_cache, k_new, v_new, args


def _entry(cache: torch.Tensor, case: KV, args: dict, b: int) -> torch.Tensor:
    """Batch entry ``b``'s cache as one dense ``(capacity, Hk, D)`` tensor."""
    if case.page:
        return torch.cat([cache[p] for p in args["block_table"][b].tolist()])
    row = args["cache_batch_idx"][b].item() if case.batch_idx else b
    return cache[row]


def _rotate(x: torch.Tensor, cos, sin, positions, interleaved: bool) -> torch.Tensor:
    """Rotary embedding computed in fp64 (the truth), rounded to x's dtype."""
    return rotary(x, cos, sin, positions, interleaved, torch.float64).to(x.dtype)


def _oracle(case: KV, q, k_cache, v_cache, k_new, v_new, args, upcast: bool):
    """Expected (out, lse, per-entry caches after the update) in high or the input precision."""
    outs, lses, k_entries, v_entries = [], [], [], []
    moves = case.causal or case.window != (-1, -1)
    for b in range(case.batch):
        n, pad = case.seqlens[b], case.leftpad[b] if case.leftpad else 0
        ke, ve = _entry(k_cache, case, args, b).clone(), _entry(v_cache, case, args, b).clone()
        qb = q[b : b + 1]
        if case.new:
            kb = k_new[b : b + 1]
            if case.rotary:
                positions = torch.arange(n, n + case.new)[None]
                kb = _rotate(
                    kb.cpu(), args["rotary_cos"].cpu(), args["rotary_sin"].cpu(), positions, case.interleaved
                ).to(q.device)
            ke[n : n + case.new], ve[n : n + case.new] = kb[0], v_new[b]
        if case.rotary:
            positions = (n + (torch.arange(case.seqlen_q) if moves else torch.zeros(case.seqlen_q, dtype=torch.long)))[
                None
            ]
            qb = _rotate(qb.cpu(), args["rotary_cos"].cpu(), args["rotary_sin"].cpu(), positions, case.interleaved).to(
                q.device
            )
        keys, values = ke[pad : n + case.new][None], ve[pad : n + case.new][None]
        slopes = args["alibi_slopes"][b] if case.alibi else None
        high = compute_dtype(q.dtype, upcast)
        out, lse = attention_reference(
            qb.to(high),
            keys.to(high),
            values.to(high),
            case.head_dim**-0.5,
            case.causal,
            keys.shape[1] - case.seqlen_q,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=slopes,
            upcast=upcast,
        )
        outs.append(out)
        lses.append(lse)
        k_entries.append(ke)
        v_entries.append(ve)
    return torch.cat(outs), torch.cat(lses), k_entries, v_entries


# One rounding of a value of magnitude up to ~4 to the dtype (half an ulp, relative and absolute).
ROUNDING = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _check(case: KV, dtype, device, backend: str):
    q, k_cache, v_cache, k_new, v_new, args = _make(case, dtype, device)
    truth, truth_lse, k_want, v_want = _oracle(case, q, k_cache, v_cache, k_new, v_new, args, upcast=True)
    same, _, _, _ = _oracle(case, q, k_cache, v_cache, k_new, v_new, args, upcast=False)
    with flash_recipe.use_backend(backend):
        out, lse = flash_recipe.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **args)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (case.batch, case.nheads, case.seqlen_q)
    assert out.isfinite().all()
    assert_accurate("out", out, truth, same, FORWARD_FACTOR)
    torch.testing.assert_close(lse, truth_lse.float(), **ROUNDING[dtype])
    for b in range(case.batch):  # the update went exactly where the oracle put it, nowhere else
        rot_tol = ROUNDING[dtype]  # the rotated keys are rounded to the cache dtype once
        torch.testing.assert_close(
            _entry(k_cache, case, args, b), k_want[b], **(rot_tol if case.rotary else dict(atol=0, rtol=0))
        )
        assert torch.equal(_entry(v_cache, case, args, b), v_want[b])


BF16_ON_GPU = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the Triton interpreter computes bf16 dot products incorrectly"
    ),
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, BF16_ON_GPU], ids=["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kvcache_triton(case, dtype, device, nan_outputs):
    _check(case, dtype, device, "triton")


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=lambda c: c.id)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_kvcache_torch_backends(case, backend, device):
    if backend == "sdpa":  # SDPA returns no log-sum-exp and has no softcap
        case = dataclasses.replace(case, softcap=0.0)
        q, k_cache, v_cache, k_new, v_new, args = _make(case, torch.float32, device)
        args["return_softmax_lse"] = False
        truth, _, _, _ = _oracle(case, q, k_cache, v_cache, k_new, v_new, args, upcast=True)
        with flash_recipe.use_backend("sdpa"):
            out = flash_recipe.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **args)
        torch.testing.assert_close(out.double(), truth.double(), atol=1e-5, rtol=1e-5)
        return
    _check(case, torch.float32, device, backend)


def test_split_kv_matches_unsplit(device):
    """Splitting the keys over programs and merging gives the unsplit result (fp32)."""
    case = KV(
        batch=2, seqlens=(100, 37), capacity=128, page=16, causal=True, splits=1, nheads=2, nheads_k=1, head_dim=16
    )
    results = []
    for splits in (1, 2, 5, 16):  # 16 shares of 7 blocks: some shares are empty
        q, k_cache, v_cache, k_new, v_new, args = _make(case, torch.float32, device)
        args["num_splits"] = splits
        with flash_recipe.use_backend("triton"):
            results.append(flash_recipe.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **args))
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=2e-6, rtol=1e-5)


@pytest.fixture
def metadata_as_on_a_gpu(monkeypatch):
    """Metadata tensors taken for device memory (``validate.on_host`` False, as ``host_cost`` does),
    so that a repeated call takes the memoized path; every memo empty before and after."""
    monkeypatch.setattr(validate, "on_host", lambda t: False)
    memo_keys.forget()
    memo_keys.SHARED_INDEXES.clear()
    yield
    memo_keys.forget()
    memo_keys.SHARED_INDEXES.clear()


def test_repeated_steps_share_one_row_index_and_one_zero_start(device, metadata_as_on_a_gpu):
    """A repeated decoding step without a batch index, page table or left padding reads the cache
    rows and the key ranges' starts from indexes made once per batch size (``memo_keys.shared_index``),
    not computed per call: two batch sizes interleaved, each call meeting the rule."""
    two, three = KV(), KV(batch=3, seqlens=(5, 40, 17))
    for case in (two, three, two, three, two):
        _check(case, torch.float16, device, "triton")
    shared = memo_keys.SHARED_INDEXES
    assert set(shared) == {(kind, b, device) for kind in ("rows", "zeros") for b in (2, 3)}
    for b in (2, 3):
        assert shared[("rows", b, device)].tolist() == [[i] for i in range(b)]
        assert shared[("zeros", b, device)].tolist() == [0] * b
        assert all(t.dtype == torch.int32 for t in (shared[("rows", b, device)], shared[("zeros", b, device)]))


def test_a_repeated_step_reads_the_shared_row_index(device, metadata_as_on_a_gpu):
    """The shared index is what the kernels read: planted with the two rows swapped, the next
    repeated call attends over (and appends into) the other entry's cache, and fails the rule."""
    case = KV()
    _check(case, torch.float16, device, "triton")
    _check(case, torch.float16, device, "triton")
    memo_keys.SHARED_INDEXES[("rows", 2, device)] = torch.tensor([[1], [0]], dtype=torch.int32, device=device)
    with pytest.raises(AssertionError):
        _check(case, torch.float16, device, "triton")


def test_a_shared_index_is_kept_only_where_it_may_outlive_the_call(monkeypatch, metadata_as_on_a_gpu):
    """Not kept while a CUDA graph is captured or torch.compile traces (``_may_keep``), nor past the
    limit: each such call gets an index of its own. A kind outside the two is refused by name.
    (The GPU's stream synchronisation before an index is kept needs a GPU: not run here.)"""
    cpu = torch.device("cpu")
    with monkeypatch.context() as patch:
        patch.setattr(memo_keys, "_may_keep", lambda device: False)
        first, second = memo_keys.shared_index("rows", 4, cpu), memo_keys.shared_index("rows", 4, cpu)
    assert first is not second and not memo_keys.SHARED_INDEXES
    assert first.tolist() == [[0], [1], [2], [3]]
    assert memo_keys._may_keep(cpu)
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not memo_keys._may_keep(cpu)
    monkeypatch.setattr(memo_keys, "SHARED_INDEXES_LIMIT", 1)
    kept = memo_keys.shared_index("zeros", 4, cpu)
    assert list(memo_keys.SHARED_INDEXES) == [("zeros", 4, cpu)] and memo_keys.SHARED_INDEXES[("zeros", 4, cpu)] is kept
    assert memo_keys.shared_index("zeros", 5, cpu).tolist() == [0] * 5 and len(memo_keys.SHARED_INDEXES) == 1
    with pytest.raises(ValueError, match="kind must be 'zeros' or 'rows'"):
        memo_keys.shared_index("ones", 4, cpu)


def test_bad_metadata_on_the_device_gives_nan_not_stray_access(device):
    """The kernel-level guard for metadata the host does not read (GPU tensors): a page index out of
    range or an end past the table makes that batch entry NaN and writes nothing outside the cache;
    the other entries are untouched."""
    from flash_recipe.ops.kvcache import Cache, attention_kvcache
    from flash_recipe.ops.options import ScoreOptions

    q = _rand(3, 1, 2, 16, device=device, seed=1)
    k_cache, v_cache = (_rand(6, 16, 2, 16, device=device, seed=s) for s in (2, 3))
    k_new, v_new = (_rand(3, 1, 2, 16, device=device, seed=s) for s in (4, 5))
    table = torch.tensor([[0, 1], [2, 99], [4, 5]], dtype=torch.int32, device=device)  # entry 1: page 99
    seqlens = torch.tensor([3, 20, 32], dtype=torch.int32, device=device)  # entry 2: full, the new row overflows
    before_k = k_cache.clone()
    out, lse = attention_kvcache(
        q,
        k_new,
        v_new,
        Cache(k_cache, v_cache, table, seqlens, None),
        None,
        ScoreOptions(softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None),
        num_splits=2,
    )
    assert out[0].isfinite().all() and lse[0].isfinite().all()
    assert out[1].isnan().all() and out[2].isnan().all()
    changed = (k_cache != before_k).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[0, 3]], changed  # only entry 0's new row; entry 1's row 20 maps to page 99


BAD = [
    (
        "page-size",
        dict(
            k_cache=torch.zeros(4, 8, 1, 16),
            v_cache=torch.zeros(4, 8, 1, 16),
            block_table=torch.zeros(1, 2, dtype=torch.int32),
        ),
        ValueError,
        ["page size", "multiple of 16", "8"],
    ),
    (
        "page-index",
        dict(block_table=torch.tensor([[0, 7]], dtype=torch.int32), cache_seqlens=20),
        ValueError,
        ["block_table[0]", "[7]", "[0, 4)"],
    ),
    ("table-dtype", dict(block_table=torch.zeros(1, 2, dtype=torch.int64)), TypeError, ["block_table", "int32"]),
    (
        "overflow",
        dict(
            cache_seqlens=torch.tensor([32], dtype=torch.int32),
            k=torch.zeros(1, 1, 1, 16),
            v=torch.zeros(1, 1, 1, 16),
            block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        ),
        ValueError,
        ["cache overflow", "32 + 1", "capacity 32"],
    ),
    (
        "overflow-int",
        dict(cache_seqlens=64, k=torch.zeros(1, 1, 1, 16), v=torch.zeros(1, 1, 1, 16)),
        ValueError,
        ["cache overflow", "64 + 1"],
    ),
    ("seqlens-dtype", dict(cache_seqlens=torch.tensor([3], dtype=torch.int64)), TypeError, ["cache_seqlens", "int32"]),
    (
        "seqlens-shape",
        dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32)),
        ValueError,
        ["cache_seqlens", "(1,)"],
    ),
    (
        "leftpad",
        dict(cache_seqlens=3, cache_leftpad=torch.tensor([5], dtype=torch.int32)),
        ValueError,
        ["cache_leftpad[0] = 5", "[0, cache_seqlens[0] = 3]"],
    ),
    (
        "batch-idx",
        dict(cache_batch_idx=torch.tensor([4], dtype=torch.int32)),
        ValueError,
        ["cache_batch_idx", "[4]", "[0, 4)"],
    ),
    (
        "batch-idx-and-table",
        dict(cache_batch_idx=torch.tensor([0], dtype=torch.int32), block_table=torch.zeros(1, 2, dtype=torch.int32)),
        ValueError,
        ["cache_batch_idx", "block_table"],
    ),
    ("k-without-v", dict(k=torch.zeros(1, 1, 1, 16)), ValueError, ["k and v"]),
    ("k-heads", dict(k=torch.zeros(1, 1, 2, 16), v=torch.zeros(1, 1, 2, 16)), ValueError, ["nheads_k = 1"]),
    (
        "rotary-without-k",
        dict(rotary_cos=torch.zeros(64, 4), rotary_sin=torch.zeros(64, 4)),
        ValueError,
        ["pass k and v"],
    ),
    (
        "rotary-too-wide",
        dict(
            rotary_cos=torch.zeros(64, 9),
            rotary_sin=torch.zeros(64, 9),
            k=torch.zeros(1, 1, 1, 16),
            v=torch.zeros(1, 1, 1, 16),
            cache_seqlens=3,
        ),
        ValueError,
        ["rotary_dim", "18", "headdim = 16"],
    ),
    (
        "rotary-too-short",
        dict(
            rotary_cos=torch.zeros(8, 4),
            rotary_sin=torch.zeros(8, 4),
            k=torch.zeros(1, 1, 1, 16),
            v=torch.zeros(1, 1, 1, 16),
            cache_seqlens=10,
        ),
        ValueError,
        ["[0, 8)", "position 10"],
    ),
    ("num-splits", dict(num_splits=-1), ValueError, ["num_splits", ">= 0", "-1"]),
    ("window", dict(window_size=(-2, 0)), ValueError, ["window_size", "-1"]),
    ("alibi-shape", dict(alibi_slopes=torch.zeros(3)), ValueError, ["alibi_slopes", "(nheads,) = (2,)"]),
    ("cache-dtype", dict(k_cache=torch.zeros(4, 16, 1, 16, dtype=torch.float16)), TypeError, ["k_cache", "dtype"]),
]


@pytest.mark.parametrize("changes,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_kvcache_bad_input(changes, exc, words):
    args = dict(q=torch.zeros(1, 1, 2, 16), k_cache=torch.zeros(4, 16, 1, 16), v_cache=torch.zeros(4, 16, 1, 16))
    if "block_table" not in changes and "k_cache" not in changes:
        args["k_cache"], args["v_cache"] = torch.zeros(4, 64, 1, 16), torch.zeros(4, 64, 1, 16)
    args.update(changes)
    with pytest.raises(exc) as info:
        flash_recipe.flash_attn_with_kvcache(**args)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def _paged_copy(k: torch.Tensor, lengths: list, page: int, seed: int):
    """Scatter packed ``k (total, Hk, D)`` into shuffled pages; returns (pages, block_table)."""
    width = max(-(-n // page) for n in lengths)
    num_pages = len(lengths) * width + 2
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    pages = _rand(num_pages, page, *k.shape[1:], dtype=k.dtype, seed=seed).to(k.device)  # garbage where unused
    table = perm[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(n):
            pages[table[b, j // page], j % page] = k[start + j]
        start += n
    return pages, table.to(k.device)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_paged_varlen_equals_packed(backend, device):
    lengths_k = [20, 5, 33, 0]  # query lengths 3, 0, 17, 1
    cu_q = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 25, 58, 58], dtype=torch.int32, device=device)
    q = _rand(21, 4, 32, device=device, seed=1)
    k, v = (_rand(58, 2, 32, device=device, seed=s) for s in (2, 3))
    k_pages, table = _paged_copy(k, lengths_k, 16, seed=4)
    v_pages, _ = _paged_copy(v, lengths_k, 16, seed=4)
    options = dict(causal=True, window_size=(6, -1), return_attn_probs=True)
    with flash_recipe.use_backend(backend):
        want, want_lse, _ = flash_recipe.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 33, **options)
        got, got_lse, _ = flash_recipe.flash_attn_varlen_func(
            q, k_pages, v_pages, cu_q, cu_k, 17, 33, block_table=table, **options
        )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [(-1, -1), (4, -1)], ids=["causal", "causal-window4"])
def test_paged_varlen_decoding_packs_gqa_and_meets_the_accuracy_rule(window, device, nan_outputs):
    """What serving engines call: packed sequences of 1 to 4 query rows over a paged cache, GQA 4:1
    (each group packed into one query tile), against the fp32 reference by the accuracy rule."""
    lengths_q, lengths_k = [1, 2, 4, 1], [20, 5, 33, 9]
    cu_q = torch.tensor([0, 1, 3, 7, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 25, 58, 67], dtype=torch.int32, device=device)
    q = _rand(8, 8, 32, dtype=torch.float16, device=device, seed=1)
    k, v = (_rand(67, 2, 32, dtype=torch.float16, device=device, seed=s) for s in (2, 3))
    k_pages, table = _paged_copy(k, lengths_k, 16, seed=4)
    v_pages, _ = _paged_copy(v, lengths_k, 16, seed=4)
    with flash_recipe.use_backend("triton"):
        out = flash_recipe.flash_attn_varlen_func(
            q, k_pages, v_pages, cu_q, cu_k, 4, 33, causal=True, window_size=window, block_table=table
        )
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        qb, kb, vb = q[rows][None], k[int(cu_k[b]) : int(cu_k[b + 1])][None], v[int(cu_k[b]) : int(cu_k[b + 1])][None]
        results = []
        for upcast in (True, False):
            high = compute_dtype(q.dtype, upcast)
            results.append(
                attention_reference(
                    qb.to(high), kb.to(high), vb.to(high), 32**-0.5, True, nk - nq, window=window, upcast=upcast
                )[0][0]
            )
        assert_accurate(f"out of sequence {b}", out[rows], results[0], results[1], FORWARD_FACTOR)


def test_paged_varlen_refuses_bad_tables():
    q = torch.zeros(4, 2, 16)
    pages = torch.zeros(3, 16, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0\] holds page indices \[3\]"):
        flash_recipe.flash_attn_varlen_func(
            q, pages, pages, cu, cu, 4, 4, block_table=torch.tensor([[3]], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        flash_recipe.flash_attn_varlen_func(
            q, pages[:, :8], pages[:, :8], cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_forward_only_paths_run_on_inputs_that_require_grad(backend, device):
    """As flash-attn: paged varlen and the KV cache run their forward on inputs that require grad
    (as in a training loop that also decodes); only a backward through them raises, and clearly."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32, device=device)
    q = _rand(7, 2, 16, device=device, seed=1)
    pages = [_rand(4, 16, 2, 16, device=device, seed=s) for s in (2, 3)]
    calls = {
        "flash_attn_varlen_func with block_table": lambda q_, k_, v_: flash_recipe.flash_attn_varlen_func(
            q_, k_, v_, cu, cu_k, 4, 20, causal=True, block_table=table, return_attn_probs=True
        )[:2],
        "flash_attn_with_kvcache": lambda q_, k_, v_: flash_recipe.flash_attn_with_kvcache(
            q_[:4].view(2, 2, 2, 16), k_, v_, cache_seqlens=9, return_softmax_lse=True
        ),
    }
    for what, call in calls.items():
        with flash_recipe.use_backend(backend), torch.no_grad():
            want = call(q, *pages)
        leaves = [t.clone().requires_grad_() for t in (q, *pages)]
        with flash_recipe.use_backend(backend):
            got = call(*leaves)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
            assert g.requires_grad
        for result in got:  # the output and the log-sum-exp
            with pytest.raises(NotImplementedError, match=f"{what} has no backward"):
                result.sum().backward(retain_graph=True)
        assert all(t.grad is None for t in leaves)


def test_strided_metadata_is_read_as_its_values(device):
    """cache_seqlens, cache_leftpad, cache_batch_idx and block_table given as strided views (as
    slices of larger tensors) give exactly the result of their contiguous copies."""

    def strided(t: torch.Tensor) -> torch.Tensor:
        """``t``'s values as a view with stride 2 in every dim: every other element of a larger tensor."""
        big = torch.full([2 * n for n in t.shape], 10_000, dtype=t.dtype, device=t.device)
        view = big[tuple(slice(None, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view

    for case in (
        KV(seqlen_q=3, new=3, batch_idx=True, leftpad=(2, 0), splits=2),
        KV(batch=3, seqlens=(5, 17, 33), page=16, leftpad=(1, 0, 6), splits=3),
    ):
        q, k_cache, v_cache, k_new, v_new, args = _make(case, torch.float32, device)
        views = {
            name: strided(t)
            for name, t in args.items()
            if name in ("cache_seqlens", "cache_leftpad", "cache_batch_idx", "block_table")
        }
        assert all(not t.is_contiguous() for t in views.values())
        results = []
        for metadata in (args, {**args, **views}):
            caches = (k_cache.clone(), v_cache.clone())
            with flash_recipe.use_backend("triton"):
                results.append((flash_recipe.flash_attn_with_kvcache(q, *caches, k_new, v_new, **metadata), caches))
        (want, want_caches), (got, got_caches) = results
        for g, w in zip((*got, *got_caches), (*want, *want_caches)):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
