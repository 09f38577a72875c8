"""8-bit attention (``flash_recipe.sageattn``): the quantization kernel, the two accuracy checks of
docs/int8-attention.md, the API's layouts and refusals, and the torch fallback.

(a) the kernel against an fp64 reference of the same quantized inputs, by the accuracy rule;
(b) the method against unquantized fp32 attention, by ``testing.quantized.METRIC_BOUNDS``, with
    planted errors (no K smoothing, a wrong scale) that cross them.

On the CPU every case runs the Triton kernels through the interpreter (fp16 and bf16: the kernels'
only 16-bit products take fp16 operands); FP8 P.V runs on a GPU only (the interpreter rounds to
float8 wrongly), where the campaign's tests step runs this file.
"""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe import reference_int8, sage
from flash_recipe.ops import int8_attention, quantize
from flash_recipe.testing import FORWARD_FACTOR, assert_accurate
from flash_recipe.testing.quantized import (
    METRIC_BOUNDS,
    assert_method_accurate,
    method_metrics,
    metric_failures,
    realistic_inputs,
    unquantized,
)

DTYPES = [torch.float16, torch.bfloat16]


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _pack(x, lengths):
    """Rows ``[:n]`` of each batch entry of ``x (B, S, H, D)``, packed: ``(sum n, H, D)``."""
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


