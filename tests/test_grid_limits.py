"""Every launch within CUDA's grid limits at any batch, and the folded grid's index arithmetic proven
on results.

CUDA allows ``2**31 - 1`` programs on grid axis 0 and 65535 on axes 1 and 2; every launcher puts the
batch (varlen: the sequence count; the dropout mask: batch * heads) on axis 2, so a batch past
65535 (window attention folding its windows into the batch) folds into axis 0
(``flash_recipe.ops.launch.fold_grid``) and the kernels undo the fold (``tiles.grid_id``).

- ``test_grids_stay_within_cudas_limits``: each launcher family at batch 70,000 and 1,000,000 (tiny
  sequences, CPU tensors): Triton's launch is replaced by a recorder (nothing runs), and every grid
  it receives is within the limits, folded, and covers the batch.
- ``test_a_folded_launch_computes_what_the_unfolded_one_does``: under the interpreter, each family
  at batch 5 with the axis limit lowered to 2 (a fold of 4 with 3 padding entries) or 3 (a fold of
  2), against the same call unfolded: exactly equal results (the fold only changes which program
  computes a tile; outputs start as NaN, so a tile no program writes shows), every access inside
  the launch's tensors (``tests/bounds.py``: the fold's padding programs touch nothing).
"""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe import memo_keys
from flash_recipe.ops import backward_launch, dropout, forward, int8_attention, launch
from flash_recipe.ops.options import ScoreOptions, Varlen

