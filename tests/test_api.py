"""The public layer: validation, flash-attn and SDPA semantics, backend selection."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import flash_recipe
from flash_recipe import BackendUnavailableError, flash_attn_func, scaled_dot_product_attention, use_backend
from flash_recipe.reference import attention_reference
from flash_recipe.testing import FORWARD_FACTOR, accuracy_bound


def t(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


Q, K = t(2, 8, 4, 16), t(2, 10, 2, 16)

# (id, call, exception type, words the message must contain)
BAD_CALLS = [
    ("q-not-tensor", lambda: flash_attn_func(Q.tolist(), K, K), TypeError, ["q", "torch.Tensor", "list"]),
    (
        "int-dtype",
        lambda: flash_attn_func(Q.int(), K, K),
        TypeError,
        ["q", "float16, bfloat16 or float32", "torch.int32", "fix: q.to(torch.float16)"],
    ),
    ("float64", lambda: flash_attn_func(Q.double(), K, K), TypeError, ["q", "torch.float64"]),
    (
        "dtype-mismatch",
        lambda: flash_attn_func(Q, K.half(), K),
        TypeError,
        ["k", "same dtype", "torch.float16", "fix: k.to(q.dtype)"],
    ),
    (
        "device-mismatch",
        lambda: flash_attn_func(Q, K.to("meta"), K),
        ValueError,
        ["k", "same device", "meta", "fix: k.to(q.device)"],
    ),
    (
        "batch-mismatch",
        lambda: flash_attn_func(Q, t(3, 10, 2, 16), t(3, 10, 2, 16)),
        ValueError,
        ["k", "batch size", "2", "3"],
    ),
    (
        "kv-seqlen-mismatch",
        lambda: flash_attn_func(Q, K, t(2, 11, 2, 16)),
        ValueError,
        ["v", "seqlen and nheads", "(11, 2)"],
    ),
    (
        "head-dim-mismatch",
        lambda: flash_attn_func(Q, t(2, 10, 2, 8), t(2, 10, 2, 8)),
        ValueError,
        ["k", "head dim", "16", "8"],
    ),
    ("v-head-dim-mismatch", lambda: flash_attn_func(Q, K, t(2, 10, 2, 8)), ValueError, ["v", "head dim", "8"]),
    (
        "heads-not-divisible",
        lambda: flash_attn_func(Q, t(2, 10, 3, 16), t(2, 10, 3, 16)),
        ValueError,
        ["query heads (4)", "multiple", "3"],
    ),
    (
        "head-dim-too-big",
        lambda: flash_attn_func(t(1, 2, 1, 257), t(1, 2, 1, 257), t(1, 2, 1, 257)),
        ValueError,
        ["head dim", "256", "257"],
    ),
    ("wrong-rank", lambda: flash_attn_func(t(8, 4, 16), K, K), ValueError, ["q", "4 dimensions", "(8, 4, 16)"]),
    (
        "last-dim-strided",
        lambda: flash_attn_func(t(2, 8, 4, 32)[..., ::2], K, K),
        ValueError,
        ["q", "contiguous last dimension", "stride 2", "fix: q.contiguous()"],
    ),
    ("dropout-range", lambda: flash_attn_func(Q, K, K, dropout_p=1.5), ValueError, ["dropout_p", "[0, 1)", "1.5"]),
    (
        "window-range",
        lambda: flash_attn_func(Q, K, K, window_size=(-2, 0)),
        ValueError,
        ["window_size", "-1", "(-2, 0)"],
    ),
    ("window-type", lambda: flash_attn_func(Q, K, K, window_size=4), TypeError, ["window_size", "pair of ints", "4"]),
    (
        "window-float-tensor",
        lambda: flash_attn_func(Q, K, K, window_size=torch.tensor([2.0, 1.0])),
        TypeError,
        ["window_size", "pair of ints"],
    ),
    (
        "window-three",
        lambda: flash_attn_func(Q, K, K, window_size=torch.tensor([2, 1, 0])),
        TypeError,
        ["window_size", "pair of ints"],
    ),
    (
        "window-bools",
        lambda: flash_attn_func(Q, K, K, window_size=(True, False)),
        TypeError,
        ["window_size", "pair of ints"],
    ),
    ("softcap-negative", lambda: flash_attn_func(Q, K, K, softcap=-1.0), ValueError, ["softcap", ">= 0", "-1.0"]),
    (
        "alibi-shape",
        lambda: flash_attn_func(Q, K, K, alibi_slopes=torch.ones(3)),
        ValueError,
        ["alibi_slopes", "(4,)", "(2, 4)", "(3,)"],
    ),
    (
        "alibi-dtype",
        lambda: flash_attn_func(Q, K, K, alibi_slopes=torch.ones(4, dtype=torch.float16)),
        TypeError,
        ["alibi_slopes", "float32", "torch.float16"],
    ),
    (
        "scale-type",
        lambda: flash_attn_func(Q, K, K, softmax_scale="0.1"),
        TypeError,
        ["softmax_scale", "real number", "str"],
    ),
    ("causal-type", lambda: flash_attn_func(Q, K, K, causal="yes"), TypeError, ["causal", "bool", "str"]),
    (
        "qkv-packed-shape",
        lambda: flash_recipe.flash_attn_qkvpacked_func(t(2, 8, 2, 4, 16)),
        ValueError,
        ["qkv", "size 3", "(2, 8, 2, 4, 16)"],
    ),
    ("kv-packed-rank", lambda: flash_recipe.flash_attn_kvpacked_func(Q, K), ValueError, ["kv", "5 dimensions"]),
    (
        "sdpa-gqa-off",
        lambda: scaled_dot_product_attention(t(1, 4, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)),
        ValueError,
        ["key", "enable_gqa", "2"],
    ),
    (
        "sdpa-mask-and-causal",
        lambda: scaled_dot_product_attention(
            t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16), attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True
        ),
        ValueError,
        ["attn_mask", "is_causal"],
    ),
    ("unknown-backend", lambda: use_backend("cuda").__enter__(), ValueError, ["backend", "'triton'", "'cuda'"]),
    ("explain-kwarg", lambda: flash_recipe.explain(Q, K, K, casual=True), TypeError, ["casual", "causal"]),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_clear_error(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc or issubclass(type(info.value), exc)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_bad_backend_env_var(monkeypatch):
    monkeypatch.setenv("FLASH_RECIPE_BACKEND", "fastest")
    with pytest.raises(ValueError, match="FLASH_RECIPE_BACKEND must be one of .*'fastest'"):
        flash_attn_func(Q, K, K)


def test_cpu_goes_to_sdpa_without_interpreter(monkeypatch):
    # Triton reads TRITON_INTERPRET once, at import, so the variable stays and the check is patched.
    from flash_recipe import dispatch
    from flash_recipe.ops import targets

    monkeypatch.setattr(targets, "interpreter_enabled", lambda: False)
    dispatch.capabilities.import_error.cache_clear()
    reasons = flash_recipe.explain(Q, K, K)
    assert list(reasons) == ["flash_attn", "triton", "sdpa", "reference"]
    assert "TRITON_INTERPRET=1" in reasons["triton"]
    assert reasons["sdpa"] is None and reasons["reference"] is None
    with use_backend("triton"), pytest.raises(BackendUnavailableError, match="'triton' cannot run.*interpreter"):
        flash_attn_func(Q, K, K)


def test_env_var_and_context_choose_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASH_RECIPE_BACKEND", "reference")
    from flash_recipe import dispatch

    call = dispatch.AttentionCall(Q, K, K, 0.25)
    assert dispatch.select(call).name == "reference"
    with use_backend("sdpa"):
        assert dispatch.select(call).name == "sdpa"
        with use_backend("auto"):
            assert dispatch.select(call).name == "triton"
    assert dispatch.select(call).name == "reference"


def test_interpreter_refuses_bf16_with_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reasons = flash_recipe.explain(Q.bfloat16(), K.bfloat16(), K.bfloat16())
    assert "bfloat16" in reasons["triton"]
    out = flash_attn_func(Q.bfloat16(), K.bfloat16(), K.bfloat16())  # falls back cleanly
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["triton", "sdpa", "reference"])
@pytest.mark.parametrize("sq,sk", [(7, 12), (12, 7), (9, 9)], ids=lambda n: str(n))
def test_flash_attn_causal_is_bottom_right(backend, sq, sk, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = t(1, sq, 2, 16, seed=1), t(1, sk, 1, 16, seed=2), t(1, sk, 1, 16, seed=3)
    with use_backend(backend):
        out = flash_attn_func(q, k, v, causal=True)
    visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    expected = (
        F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(2, 1),
            v.transpose(1, 2).repeat_interleave(2, 1),
            attn_mask=visible,
        )
        .transpose(1, 2)
        .nan_to_num(0.0)
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    if sq > sk:
        assert (out[:, : sq - sk] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "sdpa", "reference"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("sq,sk", [(7, 12), (12, 7)], ids=lambda n: str(n))
def test_sdpa_api_matches_torch(backend, gqa, sq, sk, monkeypatch):
    """torch's layout and top-left causal mask, with gradients."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hk = 2 if gqa else 4
    tensors = [t(2, 4, sq, 16, seed=1), t(2, hk, sk, 16, seed=2), t(2, hk, sk, 16, seed=3)]
    mine = [x.clone().requires_grad_() for x in tensors]
    theirs = [x.clone().requires_grad_() for x in tensors]
    with use_backend(backend):
        out = scaled_dot_product_attention(*mine, is_causal=True, scale=0.3, enable_gqa=gqa)
    expected = F.scaled_dot_product_attention(*theirs, is_causal=True, scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    grad = t(*out.shape, seed=4)
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_sdpa_api_mask_falls_back_and_3d_inputs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = t(2, 6, 16, seed=1), t(2, 9, 16, seed=2), t(2, 9, 16, seed=3)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(0)) > 0.3
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=2e-6, rtol=1e-5)
    with use_backend("triton"), pytest.raises(BackendUnavailableError, match="attn_mask"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("backend", ["triton", "sdpa", "reference"])
def test_window_and_alibi_on_every_backend(backend, monkeypatch):
    """The SDPA fallback builds the window and ALiBi as a mask; all three backends agree."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = t(2, 21, 4, 16, seed=1), t(2, 30, 2, 16, seed=2), t(2, 30, 2, 16, seed=3)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [1.0, 0.5, 0.25, 0.125]])
    with use_backend(backend):
        out = flash_attn_func(q, k, v, causal=True, window_size=(6, 3), alibi_slopes=slopes)
    expected, _ = attention_reference(q, k, v, causal=True, window=(6, 0), alibi_slopes=slopes)
    torch.testing.assert_close(out, expected.float(), atol=2e-6, rtol=1e-5)


def test_softcap_is_not_sent_to_sdpa(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "softcap" in flash_recipe.explain(Q, K, K, softcap=10.0)["sdpa"]


def test_return_attn_probs_on_every_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, ref_lse = attention_reference(Q, K.repeat(1, 1, 1, 1), K, causal=True)
    for backend in ("triton", "reference"):
        with use_backend(backend):
            out, lse, s_dmask = flash_attn_func(Q, K, K, causal=True, return_attn_probs=True)
        assert s_dmask is None and lse.shape == (2, 4, 8)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # Automatic selection skips sdpa, which has no log-sum-exp, and says why.
    assert "log-sum-exp" in flash_recipe.explain(Q, K, K, return_attn_probs=True)["sdpa"]


def test_import_selects_compiles_and_probes_nothing():
    code = (
        "import json, sys, flash_recipe; "
        "before = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')); "
        "flash_recipe.flash_attn_func; "
        "print(json.dumps([before, sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'flash_attn') "
        "or m.startswith('flash_recipe.ops.') and m not in "
        "('flash_recipe.ops.configs', 'flash_recipe.ops.limits', 'flash_recipe.ops.options', "
        "'flash_recipe.ops.targets'))]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # `import flash_recipe` imports not even torch; the API then loads torch but no Triton, and of
    # the kernels' package only the table, its constants, the target detection and the options type.
    assert json.loads(result.stdout) == [[], []]


def test_public_names():
    assert set(flash_recipe.__all__) >= {"flash_attn_func", "scaled_dot_product_attention", "use_backend", "explain"}
    for name in flash_recipe.__all__:
        assert getattr(flash_recipe, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'flash_attn_varlen'"):
        flash_recipe.flash_attn_varlen  # noqa: B018 (the attribute access is what raises)


def test_version_matches_distribution_metadata():
    from importlib import metadata

    try:
        assert flash_recipe.__version__ == metadata.version("flash-recipe")
    except metadata.PackageNotFoundError:
        pytest.skip("flash-recipe is not installed (tests run from the source tree)")


def test_interpreter_switched_on_after_import_is_explained():
    code = (
        "import os, torch, triton, flash_recipe; os.environ['TRITON_INTERPRET'] = '1'; "
        "q = torch.randn(1, 4, 1, 16); print(flash_recipe.explain(q, q, q)['triton'])"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert "set after triton was imported" in result.stdout


# -- GPUs below sm80 (T4, RTX 20xx) ------------------------------------------------------------
# No GPU exists on the test machine: the compute capability is mocked (dispatch.capabilities.capability) and
# CUDA tensors are FakeTensors, which carry a device, dtype and shape but no data.
@pytest.fixture
def turing(monkeypatch):
    from flash_recipe import dispatch

    monkeypatch.setattr(dispatch.capabilities, "capability", lambda index: (7, 5))
    monkeypatch.setattr(torch.version, "hip", None)


def fake_cuda(*shape, dtype=torch.float16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cuda")


def test_turing_falls_back_to_sdpa_and_explains_why(turing):
    from flash_recipe import dispatch

    q, k = fake_cuda(1, 16, 4, 64), fake_cuda(1, 16, 2, 64)
    reasons = flash_recipe.explain(q, k, k, causal=True)
    triton = reasons["triton"]
    for words in (
        "7.5",
        "sm75",
        "below 8.0",
        "tl.dot to FMA",
        "no tensor-core path",
        "sm80 or newer",
        "flash-attn 2 has no Turing support",
        "#330, #542, #720, #887",
        "memory-efficient",
    ):
        assert words in triton, f"{words!r} missing from: {triton}"
    assert reasons["sdpa"] is None
    call = dispatch.AttentionCall(q, k, k, 0.125, causal=True)
    assert dispatch.select(call).name == "sdpa"
    # upstream flash-attn refuses the same GPU for the same reason, even when it is installed
    flash = dispatch.FlashAttnBackend().supports(call)
    assert "8.0 (Ampere)" in flash and "7.5" in flash and "#330, #542, #720, #887" in flash
    with use_backend("triton"), pytest.raises(BackendUnavailableError, match="tl.dot to FMA"):
        dispatch.select(call)


@pytest.fixture
def mocked_gpu(monkeypatch):
    """A mocked CUDA GPU of a given compute capability and shared memory (no GPU exists here)."""
    import types

    from flash_recipe import dispatch
    from flash_recipe.ops import targets

    def install(major: int, minor: int, shared: int, amd: str = ""):
        props = types.SimpleNamespace(
            major=major, minor=minor, shared_memory_per_block_optin=shared, gcnArchName=f"{amd}:sramecc+:xnack-"
        )
        monkeypatch.setattr(dispatch.capabilities, "capability", lambda index: (major, minor))
        monkeypatch.setattr(torch.version, "hip", "6.4" if amd else None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        for cached in (dispatch.capabilities.configs_problem, targets.gpu_target):
            cached.cache_clear()

    yield install
    for cached in (dispatch.capabilities.configs_problem, targets.gpu_target):
        cached.cache_clear()


def test_ampere_is_not_refused_for_its_capability(mocked_gpu):
    mocked_gpu(8, 0, 166912)
    q = fake_cuda(1, 16, 2, 64)
    assert flash_recipe.explain(q, q, q)["triton"] is None


def test_an_unknown_gpu_runs_with_the_conservative_configs_only_if_they_fit(mocked_gpu):
    """A future sm130 gets the family sized for 99 KiB: accepted with 99 KiB, refused with less."""
    q = fake_cuda(1, 16, 2, 64)
    mocked_gpu(13, 0, 101376)
    assert flash_recipe.explain(q, q, q)["triton"] is None
    mocked_gpu(13, 0, 65536)
    reason = flash_recipe.explain(q, q, q)["triton"]
    assert "sm130 offers 65536 bytes of shared memory per block" in reason and "sized for 101376" in reason
    # a known architecture whose GPU reports less than its family is sized for is refused too
    mocked_gpu(9, 0, 101376)
    assert "sized for 232448" in flash_recipe.explain(q, q, q)["triton"]
    # AMD: CDNA runs the Triton kernels, RDNA (no matrix cores for these tiles) is refused
    mocked_gpu(9, 4, 65536, amd="gfx942")
    assert flash_recipe.explain(q, q, q)["triton"] is None
    mocked_gpu(11, 0, 65536, amd="gfx1100")
    assert "AMD CDNA GPU (gfx9xx" in flash_recipe.explain(q, q, q)["triton"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_sdpa_backend_below_sm80_uses_the_memory_efficient_kernel(dtype, monkeypatch):
    """On a (mocked) sm75 GPU the sdpa backend asks torch for EFFICIENT_ATTENTION then MATH, repeats
    kv heads (the memory-efficient kernel has no GQA) and computes bfloat16 in float32 (it takes
    float16 and float32 only below sm80). Run on the CPU here, whose MATH kernel serves the call."""
    from torch.nn import attention

    from flash_recipe import dispatch

    monkeypatch.setattr(dispatch.capabilities, "pre_ampere_nvidia", lambda device: True)
    asked, seen = [], []
    real_kernel, real_sdpa = attention.sdpa_kernel, F.scaled_dot_product_attention

    def spy_kernel(backends, *args, **kwargs):
        asked.append(list(backends))
        return real_kernel(backends, *args, **kwargs)

    def spy_sdpa(q, k, v, **kwargs):
        seen.append((q.dtype, k.shape[1], kwargs.get("enable_gqa", False)))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel", spy_kernel)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    q, k, v = (
        t(2, 9, 4, 16, dtype=dtype, seed=1),
        t(2, 13, 2, 16, dtype=dtype, seed=2),
        t(2, 13, 2, 16, dtype=dtype, seed=3),
    )
    # an enclosing restriction to one kernel the call cannot use (EFFICIENT_ATTENTION has no CPU
    # kernel, as FLASH_ATTENTION has none on a T4) does not make the backend fail
    with use_backend("sdpa"), real_kernel([attention.SDPBackend.EFFICIENT_ATTENTION]):
        out = flash_attn_func(q, k, v, causal=True)
    assert asked == [[attention.SDPBackend.EFFICIENT_ATTENTION, attention.SDPBackend.MATH]]
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    assert seen == [(compute, 4, False)]
    assert out.dtype == dtype
    # the accuracy rule: at most 2x the error of torch computing the same attention in this dtype
    expected, _ = attention_reference(q, k, v, causal=True)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1)
    bottom_right = torch.ones(9, 13, dtype=torch.bool).tril(13 - 9)
    same_precision = real_sdpa(qt, kt, vt, attn_mask=bottom_right).transpose(1, 2)
    torch_error = (same_precision.float() - expected.float()).abs().max().item()
    assert torch_error < 1e-2
    assert (out.float() - expected.float()).abs().max().item() <= accuracy_bound(torch_error, FORWARD_FACTOR)


def test_sdpa_backend_at_sm80_leaves_the_kernel_choice_to_torch(monkeypatch):
    from torch.nn import attention

    from flash_recipe import dispatch

    monkeypatch.setattr(dispatch.capabilities, "pre_ampere_nvidia", lambda device: False)
    asked = []
    monkeypatch.setattr(attention, "sdpa_kernel", lambda backends, *a, **kw: asked.append(backends))
    with use_backend("sdpa"):
        flash_attn_func(Q, K, K)
    assert asked == []


@pytest.mark.parametrize("seed", range(4))
def test_sdpa_backend_on_cpu_records_gradients_on_torchs_math_kernel(seed, monkeypatch):
    """A CPU call that autograd records asks torch for MATH only: the CPU flash kernel torch picks
    otherwise gives fp32 gradients beyond the accuracy rule at inputs of magnitude 3. Both runs
    are compared with the fp64 truth; without grad the kernel choice stays torch's."""
    from torch.nn import attention

    from flash_recipe.testing import GRADIENT_FACTOR

    asked = []
    real_kernel = attention.sdpa_kernel

    def spy_kernel(backends, *args, **kwargs):
        asked.append(list(backends))
        return real_kernel(backends, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel", spy_kernel)
    q, k, v = (t(2, 39, 2, 48, seed=10 * seed + i) * 3 for i in range(3))
    dout = t(2, 39, 2, 48, seed=10 * seed + 3)

    def grads(dtype, run):
        x = [a.to(dtype).requires_grad_() for a in (q, k, v)]
        return torch.autograd.grad(run(*x), x, dout.to(dtype))

    with use_backend("sdpa"):
        ours = grads(torch.float32, lambda *x: flash_attn_func(*x, causal=True))
    truth = grads(torch.float64, lambda *x: attention_reference(*x, causal=True)[0])
    same = grads(torch.float32, lambda *x: attention_reference(*x, causal=True, upcast=False)[0])
    for name, got, want, torch_same in zip(("dq", "dk", "dv"), ours, truth, same):
        error = (got.double() - want).abs().max().item()
        bound = accuracy_bound((torch_same.double() - want).abs().max().item(), GRADIENT_FACTOR)
        assert error <= bound, f"{name}: {error:.3g} > {bound:.3g}"
    assert asked == [[attention.SDPBackend.MATH]]
    asked.clear()
    with use_backend("sdpa"), torch.no_grad():
        flash_attn_func(q, k, v, causal=True)
    assert asked == []


def test_a_triton_older_than_supported_is_refused_with_the_upgrade(monkeypatch):
    import triton

    from flash_recipe import dispatch
    from flash_recipe.env import versions

    monkeypatch.setattr(triton, "__version__", "3.1.0")
    dispatch.capabilities.triton_too_old.cache_clear()
    try:
        reason = dispatch.TritonBackend().is_available()
        oldest = ".".join(map(str, versions.TRITON_MIN))
        assert f"Triton 3.1.0 is older than {oldest}" in reason and "upgrade torch" in reason
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        dispatch.capabilities.triton_too_old.cache_clear()
        assert dispatch.TritonBackend().is_available() is None
    finally:
        dispatch.capabilities.triton_too_old.cache_clear()


def test_integer_arguments_take_any_index_like_value(monkeypatch):
    """flash-attn takes integers as anything usable as an index: its own tests draw
    ``window_size = torch.randint(0, seqlen_k, (2,))``. Each form gives the plain-int result."""
    import numpy as np

    monkeypatch.setenv("FLASH_RECIPE_BACKEND", "reference")
    q, k = t(1, 9, 2, 16, seed=1), t(1, 12, 2, 16, seed=2)
    want = flash_attn_func(q, k, k, window_size=(4, 2))
    for window in (
        torch.tensor([4, 2]),
        torch.tensor([4, 2], dtype=torch.int32),
        [4, 2],
        np.array([4, 2]),
        (np.int64(4), np.int32(2)),
        (torch.tensor(4), 2),
    ):
        torch.testing.assert_close(flash_attn_func(q, k, k, window_size=window), want, atol=0, rtol=0)
    cache = t(1, 16, 2, 16, seed=3)
    want = flash_recipe.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=7, num_splits=1)
    for seqlens, splits in ((np.int64(7), np.int16(1)), (torch.tensor(7), torch.tensor(1))):
        got = flash_recipe.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=seqlens, num_splits=splits)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_sdpa_dropout_runs_where_its_docstring_says():
    """With dropout, scaled_dot_product_attention runs on the Triton kernels when they can run the
    call (their own Philox mask, reproducible under torch.manual_seed), and on torch's when asked."""
    query, key = t(1, 2, 24, 16, seed=1), t(1, 2, 30, 16, seed=2)

    def sdpa(backend):
        torch.manual_seed(7)
        with use_backend(backend):
            return scaled_dot_product_attention(query, key, key, dropout_p=0.3)

    auto = sdpa("auto")
    torch.testing.assert_close(auto, sdpa("triton"), atol=0, rtol=0)
    assert not torch.equal(auto, sdpa("sdpa"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_documented_window_and_alibi_where_upstream_code_differs(backend, monkeypatch):
    """README, "Where flash-attn's code and docstring disagree": a right window edge >= seqlen_k
    keeps its documented meaning (upstream's kernels make it unbounded), and causal ALiBi returns
    the lse of the documented scores, equal to that of the same call written as a window (-1, 0)."""
    monkeypatch.setenv("FLASH_RECIPE_BACKEND", backend)
    q, k = t(1, 10, 2, 16, seed=1), t(1, 3, 2, 16, seed=2)
    out = flash_attn_func(q, k, k, window_size=(-1, 4))  # row i sees keys j <= i - 7 + 4
    assert (out[:, :3] == 0).all() and (out[:, 3:] != 0).all()
    expected, _ = attention_reference(q, k, k, window=(-1, 4))
    torch.testing.assert_close(out, expected.float(), atol=1e-6, rtol=1e-5)

    q, k = t(1, 7, 2, 16, seed=3), t(1, 12, 2, 16, seed=4)
    slopes = torch.tensor([0.5, 0.25])
    causal = flash_attn_func(q, k, k, causal=True, alibi_slopes=slopes, return_attn_probs=True)[1]
    window = flash_attn_func(q, k, k, window_size=(-1, 0), alibi_slopes=slopes, return_attn_probs=True)[1]
    i, j = torch.arange(7)[:, None], torch.arange(12)[None, :]
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 16**-0.5
    scores = scores - slopes.double()[None, :, None, None] * (i + 5 - j).abs()
    scores = scores.masked_fill(j > i + 5, float("-inf"))
    torch.testing.assert_close(causal, window, atol=0, rtol=0)
    torch.testing.assert_close(causal.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-6)


def test_a_last_dim_of_size_one_may_have_any_stride(monkeypatch):
    """Torch counts a tensor whose last dim has size 1 as contiguous whatever that dim's stride
    (``x.transpose(-1, -2)`` of an ``(..., 1, n)`` tensor); the Triton kernels take it too."""
    monkeypatch.setenv("FLASH_RECIPE_BACKEND", "triton")
    query = t(1, 2, 1, 8, seed=1).transpose(-1, -2)  # (1, 2, 8, 1), last-dim stride 8
    assert query.stride(-1) == 8 and query.is_contiguous()
    expected = F.scaled_dot_product_attention(query, query, query)
    torch.testing.assert_close(scaled_dot_product_attention(query, query, query), expected, atol=1e-6, rtol=1e-5)
    q = query.transpose(1, 2)  # flash layout (1, 8, 2, 1), last-dim stride 8
    torch.testing.assert_close(flash_attn_func(q, q, q), expected.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_use_backend_belongs_to_the_thread_that_chose_it(monkeypatch):
    """Two threads (two requests in a server) hold different backends at the same time: each
    selects its own, and leaving one block does not end the other's choice."""
    import threading

    from flash_recipe import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    call = dispatch.AttentionCall(Q, K, K, 0.25)
    both_inside, first_left = threading.Barrier(2), threading.Event()
    seen, errors = {}, []

    def request(name: str, leaves_first: bool) -> None:
        try:
            with use_backend(name):
                both_inside.wait(timeout=30)
                if not leaves_first:
                    assert first_left.wait(timeout=30)
                seen[name] = (dispatch.forced_backend(), dispatch.select(call).name)
            if leaves_first:
                first_left.set()
        except Exception as exc:  # reported below: an assertion in a thread would pass silently
            errors.append(exc)

    threads = [
        threading.Thread(target=request, args=("sdpa", True)),
        threading.Thread(target=request, args=("reference", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and seen == {"sdpa": ("sdpa", "sdpa"), "reference": ("reference", "reference")}
    assert dispatch.forced_backend() is None


def test_use_backend_belongs_to_the_asyncio_task_that_chose_it():
    """Tasks of one event loop interleave inside their ``with use_backend`` blocks; each keeps its own."""
    import asyncio

    from flash_recipe import dispatch

    async def request(name: str, seen: dict) -> None:
        with use_backend(name):
            await asyncio.sleep(0)  # the other task runs here, inside its own block
            seen[name] = dispatch.forced_backend()
            await asyncio.sleep(0)
            seen[name] += "," + dispatch.forced_backend()

    async def main() -> dict:
        seen = {}
        await asyncio.gather(request("sdpa", seen), request("reference", seen))
        return seen

    assert asyncio.run(main()) == {"sdpa": "sdpa,sdpa", "reference": "reference,reference"}
    assert dispatch.forced_backend() is None


def test_attention_call_sets_the_causal_window_itself():
    """``causal`` is a window whose right edge is the diagonal: the call says so on construction,
    whatever window it was given, so no backend works it out again."""
    from flash_recipe import dispatch

    for window, expected in (((-1, -1), (-1, 0)), ((5, 3), (5, 0)), ((2, -1), (2, 0))):
        call = dispatch.AttentionCall(Q, K, K, 0.25, causal=True, window=window)
        assert call.window == expected
        assert dispatch.AttentionCall(Q, K, K, 0.25, window=window).window == window
    sdpa_causal = dispatch.AttentionCall(Q, K, K, 0.25, causal=True)  # what the SDPA entry builds
    assert sdpa_causal.window == (-1, 0)
    assert dataclasses.replace(sdpa_causal, causal=False).window == (-1, 0)  # a window stays once set


# (dtype, log2 of the scores batch * nheads * seqlen_q * seqlen_k): the largest power of two the
# torch backends still hold, and the next one, which they cannot (float32 scores for 16-bit inputs,
# float64 for float32: 2**63 bytes either way).
SCORE_LIMITS = [(torch.float16, 60, 61), (torch.bfloat16, 60, 61), (torch.float32, 59, 60)]


@pytest.mark.parametrize("dtype,fits,over", SCORE_LIMITS, ids=["float16", "bfloat16", "float32"])
def test_the_score_bound_is_where_the_torch_backends_stop(dtype, fits, over):
    """On meta tensors (shapes only, nothing allocated) the largest call under the bound runs on the
    torch backends, and the next is refused with the bound, the dtype and the fix, on every backend,
    where torch itself fails with "Storage size calculation overflowed"."""

    def tensor(log2_scores, layout):
        batch, seqlen = 2 ** ((log2_scores - 3) % 2), 2 ** ((log2_scores - 3) // 2)  # 8 heads, Sq = Sk
        shape = (batch, 8, seqlen, 16) if layout == "sdpa" else (batch, seqlen, 8, 16)
        return torch.empty(shape, device="meta", dtype=dtype)

    limit = flash_recipe.validate.max_scores(dtype)
    assert 2**fits <= limit < 2**over
    for backend in ("sdpa", "reference", "triton"):
        with use_backend(backend):
            if backend != "triton":  # the triton backend takes no meta tensors
                q = tensor(fits, "sdpa")
                assert scaled_dot_product_attention(q, q, q).shape == q.shape
                q = tensor(fits, "flash")
                assert flash_attn_func(q, q, q).shape == q.shape
            refused = rf"= {2**over} scores; a call may have at most {limit} .*fix: split the call"
            q = tensor(over, "sdpa")
            with pytest.raises(ValueError, match=rf"^query and key make .*{refused}"):
                scaled_dot_product_attention(q, q, q)
            q = tensor(over, "flash")
            with pytest.raises(ValueError, match=rf"^q and k make .*{refused}"):
                flash_attn_func(q, q, q)
    # Where torch stops: the reference (float32 or float64 scores) just over the bound, torch's SDPA
    # (float32 scores on the CPU and meta, for every dtype here) at 2**61 scores.
    with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
        attention_reference(*(tensor(over, "flash"),) * 3)
    with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
        F.scaled_dot_product_attention(*(tensor(61, "sdpa"),) * 3)
