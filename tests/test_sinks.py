"""Attention sinks (``learnable_sink``): semantics at the limits, every entry point, errors, autograd.

The accuracy of the kernels with sinks against the reference is in test_kernels.py (its sink
cases) and test_fuzz.py (drawn sinks); here the edges: sinks of -inf and very large ones, rows
that see only the sink, varlen, dropout, the KV cache, torch.compile, the stand-in's ``s_aux``,
and the backends that cannot express sinks.
"""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe.reference import attention_reference, compute_dtype
from flash_recipe.testing import FACTORS, assert_accurate

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")


def _rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _sinks(nheads, value=0.0, device="cpu", dtype=torch.float32):
    return (value + torch.linspace(-1.0, 1.0, nheads)).to(device=device, dtype=dtype)


@pytest.mark.parametrize(
    "sink, message, error",
    [
        ([0.0, 1.0], "learnable_sink must be a torch.Tensor or None, got list", TypeError),
        (torch.zeros(4, dtype=torch.int64), "learnable_sink must be a floating tensor", TypeError),
        (torch.zeros(3), r"learnable_sink must have shape \(nheads,\) = \(4,\)", ValueError),
        (torch.zeros(1, 4), r"got \(1, 4\)", ValueError),
        (torch.zeros(4, device="meta"), r"same device as q \(cpu\), got meta", ValueError),
    ],
    ids=["list", "int64", "wrong-length", "2d", "other-device"],
)
def test_bad_sinks_are_refused_by_name(sink, message, error):
    q, k, v = (_rand(1, 8, 4, 16, seed=s) for s in range(3))
    with pytest.raises(error, match=message):
        flash_recipe.flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(error, match=message):
        flash_recipe.flash_attn_with_kvcache(q, k, v, cache_seqlens=8, learnable_sink=sink)


def test_backends_without_sinks_refuse_and_name_themselves():
    from flash_recipe.dispatch import AttentionCall, FlashAttnBackend

    q, k, v = (_rand(1, 8, 4, 16, seed=s) for s in range(3))
    sinks = _sinks(4)
    reasons = flash_recipe.explain(q, k, v, learnable_sink=sinks)
    assert reasons["sdpa"] == "torch SDPA has no attention sinks (learnable_sink)"
    assert reasons["reference"] is None
    call = AttentionCall(q=q, k=k, v=v, softmax_scale=0.25, sinks=sinks)
    assert FlashAttnBackend().supports(call) == "flash_attn 2 has no attention sinks (learnable_sink)"
    with flash_recipe.use_backend("sdpa"), pytest.raises(flash_recipe.BackendUnavailableError, match="'sdpa'.*sinks"):
        flash_recipe.flash_attn_func(q, k, v, learnable_sink=sinks)


def test_sinks_at_the_limits(device, nan_outputs):
    """-inf is no sink (the same bytes); a very negative one changes nothing a row's keys show; a very
    positive one takes nearly all the weight (out near 0, lse near the sink)."""
    q, k, v = (_rand(2, 37, 4, 32, device=device, seed=s) for s in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    with flash_recipe.use_backend("triton"):
        plain, plain_lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        none = torch.full((4,), float("-inf"), device=device)
        out, lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=none)
        assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
        far = _sinks(4, -1e4, device)
        out, lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=far)
        assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
        big = _sinks(4, 60.0, device)
        out, lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=big)
    assert out.abs().max().item() < 1e-18
    torch.testing.assert_close(lse, big[None, :, None].expand_as(lse), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_rows_that_see_only_the_sink(dtype, device, nan_outputs):
    """Causal with Sq > Sk: the first rows see no key; they output 0, their lse is the sink, and
    their gradients are 0 (the sink's included: out = 0 does not depend on it)."""
    q, k, v = (_rand(1, 30, 2, 16, dtype=dtype, device=device, seed=s) for s in (1, 2, 3))
    k, v = k[:, :12], v[:, :12]
    sinks = _sinks(2, 1.5, device).requires_grad_()
    q.requires_grad_()
    with flash_recipe.use_backend("triton"):
        out, lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sinks)
    blind = 30 - 12  # rows 0..17 see no key
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    torch.testing.assert_close(lse[:, :, :blind], sinks.detach()[None, :, None].expand(1, 2, blind), rtol=0, atol=1e-6)
    dout = torch.zeros_like(out)
    dout[:, :blind] = 1.0  # only the blind rows carry a gradient
    dq, dsink = torch.autograd.grad(out, (q, sinks), dout, retain_graph=True)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dsink, torch.zeros_like(dsink))
    # Every row carries one: the sinks' gradient comes from the rows that see keys, by the rule.
    dout = _rand(*out.shape, dtype=dtype, device=device, seed=9)
    (dsink,) = torch.autograd.grad(out, (sinks,), dout)
    high = compute_dtype(dtype, upcast=True)
    truth_in = [t.detach().to(high).requires_grad_() for t in (q, k, v, sinks)]
    truth, _ = attention_reference(*truth_in[:3], causal=True, sinks=truth_in[3])
    (truth_dsink,) = torch.autograd.grad(truth, (truth_in[3],), dout.to(high))
    same_in = [t.detach().requires_grad_() for t in (q, k, v, sinks.to(dtype))]
    same, _ = attention_reference(*same_in[:3], causal=True, sinks=same_in[3], upcast=False)
    (same_dsink,) = torch.autograd.grad(same, (same_in[3],), dout)
    assert truth_dsink.abs().max() > 0.01
    assert_accurate("dsink", dsink, truth_dsink, same_dsink, FACTORS["dsink"])