HEADS, HEADS_K, HEAD_DIM = 2, 1, 16


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Plans are memoised per signature, not per grid limit: forget them around each test."""
    memo_keys.forget()
    yield
    memo_keys.forget()


def _rand(*shape, seed: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _options(causal: bool, seqlen_q: int, seqlen_k: int, **extra) -> ScoreOptions:
    return ScoreOptions(
        softmax_scale=HEAD_DIM**-0.5,
        diag_offset=seqlen_k - seqlen_q,
        window_left=-1,
        window_right=0 if causal else -1,
        softcap=0.0,
        alibi_slopes=None,
        **extra,
    )


def _dense(batch: int, seqlen: int, heads: int = HEADS) -> tuple:
    return tuple(_rand(batch, seqlen, h, HEAD_DIM, seed=i) for i, h in enumerate((heads, HEADS_K, HEADS_K)))


def _packed(batch: int, seqlen: int) -> tuple:
    """Packed q, k, v and their ``Varlen``: sequence ``b`` has ``seqlen - b % 3`` rows (at least 1)."""
    lengths = torch.clamp(seqlen - torch.arange(batch) % 3, min=1).to(torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    q, k, v = (_rand(total, h, HEAD_DIM, seed=i) for i, h in enumerate((HEADS, HEADS_K, HEADS_K)))
    longest = int(lengths.max())
    return q, k, v, Varlen(cu, cu, longest, longest)


# Each family: (batch, seqlen) -> the tensors its launcher returns (or writes), and the batch its
# launches' grids carry on axis 2 (``fold_batch`` once folded).
def fwd_dense(batch, seqlen):
    q, k, v = _dense(batch, seqlen)
    return forward.attention_forward(q, k, v, _options(True, seqlen, seqlen))


def fwd_varlen(batch, seqlen):
    q, k, v, varlen = _packed(batch, seqlen)
    return forward.attention_forward(q, k, v, _options(True, varlen.max_seqlen_q, varlen.max_seqlen_k), varlen)


def fwd_packed_gqa(batch, seqlen):
    q, k, v = _dense(batch, seqlen)
    return forward.attention_forward(q[:, :1].contiguous(), k, v, _options(False, 1, seqlen), pack_gqa=True)


def _backward(q, k, v, options, varlen, deterministic):
    out, lse = forward.attention_forward(q, k, v, options, varlen)
    dout = _rand(*out.shape, seed=7)
    dq, dk, dv, _ = backward_launch.attention_backward(
        dout, q, k, v, out, lse, options, varlen, deterministic=deterministic
    )
    return out, lse, dq, dk, dv


def bwd_one_pass(batch, seqlen):
    return _backward(*_dense(batch, seqlen), _options(True, seqlen, seqlen), None, False)


def bwd_deterministic(batch, seqlen):
    return _backward(*_dense(batch, seqlen), _options(True, seqlen, seqlen), None, True)


def bwd_varlen(batch, seqlen):
    q, k, v, varlen = _packed(batch, seqlen)
    options = _options(True, varlen.max_seqlen_q, varlen.max_seqlen_k)
    return _backward(q, k, v, options, varlen, True) + _backward(q, k, v, options, varlen, False)[2:]


def decode(batch, seqlen):
    """A KV-cache step: rotary append of one new token per entry, split-KV forward, the merge."""
    q = _rand(batch, 1, HEADS, HEAD_DIM, seed=0)
    k_cache, v_cache = (
        _rand(batch, seqlen + 1, HEADS_K, HEAD_DIM, seed=1),
        _rand(batch, seqlen + 1, HEADS_K, HEAD_DIM, seed=2),
    )
    k_new, v_new = _rand(batch, 1, HEADS_K, HEAD_DIM, seed=3), _rand(batch, 1, HEADS_K, HEAD_DIM, seed=4)
    angles = torch.arange(seqlen + 1, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, HEAD_DIM // 2)
    seqlens = (torch.arange(batch, dtype=torch.int32) % seqlen) + 1
    with flash_recipe.use_backend("triton"):
        out, lse = flash_recipe.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k_new,
            v_new,
            rotary_cos=angles.cos().half(),
            rotary_sin=angles.sin().half(),
            cache_seqlens=seqlens,
            causal=True,
            num_splits=2,
            return_softmax_lse=True,
        )
    return out, lse, k_cache, v_cache


def int8_dense(batch, seqlen):
    q, k, v = _dense(batch, seqlen)
    return int8_attention.int8_attention(q, k, v, HEAD_DIM**-0.5, causal=True)


def int8_varlen(batch, seqlen):
    q, k, v, varlen = _packed(batch, seqlen)
    return int8_attention.int8_attention(
        q,
        k,
        v,
        HEAD_DIM**-0.5,
        True,
        cu_seqlens_q=varlen.cu_seqlens_q,
        cu_seqlens_k=varlen.cu_seqlens_k,
        max_seqlen_q=varlen.max_seqlen_q,
        max_seqlen_k=varlen.max_seqlen_k,
    )


def dropout_mask(batch, seqlen):
    return (dropout.dropout_mask(torch.tensor([1234], dtype=torch.int64), batch, HEADS, seqlen, seqlen + 3, 0.3),)


# family -> (function, the kernels it launches, grid-axis-2 entries per batch entry)
FAMILIES = {
    "fwd_dense": (fwd_dense, {"attn_fwd_kernel"}, 1),
    "fwd_varlen": (fwd_varlen, {"attn_fwd_kernel"}, 1),
    "fwd_packed_gqa": (fwd_packed_gqa, {"attn_fwd_kernel"}, 1),
    "bwd_one_pass": (bwd_one_pass, {"attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel"}, 1),
    "bwd_deterministic": (
        bwd_deterministic,
        {"attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"},
        1,
    ),
    "bwd_varlen": (
        bwd_varlen,
        {"attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"},
        1,
    ),
    "decode": (decode, {"rotary_append_kernel", "attn_fwd_kernel", "split_combine_kernel"}, 1),
    "int8_dense": (int8_dense, {"quantize_kernel", "attn_int8_kernel"}, 1),
    "int8_varlen": (int8_varlen, {"quantize_kernel", "attn_int8_kernel"}, 1),
    "dropout_mask": (dropout_mask, {"dropout_mask_kernel"}, HEADS),
}
VARLEN = ("fwd_varlen", "bwd_varlen", "int8_varlen")


def _recording(monkeypatch, call_through: bool) -> list:
    """Replace Triton's launch (``JITFunction.run``, and the interpreter's) by a recorder of
    ``(kernel name, grid, GRID_FOLD, fold_batch)``; ``call_through`` then runs the launch too."""
    from triton.runtime import interpreter, jit

    launches: list = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        original = cls.run

        def recorded(self, *args, grid, warmup, _original=original, **kwargs):
            launches.append((self.__name__, tuple(grid), kwargs["GRID_FOLD"], kwargs["fold_batch"]))
            if call_through:
                return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(cls, "run", recorded)
    return launches


@pytest.mark.parametrize("batch", [70_000, 1_000_000], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_grids_stay_within_cudas_limits(family, batch, monkeypatch):
    if batch > 70_000 and family not in VARLEN + ("fwd_dense", "dropout_mask"):
        pytest.skip("a million entries: the varlen launchers, the dense forward and the dropout mask")
    fn, kernels, per_entry = FAMILIES[family]
    launches = _recording(monkeypatch, call_through=False)
    fn(batch, 1 if family != "decode" else 2)
    assert {name for name, *_ in launches} == kernels
    for name, grid, fold, fold_batch in launches:
        assert grid[0] <= 2**31 - 1 and grid[1] <= 65535 and grid[2] <= 65535, (name, grid)
        assert fold > 1 and fold_batch == batch * per_entry, (name, grid, fold, fold_batch)
        assert (grid[2] - 1) * fold < fold_batch <= grid[2] * fold, (name, grid, fold)  # covers the batch, no more
        assert grid[0] % fold == 0, (name, grid, fold)


def test_a_batch_within_the_limit_launches_its_grid_unfolded(monkeypatch):
    launches = _recording(monkeypatch, call_through=False)
    fwd_dense(65535, 1)
    dropout_mask(65535 // HEADS, 1)
    assert [(grid[2], fold, fold_batch) for _, grid, fold, fold_batch in launches] == [
        (65535, 1, 1),
        (65535 // HEADS * HEADS, 1, 1),
    ]


def test_the_fold_is_the_least_power_of_two_that_fits():
    assert launch.fold_grid((3, 2, 65535)) == ((3, 2, 65535), 1)
    assert launch.fold_grid((3, 2, 65536)) == ((6, 2, 32768), 2)
    assert launch.fold_grid((3, 2, 70_000)) == ((6, 2, 35_000), 2)
    assert launch.fold_grid((1, 1, 1_000_000)) == ((16, 1, 62_500), 16)
    assert launch.fold_grid((5, 4, 2**31 - 1)) == ((5 * 2**16, 4, 32768), 2**16)


def test_what_cannot_fold_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"nheads must be at most 65535 .* got 65536"):
        launch.fold_grid((1, 65536, 1))
    with pytest.raises(ValueError, match=r"grid axis 0 would need 2147483647 \* 2 programs"):
        launch.fold_grid((2**31 - 1, 1, 65536))


@pytest.mark.parametrize("limit", [2, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_folded_launch_computes_what_the_unfolded_one_does(family, limit, monkeypatch, nan_outputs, bounds_checked):
    if limit == 3 and family not in ("fwd_dense", "bwd_deterministic", "int8_dense"):
        pytest.skip("a second fold (F = 2, one padding entry) for one family of each kind")
    fn, kernels, per_entry = FAMILIES[family]
    batch, seqlen = (5, 40) if family != "decode" else (5, 37)
    launches = _recording(monkeypatch, call_through=True)
    unfolded = fn(batch, seqlen)
    assert launches and all(fold == 1 for *_, fold, _ in launches)
    launches.clear()
    memo_keys.forget()
    monkeypatch.setattr(launch, "AXIS_LIMIT", limit)
    folded = fn(batch, seqlen)
    assert {name for name, *_ in launches} == kernels
    for name, grid, fold, fold_batch in launches:  # every launch folded, its padding past the batch
        assert fold > 1 and grid[2] <= limit and fold_batch == batch * per_entry, (name, grid, fold)
    assert len(folded) == len(unfolded)
    for i, (got, want) in enumerate(zip(folded, unfolded)):
        assert not want.is_floating_point() or want.isfinite().all(), (family, i)
        assert torch.equal(got, want), (family, i, (got.float() - want.float()).abs().nan_to_num(1e9).max())


@pytest.mark.slow
def test_the_compile_check_compiles_the_folded_launches():
    """The compile check's ``folded`` call compiles the forward, the backward and 8-bit attention as
    a launch with the batch folded into axis 0 compiles them (``GRID_FOLD`` 2): on sm90 every kernel
    fits, and a kernel compiled unfolded for that call fails its row (planted)."""
    from offline import compile_in_subprocess

    from devtools import compile_check

    rows = compile_in_subprocess("""
        import json
        from devtools import compile_check
        for row in compile_check.check_case(compile_check.Case("folded", "bfloat16", 128, "aligned"), "sm90"):
            print(json.dumps(row))
    """)
    kernels = {row["kernel"] for row in rows}
    assert {"fwd", "bwd_preprocess", "quantize"} <= kernels and kernels & {"int8", "int8_fp8"}, kernels
    assert all(row["grid_fold"] == 2 and row["ok"] and not row["spill_bytes"] for row in rows), rows
    planted = compile_check._verdict({**rows[0], "grid_fold": 1})
    assert not planted["ok"] and "GRID_FOLD 1" in planted["problems"][0]
