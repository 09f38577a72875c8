"""flash_recipe in torch's flash-attention registry (``flash_recipe.integrations.sdpa_registry``).

torch routes SDPA's flash backend and ``varlen_attn`` to five aten ops; activating an
implementation replaces their kernels for the CUDA dispatch key. torch has no CPU kernel for those
ops, and SDPA on a CPU calls another op (``_scaled_dot_product_flash_attention_for_cpu``), so on
this CPU-only machine the tests register flash_recipe's kernels for the CPU key
(``register(dispatch_key="CPU")``) and call the ops the way torch's CUDA path calls them:
``torch.ops.aten._scaled_dot_product_flash_attention`` (what ``F.scaled_dot_product_attention``
calls on a GPU), with autograd through torch's own derivative formula, and
``torch.nn.attention.varlen.varlen_attn`` unchanged. Everything between the call and the kernel is
torch's real dispatcher. ``test_sdpa_on_a_gpu`` runs ``F.scaled_dot_product_attention`` itself
where a GPU is present. Every case counts the Triton kernel launches and checks the accuracy rule
against the fp32 reference (fp64 for fp32 inputs), forward and backward.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

import flash_recipe
from flash_recipe.integrations import sdpa_registry
from flash_recipe.reference import attention_reference, compute_dtype
from flash_recipe.testing.accuracy import FACTORS, assert_accurate

attention = pytest.importorskip("torch.nn.attention")
if not hasattr(attention, "register_flash_attention_impl"):
    pytest.skip(f"torch {torch.__version__} has no flash-attention registry", allow_module_level=True)

from torch.nn.attention import varlen  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SDPA = torch.ops.aten._scaled_dot_product_flash_attention


def _rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _cpu_kernels_run():
    if HAS_CUDA:  # tests/conftest.py switches the interpreter on only on machines without a GPU
        pytest.skip("the CPU-key tests run the kernels through Triton's interpreter, off on a GPU machine")


@pytest.fixture
def active():
    """flash_recipe active for the CPU key (module docstring: torch has no CPU route to the ops)."""
    _cpu_kernels_run()
    sdpa_registry.register(dispatch_key="CPU")
    attention.activate_flash_attention_impl(sdpa_registry.NAME)
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


@pytest.fixture
def launches(monkeypatch):
    """Counts the launches of flash_recipe's forward and backward Triton kernels."""
    from flash_recipe.ops import backward, forward

    counts = {"fwd": 0, "bwd": 0}
    # The backward's dK/dV kernel runs on both of its paths (one pass, or after the dQ kernel).
    for kind, kernel in (("fwd", forward.attn_fwd_kernel.fn), ("bwd", backward.attn_bwd_dkdv_kernel.fn)):
        # the jit functions under the heuristics: every launch ends in their ``run``

        def counted(*args, _run=kernel.run, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted)
    return counts


def _check_rule(got: dict, truth: dict, same: dict) -> None:
    """The accuracy rule (``flash_recipe.testing.accuracy``) for each named result."""
    for name, value in got.items():
        assert_accurate(name, value, truth[name], same[name], FACTORS[name])