QUANT_CASES = [  # (B, S, H, D, block, smooth, lengths or None)
    (2, 70, 3, 64, 32, True, None),
    (1, 64, 2, 40, 32, False, None),
    (3, 50, 2, 64, 16, True, [50, 0, 17]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"B{c[0]}-S{c[1]}-H{c[2]}-D{c[3]}-blk{c[4]}-{c[5]}-{c[6]}")
def test_quantize_kernel_equals_the_definition(case, dtype, device):
    """The Triton quantizer gives the torch definition's int8 values and scales exactly (the same
    fp32 operations in the same order). Exact on a GPU too: the kernel divides with round-to-nearest
    (``tl.math.div_rn``, ``div.rn.f32``) as torch's fp32 division does, where a plain ``/`` compiles to
    a division that is not correctly rounded (the interpreter divides as IEEE does either way)."""
    batch, seqlen, heads, dim, block, smooth, lengths = case
    torch.manual_seed(1)
    x = (torch.randn(batch, seqlen, heads, dim) * 3 + torch.randn(1, 1, heads, dim) * 5).to(dtype).to(device)
    cu = None
    if lengths is not None:
        cu, x = _cu(lengths, device), _pack(x, lengths)
    mean = reference_int8.key_means(x, cu) if smooth else None
    got = quantize.quantize_blocks(x, block, 0.3, mean, cu, seqlen)
    want = reference_int8.quantize_blocks(x, block, 0.3, mean, cu, seqlen)
    assert torch.equal(got[0][..., :dim], want[0]) and not got[0][..., dim:].any()  # padded with zeros
    if lengths is None:
        assert torch.equal(got[1], want[1])
    else:  # blocks past a sequence's end are never read
        for b, n in enumerate(lengths):
            blocks = -(-n // block)
            assert torch.equal(got[1][b, :, :blocks], want[1][b, :, :blocks])
    assert got[0].abs().max() <= 127


def test_key_means_of_packed_sequences_are_each_sequences_own():
    k = torch.randn(2, 9, 3, 8)
    cu = _cu([9, 4], "cpu")
    means = reference_int8.key_means(_pack(k, [9, 4]), cu)
    torch.testing.assert_close(means[0], k[0].mean(0))
    torch.testing.assert_close(means[1], k[1, :4].mean(0))


CASES = [  # (B, Sq, Sk, H, Hk, D, causal, lengths (q, k) or None)
    (2, 70, 90, 4, 2, 64, True, None),
    (1, 64, 64, 2, 2, 128, False, None),
    (2, 33, 47, 2, 1, 40, False, None),
    (1, 50, 30, 2, 2, 64, True, None),  # Sq > Sk: the first rows see no key
    (3, 40, 60, 4, 2, 64, True, ([40, 7, 0], [60, 13, 5])),
    (2, 45, 45, 2, 2, 128, False, ([45, 20], [30, 45])),
]


def _case_id(c):
    varlen = "-varlen" if c[7] else ""
    return f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}-Hk{c[4]}-D{c[5]}" + ("-causal" if c[6] else "") + varlen


def _inputs(case, dtype, device, seed=0):
    batch, sq, sk, h, hk, d, causal, lengths = case
    q, k, v = realistic_inputs(batch, sq, sk, h, hk, d, dtype, seed=seed)
    q, k, v = q.to(device), k.to(device), v.to(device)
    varlen = ()
    if lengths is not None:
        (lq, lk) = lengths
        q, k, v = _pack(q, lq), _pack(k, lk), _pack(v, lk)
        varlen = (_cu(lq, device), _cu(lk, device), max(lq), max(lk))
    return q, k, v, causal, varlen


def _finite_lse_equal_inf(got, want):
    """Rows that see no key have lse = +inf in both; the rule compares the others."""
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and bool((got[inf] > 0).all())
    return got[~inf], want[~inf]


def _kernel_and_references(q, k, v, causal, varlen, fp8: bool) -> tuple:
    """The kernel on its own quantized inputs, and the fp64 truth and PyTorch's kernel-precision
    version of the same quantized inputs: ``(out, lse), (truth, truth_lse), (same, same_lse)``."""
    scale = q.shape[-1] ** -0.5
    plan = int8_attention.plan_int8(q.device, q.shape[-1], fp8=fp8)
    x = int8_attention.quantize_inputs(q, k, v, scale, True, plan, *varlen)
    got = int8_attention.attention_quantized(x, plan, causal, q.dtype, *varlen)
    cu = varlen[:2] if varlen else (None, None)
    blocks = (plan.config.block_m, plan.config.block_n)
    truth = reference_int8.attention_from_quantized(x, *blocks, causal, fp8, torch.float64, *cu)
    same = reference_int8.attention_from_quantized(x, *blocks, causal, fp8, torch.float16, *cu)
    return got, truth, same


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_equals_the_same_quantization_by_the_rule(case, dtype, device, nan_outputs):
    """Check (a): out and lse against the fp64 attention of the kernel's own quantized inputs,
    within 2x the error of PyTorch doing the same in the kernel's precision (P rounded to fp16)."""
    q, k, v, causal, varlen = _inputs(case, dtype, device)
    (out, lse), (truth, truth_lse), (same, same_lse) = _kernel_and_references(q, k, v, causal, varlen, fp8=False)
    assert out.dtype == dtype and not out.isnan().any()
    assert_accurate("out", out, truth, same.to(dtype), FORWARD_FACTOR)
    assert_accurate("lse", *_finite_lse_equal_inf(lse, truth_lse), same_lse[~torch.isinf(truth_lse)], FORWARD_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_method_meets_its_bounds_against_unquantized_attention(case, dtype, device):
    """Check (b): SageAttention's metrics against fp32 attention of the unquantized inputs, through
    the public API; and the API's lse, smoothing correction included, by check (a)'s rule."""
    q, k, v, causal, varlen = _inputs(case, dtype, device, seed=3)
    scale = q.shape[-1] ** -0.5
    if varlen:
        out = flash_recipe.sageattn_varlen(q, k, v, *varlen, is_causal=causal)
        truths = []
        (cu_q, cu_k, _, _) = varlen
        for b in range(cu_q.numel() - 1):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            truths.append(unquantized(q[None, qs], k[None, ks], v[None, ks], causal, scale)[0])
        truth = torch.cat(truths)
    else:
        out, lse = flash_recipe.sageattn(q, k, v, "NHD", causal, return_lse=True)
        truth = unquantized(q, k, v, causal, scale)
        # The lse by the rule against fp64 from the same quantized scores plus the smoothing
        # correction (without it the lse would be off by q . mean(K), tens here).
        plan = int8_attention.plan_int8(q.device, q.shape[-1], fp8=False)
        x = int8_attention.quantize_inputs(q, k, v, scale, True, plan)
        blocks = (plan.config.block_m, plan.config.block_n)
        truth_lse = reference_int8.attention_from_quantized(x, *blocks, causal, False, torch.float64)[1].double()
        truth_lse += reference_int8.lse_correction(q.double(), x.mean.double(), scale)
        same_lse = reference_int8.attention_from_quantized(x, *blocks, causal, False, torch.float16)[1]
        same_lse += reference_int8.lse_correction(q, x.mean, scale)
        got, want = _finite_lse_equal_inf(lse, truth_lse)
        assert_accurate("lse", got, want, same_lse[~torch.isinf(truth_lse)], FORWARD_FACTOR)
    seen = truth.isfinite().all(-1)  # rows that see no key: 0 from the kernel, NaN from the textbook formula
    assert (out[~seen] == 0).all()
    assert_method_accurate(_case_id(case), out[seen].cpu(), truth[seen].cpu())


@pytest.mark.parametrize("plant", ["no smoothing", "K scale 5% off", "Q scale 5% off"])
def test_planted_errors_cross_the_bounds(plant, device, monkeypatch):
    """Each bound can fail: without K smoothing, or with one block scale off by 5%, realistic
    inputs leave METRIC_BOUNDS."""
    q, k, v = (t.to(device) for t in realistic_inputs(1, 128, 256, 2, 2, 64, torch.float16, seed=5))
    truth = unquantized(q, k, v, False, 64**-0.5)
    assert_method_accurate("unplanted", flash_recipe.sageattn(q, k, v, "NHD"), truth)
    if plant == "no smoothing":
        out = flash_recipe.sageattn(q, k, v, "NHD", smooth_k=False)
    else:
        index = 1 if plant.startswith("K") else 0
        real = int8_attention.quantize_blocks
        calls = []

        def off(*args, **kwargs):
            x8, scales = real(*args, **kwargs)
            calls.append(1)
            return (x8, scales * 1.05) if len(calls) - 1 == index else (x8, scales)

        monkeypatch.setattr(int8_attention, "quantize_blocks", off)
        out = flash_recipe.sageattn(q, k, v, "NHD")
    failures = metric_failures(method_metrics(out, truth))
    assert failures, f"{plant}: {method_metrics(out, truth)} within {METRIC_BOUNDS}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_and_path_names_run_the_same_kernel(dtype, device):
    """HND and NHD give the same numbers (HND is a view, not a copy), return_lse adds the lse, and
    the path-named functions diffusers imports run the same kernel with fp16 P.V."""
    q, k, v = (t.to(device) for t in realistic_inputs(2, 37, 53, 4, 2, 64, dtype, seed=7))
    nhd, lse = flash_recipe.sageattn(q, k, v, tensor_layout="NHD", is_causal=True, return_lse=True)
    hnd = flash_recipe.sageattn(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    assert hnd.shape == (2, 4, 37, 64) and lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    assert torch.equal(hnd.transpose(1, 2), nhd)
    for name in ("sageattn_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp16_cuda"):
        assert torch.equal(getattr(sage, name)(q, k, v, "NHD", True), nhd)
    assert set(sage.SAGE_NAMES) <= set(dir(sage))


def test_kernels_run_and_fallback_agrees(device, monkeypatch):
    """The API launches the 8-bit kernel; where Triton cannot run, the torch definition serves and
    meets the same bounds (its 64-row blocks differ from the interpreter's tiles)."""
    q, k, v = (t.to(device) for t in realistic_inputs(1, 64, 96, 2, 1, 64, torch.float16, seed=9))
    truth = unquantized(q, k, v, True, 64**-0.5)
    launches = []
    kernel = int8_attention.attn_int8_kernel.fn
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launches.append(1) or _run(*a, **kw))
    assert_method_accurate("kernel", flash_recipe.sageattn(q, k, v, "NHD", True), truth)
    assert len(launches) == 1
    monkeypatch.setattr(sage, "triton_problem", lambda q: "no Triton here")
    assert_method_accurate("fallback", flash_recipe.sageattn(q, k, v, "NHD", True), truth)
    assert len(launches) == 1


@pytest.mark.parametrize("call", ["hnd-causal", "nhd-lse", "varlen"])
def test_torch_compile_fullgraph_runs_the_8bit_kernel_and_equals_eager(call, device, monkeypatch):
    """``torch.compile(fullgraph=True)`` (Inductor, as ComfyUI's TorchCompileModel node uses it)
    traces ``sageattn`` and ``sageattn_varlen`` whole: the kernels run inside the op
    ``flash_recipe::int8_attn``, which Dynamo does not trace into, once per call (counted), and the
    compiled call returns eager's output (and lse) bit for bit."""
    q, k, v = (t.to(device) for t in realistic_inputs(2, 40, 56, 4, 2, 64, torch.float16, seed=3))
    if call == "hnd-causal":
        args = [t.transpose(1, 2) for t in (q, k, v)]

        def fn(q, k, v):
            return flash_recipe.sageattn(q, k, v, is_causal=True) * 2.0  # an op of the graph's own after it
    elif call == "nhd-lse":
        args = [q, k, v]

        def fn(q, k, v):
            return flash_recipe.sageattn(q, k, v, tensor_layout="NHD", return_lse=True, smooth_k=False)
    else:
        lengths, key_lengths = [40, 17], [56, 9]
        cu_q, cu_k = _cu(lengths, device), _cu(key_lengths, device)
        args = [_pack(q, lengths), _pack(k, key_lengths), _pack(v, key_lengths)]

        def fn(q, k, v):
            return flash_recipe.sageattn_varlen(q, k, v, cu_q, cu_k, 40, 56, is_causal=True)

    launches = []
    kernel = int8_attention.attn_int8_kernel.fn
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launches.append(1) or _run(*a, **kw))
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True)(*args)
    assert len(launches) == 2  # eager's launch, then the compiled call's
    for got, want in zip(*(x if isinstance(x, tuple) else (x,) for x in (compiled, eager))):
        assert got.shape == want.shape and torch.equal(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["kernels", "fallback"])