def _accurate(got: dict, truth: dict, same: dict) -> None:
    for name in got:
        assert_accurate(name, got[name], truth[name], same[name], FACTORS[name])


def _grads(out, leaves, dout, names=("out", "dq", "dk", "dv", "dsink")) -> dict:
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return dict(zip(names, (out.detach(), *grads)))


def test_varlen_with_sinks_forward_and_backward(device, nan_outputs):
    """Packed sequences (one of them empty), GQA, causal: every output and gradient by the rule, against
    the reference run one sequence at a time."""
    lengths = [13, 0, 29, 6]
    cu = torch.tensor([0, 13, 13, 42, 48], dtype=torch.int32, device=device)
    q, k, v, dout = (_rand(48, 4, 24, device=device, seed=s) for s in range(4))
    k, v = k[:, :2], v[:, :2]
    sinks = _sinks(4, 0.5, device)

    def run(dtype, reference, upcast=True):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        if reference:
            parts = []
            for b in range(len(lengths)):
                rows = slice(int(cu[b]), int(cu[b + 1]))
                part, _ = attention_reference(
                    *(t[rows].unsqueeze(0) for t in leaves[:3]), causal=True, upcast=upcast, sinks=leaves[3]
                )
                parts.append(part.squeeze(0))
            out = torch.cat(parts)
        else:
            with flash_recipe.use_backend("triton"):
                out = flash_recipe.flash_attn_varlen_func(
                    *leaves[:3], cu, cu, 29, 29, causal=True, learnable_sink=leaves[3]
                )
        return _grads(out, leaves, dout)

    high = compute_dtype(torch.float32, upcast=True)
    _accurate(run(torch.float32, False), run(high, True), run(torch.float32, True, upcast=False))


def test_dropout_with_sinks_uses_the_same_mask_in_both_passes(device, nan_outputs):
    """Dropout keeps the sink in the normaliser; the reference with the returned mask obeys the rule."""
    p = 0.2
    q, k, v, dout = (_rand(2, 33, 4, 16, dtype=torch.float16, device=device, seed=s) for s in range(4))
    k, v = k[:, :, :2], v[:, :, :2]
    sinks = _sinks(4, 0.0, device, torch.float16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    torch.manual_seed(0)
    with flash_recipe.use_backend("triton"):
        out, _, s_dmask = flash_recipe.flash_attn_func(
            *leaves[:3], dropout_p=p, causal=True, return_attn_probs=True, learnable_sink=leaves[3]
        )
    keep = s_dmask >= 0
    assert not keep.all()
    got = _grads(out, leaves, dout)

    def reference(dtype, upcast):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        ref, _ = attention_reference(*ins[:3], causal=True, dropout_p=p, dropout_mask=keep, upcast=upcast, sinks=ins[3])
        return _grads(ref, ins, dout)

    _accurate(got, reference(torch.float32, True), reference(torch.float16, False))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["unsplit", "split3"])
def test_kvcache_with_sinks_appends_and_matches_the_reference(paged, num_splits, device, nan_outputs):
    """flash_attn_with_kvcache with sinks: new rows appended, GQA packed, split-KV (the sink counted
    once across the shares); out and lse as the reference backend's, the caches identical."""
    batch, nheads, nheads_k, dim, page = 3, 8, 2, 32, 16
    cache_shape = (batch * 8, page, nheads_k, dim) if paged else (batch, 128, nheads_k, dim)
    k_cache, v_cache = (_rand(*cache_shape, device=device, seed=s) for s in (1, 2))
    table = torch.randperm(batch * 8, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    table = table.reshape(batch, 8).to(device) if paged else None
    seqlens = torch.tensor([0, 40, 100], dtype=torch.int32, device=device)
    q = _rand(batch, 2, nheads, dim, device=device, seed=4)
    k_new, v_new = (_rand(batch, 2, nheads_k, dim, device=device, seed=s) for s in (5, 6))
    sinks = _sinks(nheads, 0.5, device)
    results = {}
    for backend in ("triton", "reference"):
        caches = (k_cache.clone(), v_cache.clone())
        with flash_recipe.use_backend(backend):
            out, lse = flash_recipe.flash_attn_with_kvcache(
                q, *caches, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True,
                num_splits=num_splits, return_softmax_lse=True, learnable_sink=sinks,
            )  # fmt: skip
        results[backend] = (out, lse, *caches)
    (out, lse, k_got, v_got), (ref_out, ref_lse, k_ref, v_ref) = results["triton"], results["reference"]
    # fp32: the reference computes in fp64, so the rule's bound is its floor.
    assert (out - ref_out).abs().max().item() <= 1e-5 and (lse - ref_lse).abs().max().item() <= 1e-5
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_kvcache_plans_follow_the_sinks(device, nan_outputs):
    """The same shapes without sinks, with them, and without again: each call is planned for its own
    sinks (the decode step's plan and the call's checks are memoized per signature)."""
    k_cache, v_cache = (_rand(2, 64, 2, 16, device=device, seed=s) for s in (1, 2))
    q = _rand(2, 1, 4, 16, device=device, seed=3)
    seqlens = torch.tensor([20, 50], dtype=torch.int32, device=device)
    results = {}
    for sinks in (None, _sinks(4, 1.0, device), None):
        for backend in ("triton", "reference"):
            with flash_recipe.use_backend(backend):
                results[backend] = flash_recipe.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, learnable_sink=sinks
                )
        assert (results["triton"] - results["reference"]).abs().max().item() <= 1e-5