def _oracle(q, k, v, dout, upcast, **options) -> dict:
    """Reference attention and gradients, flash-attn layout."""
    dtype = compute_dtype(q.dtype, upcast)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention_reference(*leaves, upcast=upcast, **options)
    out.backward(dout.to(out.dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


SDPA_CASES = [
    # (batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, is_causal, scale, dtype)
    pytest.param(2, 2, 2, 13, 13, 16, True, None, torch.float16, id="B2-H2-S13-causal-fp16"),
    pytest.param(1, 4, 2, 9, 21, 16, True, 0.3, torch.float32, id="B1-H4-Hk2-Sq9-Sk21-causal-topleft-scale-fp32"),
    pytest.param(1, 4, 1, 17, 11, 32, False, None, torch.float16, id="B1-H4-Hk1-Sq17-Sk11-gqa-fp16"),
]


@pytest.mark.parametrize("batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, causal, scale, dtype", SDPA_CASES)
def test_sdpa_op_runs_flash_recipe(
    active, launches, batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, causal, scale, dtype
):
    """The op SDPA's flash backend calls, forward and (through torch's derivative formula)
    backward: GQA as SDPA passes it (fewer key heads), causal aligned top-left, scale."""
    q = _rand(batch, nheads, seqlen_q, headdim, dtype=dtype, seed=1)
    k, v = (_rand(batch, nheads_k, seqlen_k, headdim, dtype=dtype, seed=s) for s in (2, 3))
    dout = _rand(batch, nheads, seqlen_q, headdim, dtype=dtype, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = SDPA(*leaves, 0.0, causal, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, offset, debug = result
    assert launches == {"fwd": 1, "bwd": 0}
    out.backward(dout)
    assert launches == {"fwd": 1, "bwd": 1}
    assert (cum_q, cum_k, max_q, max_k) == (None, None, seqlen_q, seqlen_k)
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,) and offset.shape == ()
    assert debug.numel() == 0 and out.stride() == q.stride()
    options = dict(softmax_scale=scale, causal=causal, diag_offset=0)  # top-left
    flash = [t.transpose(1, 2) for t in (q, k, v, dout)]
    truth = _oracle(*flash, upcast=True, **options)
    same = _oracle(*flash, upcast=False, **options)
    got = {
        "out": out.detach().transpose(1, 2),
        **{n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), leaves)},
    }
    _check_rule(got, truth, same)
    expected_lse = attention_reference(*(t.double() for t in flash[:3]), **options)[1]
    torch.testing.assert_close(lse, expected_lse.float(), atol=1e-3, rtol=1e-3)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


VARLEN_CASES = [
    # (lengths, nheads, nheads_k, window, dtype)
    pytest.param([5, 11, 1], 2, 2, (-1, 0), torch.float16, id="causal-fp16"),
    pytest.param([9, 14], 4, 2, (3, 0), torch.float32, id="gqa-window3-causal-fp32"),
    pytest.param([12, 7], 2, 1, (2, 4), torch.float16, id="mqa-window2-4-fp16"),
]


@pytest.mark.parametrize("lengths, nheads, nheads_k, window, dtype", VARLEN_CASES)
def test_varlen_attn_runs_flash_recipe(active, launches, lengths, nheads, nheads_k, window, dtype):
    """torch's ``varlen_attn``, unchanged: each packed sequence against the reference on its own."""
    cu = _offsets(lengths)
    total = sum(lengths)
    q = _rand(total, nheads, 16, dtype=dtype, seed=1)
    k, v = (_rand(total, nheads_k, 16, dtype=dtype, seed=s) for s in (2, 3))
    dout = _rand(total, nheads, 16, dtype=dtype, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gqa = {}
    if nheads_k < nheads:
        if "enable_gqa" not in inspect.signature(varlen.varlen_attn).parameters:
            pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa (torch 2.11 has none)")
        gqa = {"enable_gqa": True}
    out = varlen.varlen_attn(*leaves, cu, cu, max(lengths), max(lengths), window_size=window, **gqa)
    assert launches == {"fwd": 1, "bwd": 0}
    out.backward(dout)
    assert launches == {"fwd": 1, "bwd": 1}
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        parts = [t[rows].unsqueeze(0) for t in (q, k, v, dout)]
        truth = _oracle(*parts, upcast=True, window=window)
        same = _oracle(*parts, upcast=False, window=window)
        got = {"out": out.detach()[rows], **{n: t.grad[rows] for n, t in zip(("dq", "dk", "dv"), leaves)}}
        _check_rule(got, {n: t[0] for n, t in truth.items()}, {n: t[0] for n, t in same.items()})


@pytest.mark.skipif(not hasattr(varlen, "varlen_attn_out"), reason="varlen_attn_out is new in torch 2.12")
def test_varlen_attn_out_writes_in_place(active, launches):
    """``varlen_attn_out`` reaches ``_flash_attention_forward_no_dropout_inplace``."""
    cu = _offsets([6, 10])
    q, k, v = (_rand(16, 2, 16, dtype=torch.float16, seed=s) for s in (1, 2, 3))
    out = torch.full_like(q, float("nan"))
    _, lse = varlen.varlen_attn_out(out, q, k, v, cu, cu, 10, 10, return_aux=varlen.AuxRequest(lse=True))
    assert launches["fwd"] == 1 and lse.shape == (2, 16)
    with flash_recipe.use_backend("triton"):
        expected = flash_recipe.flash_attn_varlen_func(q, k, v, cu, cu, 10, 10)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_seqused_k_and_block_table(active):
    """Forward only, as ``varlen_attn`` documents them: ``seqused_k`` keeps the first keys of each
    slot; ``block_table`` reads the keys from pages. Both equal a plain varlen call on those keys."""
    lengths_q, slots, used = [3, 1, 4], [9, 20, 6], [7, 20, 0]
    cu_q, cu_slots, cu_used = _offsets(lengths_q), _offsets(slots), _offsets(used)
    q = _rand(sum(lengths_q), 4, 16, dtype=torch.float16, seed=1)
    k, v = (_rand(sum(slots), 2, 16, dtype=torch.float16, seed=s) for s in (2, 3))
    kept = torch.cat([torch.arange(int(cu_slots[b]), int(cu_slots[b]) + used[b]) for b in range(3)])
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters else {}
    if not gqa:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no enable_gqa")
    with flash_recipe.use_backend("triton"):
        expected = flash_recipe.flash_attn_varlen_func(q, k[kept], v[kept], cu_q, cu_used, 4, 20, causal=True)
    seqused = torch.tensor(used, dtype=torch.int32)
    got = varlen.varlen_attn(q, k, v, cu_q, cu_slots, 4, 20, window_size=(-1, 0), seqused_k=seqused, **gqa)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # The same keys in pages of 16 rows, sequence b in pages table[b], shuffled in the pool.
    pages_k, pages_v = (torch.zeros(6, 16, 2, 16, dtype=torch.float16) for _ in range(2))
    table = torch.tensor([[4, 0], [1, 5], [3, 2]], dtype=torch.int32)
    for b in range(3):
        rows = k[int(cu_slots[b]) : int(cu_slots[b]) + used[b]], v[int(cu_slots[b]) : int(cu_slots[b]) + used[b]]
        for j in range(used[b]):
            page, row = int(table[b, j // 16]), j % 16
            pages_k[page, row], pages_v[page, row] = rows[0][j], rows[1][j]
    got = varlen.varlen_attn(
        q, pages_k, pages_v, cu_q, None, 4, 20, window_size=(-1, 0), seqused_k=seqused, block_table=table, **gqa
    )
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="page indices"):
        varlen.varlen_attn(q, pages_k, pages_v, cu_q, None, 4, 20, seqused_k=seqused, block_table=table + 6, **gqa)


def test_flash_attention_forward_dense_is_bottom_right(active):
    """The flash-attn-layout op aligns is_causal bottom-right, as flash-attn (torch's FA2) does, and
    returns the five-tuple; its backward op agrees with flash_recipe's flash_attn_func."""
    q = _rand(1, 3, 2, 16, seed=1)
    k, v = (_rand(1, 7, 2, 16, seed=s) for s in (2, 3))
    out, lse, rng_state, offset, debug = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, 3, 7, 0.0, True, False, scale=None
    )
    expected, expected_lse = attention_reference(q.double(), k.double(), v.double(), causal=True)  # bottom-right
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert lse.shape == (1, 2, 3) and rng_state.shape == (2,) and debug.numel() == 0
    dout = _rand(1, 3, 2, 16, seed=4)
    grads = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, None, None, 3, 7, 0.0, True, rng_state, offset
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with flash_recipe.use_backend("triton"):
        flash_recipe.flash_attn_func(*leaves, causal=True).backward(dout)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, atol=1e-6, rtol=1e-6)


def test_dropout_round_trips_its_seed(active):
    """With dropout the forward returns its seed in rng_state and the backward regenerates the
    same mask: the same numbers as flash_recipe.scaled_dot_product_attention from the same seed."""
    q, k, v = (_rand(1, 2, 11, 16, seed=s) for s in (1, 2, 3))
    results = []
    for route in ("op", "api"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        if route == "op":
            out = SDPA(*leaves, 0.3, False, False)[0]
        else:
            with flash_recipe.use_backend("triton"):
                out = flash_recipe.scaled_dot_product_attention(*leaves, dropout_p=0.3)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), *(t.grad for t in leaves)])
    assert not torch.allclose(results[0][0], SDPA(q, k, v)[0], atol=1e-3)  # dropout changed something
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_torch_compile_fullgraph(active, launches):
    """A module calling the SDPA op compiles whole (fake tensors through torch's meta functions) and
    runs flash_recipe's kernels, forward and backward."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16).to(torch.float16)

        def forward(self, q, k, v):
            return self.proj(SDPA(q, k, v, 0.0, True, False)[0]).float().sum()

    model = Attention()
    q, k, v = (_rand(1, 2, 9, 16, dtype=torch.float16, seed=s).requires_grad_() for s in (1, 2, 3))
    model(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = dict(launches)
    compiled(q, k, v).backward()
    assert launches["fwd"] > before["fwd"] and launches["bwd"] > before["bwd"]
    for got, expected in zip((q.grad, k.grad, v.grad), eager):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch._dynamo.reset()


def test_restore_gives_torch_behaviour_back():
    """Before activation and after restore the ops have no CPU kernel, as in torch itself."""
    _cpu_kernels_run()
    q = _rand(1, 2, 5, 16, dtype=torch.float16)

    def has_cpu_kernel():
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_flash_attention_forward", "CPU")

    assert not has_cpu_kernel()
    sdpa_registry.register(dispatch_key="CPU")
    assert sdpa_registry.NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None  # registered, not active
    attention.activate_flash_attention_impl(sdpa_registry.NAME)
    try:
        assert has_cpu_kernel() and attention.current_flash_attention_impl() == sdpa_registry.NAME
        assert SDPA(q, q, q)[0].shape == q.shape
    finally:
        attention.restore_flash_attention_impl()
    assert not has_cpu_kernel() and attention.current_flash_attention_impl() is None
    with pytest.raises(NotImplementedError, match="CPU"):
        SDPA(q, q, q)


def test_import_registers_nothing():
    import subprocess
    import sys

    code = (
        "import torch.nn.attention as a, flash_recipe.integrations.sdpa_registry; "
        "assert 'flash_recipe' not in a.list_flash_attention_impls(); assert a.current_flash_attention_impl() is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda q: SDPA(q, q, q, 0.0, False, True), "return_debug_mask=True is not supported"),
        (
            lambda q: torch.ops.aten._flash_attention_forward(
                q, q, q, None, None, 5, 5, 0.0, False, False, alibi_slopes=torch.ones(2)
            ),
            "alibi_slopes is not supported",
        ),
        (
            lambda q: torch.ops.aten._flash_attention_forward(
                q, q, q, None, None, 5, 5, 0.0, False, False, seqused_k=torch.ones(1, dtype=torch.int32)
            ),
            "need packed queries",
        ),
        (lambda q: SDPA(q.bfloat16(), q.bfloat16(), q.bfloat16()), "bfloat16"),
        (lambda q: SDPA(q, q, q[..., :8]), "head dim"),
    ],
    ids=["debug-mask", "alibi", "seqused-dense", "bf16-interpreter", "value-head-dim"],
)
def test_what_cannot_run_raises_clearly(active, call, words):
    with pytest.raises((NotImplementedError, ValueError), match=words):
        call(_rand(1, 2, 5, 16, dtype=torch.float16))


def test_torch_without_the_registry_is_named():
    """The one version gate, on a ``torch.nn.attention`` as torch 2.9.1 ships it (SDPA's backend
    selection, no registry functions)."""
    old = types.ModuleType("torch.nn.attention")
    old.sdpa_kernel, old.SDPBackend = attention.sdpa_kernel, attention.SDPBackend
    with pytest.raises(RuntimeError, match=r"first appears in torch 2\.10"):
        sdpa_registry.check_registry(old)
    assert sdpa_registry.check_registry() is attention
    with pytest.raises(ValueError, match="dispatch_key must be"):
        sdpa_registry.register(dispatch_key="Meta")


def test_torch_2_10_registry_without_restore_is_accepted(monkeypatch):
    """torch 2.10.0's ``torch.nn.attention`` has register, activate, list and current, but no
    ``restore_flash_attention_impl`` (read from its wheel): the gate accepts it, and a refusal
    names the way back that exists there."""
    shaped = types.ModuleType("torch.nn.attention")
    for name in (
        "register_flash_attention_impl",
        "activate_flash_attention_impl",
        "list_flash_attention_impls",
        "current_flash_attention_impl",
    ):
        setattr(shaped, name, getattr(attention, name))
    assert sdpa_registry.check_registry(shaped) is shaped
    assert "restore_flash_attention_impl() gives torch's kernels back" in sdpa_registry._back_to_torch()
    monkeypatch.delattr(attention, "restore_flash_attention_impl")
    assert "call flash_recipe.scaled_dot_product_attention" in sdpa_registry._back_to_torch()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (SDPA reaches the registered ops only there)")
def test_sdpa_on_a_gpu(launches):
    """``F.scaled_dot_product_attention`` in ``sdpa_kernel(FLASH_ATTENTION)`` on a GPU, with GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_registry.register()
    q = _rand(2, 4, 128, 64, dtype=torch.float16, seed=1, device="cuda").requires_grad_()
    k, v = (_rand(2, 2, 128, 64, dtype=torch.float16, seed=s, device="cuda").requires_grad_() for s in (2, 3))
    attention.activate_flash_attention_impl(sdpa_registry.NAME)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
    finally:
        attention.restore_flash_attention_impl()
    assert launches == {"fwd": 1, "bwd": 1}
    flash = [t.detach().transpose(1, 2) for t in (q, k, v)]
    truth = _oracle(*flash, torch.ones_like(flash[0]), upcast=True, causal=True, diag_offset=0)
    same = _oracle(*flash, torch.ones_like(flash[0]), upcast=False, causal=True, diag_offset=0)
    got = {
        "out": out.detach().transpose(1, 2),
        **{n: t.grad.transpose(1, 2) for n, t in zip(("dq", "dk", "dv"), (q, k, v))},
    }
    _check_rule(got, truth, same)