def test_empty_and_keyless_inputs(path, device, monkeypatch):
    """No queries, no keys, and a packed sequence without keys: rows of 0 with lse = +inf, on the
    kernels and on the torch fallback alike."""
    if path == "fallback":
        monkeypatch.setattr(sage, "triton_problem", lambda q: "no Triton here")
    q = torch.randn(1, 0, 2, 64, dtype=torch.float16, device=device)
    k = torch.randn(1, 5, 2, 64, dtype=torch.float16, device=device)
    assert flash_recipe.sageattn(q, k, k, "NHD").shape == (1, 0, 2, 64)
    q = torch.randn(1, 3, 2, 64, dtype=torch.float16, device=device)
    none = k[:, :0]
    out, lse = flash_recipe.sageattn(q, none, none, "NHD", return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all()
    q, k = torch.randn(7, 2, 64, dtype=torch.float16, device=device), k[0]
    out = flash_recipe.sageattn_varlen(q, k, k, _cu([3, 4], device), _cu([5, 0], device), 4, 5)
    assert out.shape == q.shape and (out[3:] == 0).all() and (out[:3] != 0).any()


REFUSALS = [  # (kwargs changes, error type, words in the message)
    (dict(tensor_layout="BSHD"), ValueError, "tensor_layout must be 'HND'"),
    (dict(qk_quant_gran="per_warp"), NotImplementedError, "qk_quant_gran"),
    (dict(pv_accum_dtype="fp32+fp16"), NotImplementedError, "pv_accum_dtype must be 'fp32'"),
    (dict(smooth_v=True), NotImplementedError, "smooth_v"),
    (dict(window_size=(4, 4)), TypeError, "unexpected keyword argument 'window_size'"),
    (dict(pv_dtype="int4"), ValueError, "pv_dtype must be one of"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(sm_scale="0.1"), TypeError, "sm_scale must be a real number"),
]


@pytest.mark.parametrize("change,error,words", REFUSALS, ids=[w for _, _, w in REFUSALS])
def test_unimplemented_arguments_are_refused_by_name(change, error, words):
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    kwargs = {"tensor_layout": "HND", **change}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        flash_recipe.sageattn(q, q, q, **kwargs)


def test_training_float32_and_fp8_on_the_cpu_are_refused():
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="flash_attn_func"):
        flash_recipe.sageattn(q.requires_grad_(), q.detach(), q.detach())
    with torch.no_grad():  # inference with grad-tracking weights is fine
        assert flash_recipe.sageattn(q, q, q).shape == q.shape
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flash_recipe.sageattn(q.detach().float(), q.detach().float(), q.detach().float())
    q = q.detach()
    for name in ("sageattn_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp8_cuda_sm90"):
        with pytest.raises(NotImplementedError, match="pv_dtype='fp16'"):
            getattr(sage, name)(q, q, q)
    with pytest.raises(ValueError, match="cu_seqlens_k must have as many entries"):
        flash_recipe.sageattn_varlen(q[0], q[0], q[0], _cu([2], "cpu"), _cu([1, 1], "cpu"), 2, 1)