def test_a_models_sink_parameter_is_memoized_like_a_tensor():
    """gpt-oss holds its sinks as an ``nn.Parameter``: repeated calls reuse their checks and plans."""
    from flash_recipe.memo_keys import signature

    sinks = torch.nn.Parameter(_sinks(4))
    assert signature((sinks,), ()) == signature((sinks.detach(),), ())


def test_compiled_fullgraph_traces_sinks_and_their_gradient(device):
    q, k, v = (_rand(2, 19, 4, 16, device=device, seed=s).requires_grad_() for s in range(3))
    sinks = _sinks(4, 0.0, device).requires_grad_()

    def step(q, k, v, sinks):
        return flash_recipe.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks).square().sum()

    with flash_recipe.use_backend("triton"):
        eager = torch.autograd.grad(step(q, k, v, sinks), (q, k, v, sinks))
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        traced = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_custom_ops_with_sinks_pass_opcheck(device):
    """torch.library.opcheck with sinks: the schema, fake kernels and autograd registration agree."""
    from flash_recipe.ops.attention import attn_bwd, attn_fwd, flatten
    from flash_recipe.ops.options import ScoreOptions

    q, k, v = (_rand(2, 19, 4, 16, device=device, seed=s).requires_grad_() for s in range(3))
    sinks = _sinks(4, 0.0, device).requires_grad_()
    options = ScoreOptions(
        softmax_scale=0.25, diag_offset=0, window_left=5, window_right=2, softcap=3.0, alibi_slopes=None, sinks=sinks
    )
    args = (q, k, v, *flatten(options, None), False)
    torch.library.opcheck(attn_fwd, args)
    out, lse = attn_fwd(*args)
    detached = [t.detach() for t in (q, k, v)]
    flat = flatten(options._replace(sinks=sinks.detach()), None)
    torch.library.opcheck(attn_bwd, (torch.randn_like(out), *detached, out.detach(), lse, *flat, True, False))


def test_stand_in_takes_s_aux_and_sdpa_takes_learnable_sink(device):
    """The flash_attn stand-in takes the sinks as ``s_aux`` (vLLM's name) as well; torch's SDPA layout
    takes them as ``learnable_sink``; the results are the same call's."""
    from flash_recipe import flash_attn as stand_in

    q, k, v = (_rand(1, 21, 4, 16, device=device, seed=s) for s in range(3))
    sinks = _sinks(4, 1.0, device)
    with flash_recipe.use_backend("triton"):
        expected = flash_recipe.flash_attn_func(q, k, v, causal=True, learnable_sink=sinks)
        via_s_aux = stand_in.flash_attn_func(q, k, v, causal=True, s_aux=sinks)
        via_sdpa = flash_recipe.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, learnable_sink=sinks
        ).transpose(1, 2)
        with pytest.raises(ValueError, match="learnable_sink or s_aux"):
            stand_in.flash_attn_func(q, k, v, s_aux=sinks, learnable_sink=sinks)
    assert torch.equal(via_s_aux, expected) and torch.equal(via_sdpa, expected)


def test_half_precision_sinks_get_a_gradient_of_their_dtype(device):
    q, k, v = (_rand(1, 17, 2, 16, dtype=torch.float16, device=device, seed=s) for s in range(3))
    sinks = _sinks(2, 0.0, device, torch.float16).requires_grad_()
    with flash_recipe.use_backend("triton"):
        out = flash_recipe.flash_attn_func(q, k, v, learnable_sink=sinks)
    (dsink,) = torch.autograd.grad(out.float().sum(), (sinks,))
    assert dsink.dtype == torch.float16 and dsink.shape == (2,) and bool(dsink.isfinite().all())