def _fp8_gpu_problem():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "no NVIDIA GPU"
    major, minor = torch.cuda.get_device_capability()
    return int8_attention.fp8_problem(f"sm{major}{minor}")


FP8_GPU = _fp8_gpu_problem()


@pytest.mark.gpu
@pytest.mark.skipif(bool(FP8_GPU), reason="needs an NVIDIA GPU with FP8 tensor cores (sm89 or newer)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_pv_by_both_checks_on_a_gpu(case, dtype):
    """FP8 P.V (which the interpreter cannot run): check (a), PyTorch's version rounding P * 448 and
    V / v_scale to float8 as the kernel does, and check (b) through the public API."""
    q, k, v, causal, varlen = _inputs(case, dtype, torch.device("cuda"))
    (out, _), (truth, _), (same, _) = _kernel_and_references(q, k, v, causal, varlen, fp8=True)
    assert_accurate("out", out, truth, same.to(dtype), FORWARD_FACTOR)
    if not varlen:
        got = flash_recipe.sageattn(q, k, v, "NHD", causal, pv_dtype="fp8")
        truth = unquantized(q, k, v, causal, q.shape[-1] ** -0.5)
        seen = truth.isfinite().all(-1)
        assert_method_accurate(_case_id(case), got[seen].cpu(), truth[seen].cpu())
