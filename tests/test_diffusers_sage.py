"""diffusers 0.42 on flash_recipe's 8-bit attention: its ``sage`` and ``sage_varlen`` attention
backends (which import SageAttention) served by the stand-in (``install_as_sageattention()``), with
small Flux, Wan and HunyuanVideo transformers built from configs with random weights (nothing from
a hub; ``diffusers_model``).

diffusers decides at import time whether SageAttention is usable (``importlib.metadata``, version
>= 2.1.1), so the stand-in is installed before diffusers is imported, as a user would do
(``docs/use-from.md``). 8-bit attention is for inference: every run is a forward under
``torch.no_grad()``, in fp16 and bf16, which on a CPU run the 8-bit Triton kernel through the
interpreter.

Each run is checked three ways (``run_checked``):

- every attention call diffusers makes, against diffusers' own ``native`` backend on the same
  arguments in float32, by the 8-bit method's bounds (``assert_method_accurate``): the check with
  teeth, since a random-weight model dilutes an attention error in its output;
- the model's output against the same model on ``native`` in float32, by the same bounds;
- the 8-bit kernel launched once per attention call: a silent fallback (diffusers' own, or a
  ``sageattn`` that called torch instead) passes both accuracy checks, and fails this one.

diffusers checks the backends' constraints only with ``DIFFUSERS_ATTN_CHECKS=1``; among them is
``_check_device_cuda``, which refuses CPU tensors, so the tests run with the checks off (the
default). HunyuanVideo passes a key mask to every attention call, which diffusers' ``sage``
backend refuses (ValueError) and its ``sage_varlen`` backend turns into packed sequences. The test
lives in its own environment: ``nox -s diffusers`` (``FLASH_RECIPE_REQUIRE_DIFFUSERS=1``); elsewhere
it is skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("diffusers") is None:
    if os.environ.get("FLASH_RECIPE_REQUIRE_DIFFUSERS") == "1":
        raise RuntimeError("FLASH_RECIPE_REQUIRE_DIFFUSERS=1 but diffusers is not installed")
    pytest.skip("diffusers runs in its own environment: nox -s diffusers", allow_module_level=True)

# diffusers_model installs the stand-ins, then imports diffusers.
from diffusers_model import MODELS, attention_dispatch, run_forward  # noqa: E402

from flash_recipe import sage  # noqa: E402
from flash_recipe.ops import int8_attention  # noqa: E402
from flash_recipe.testing.quantized import assert_method_accurate, method_metrics  # noqa: E402

REGISTRY = attention_dispatch._AttentionBackendRegistry
NATIVE = REGISTRY._backends[attention_dispatch.AttentionBackendName.NATIVE]
# Attention calls per forward that go through diffusers' backends: Flux's double- and
# single-stream blocks; Wan's self- and cross-attention; HunyuanVideo's double- and single-stream
# blocks (its text refiner calls torch SDPA directly, whatever the backend).
ATTENTION_CALLS = {"flux": 2, "wan": 2, "hunyuan": 2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])


@pytest.fixture(autouse=True)
def _no_constraint_checks(monkeypatch):
    monkeypatch.setattr(REGISTRY, "_checks_enabled", False)


def _count_launches(monkeypatch) -> list:
    launches: list = []
    kernel = int8_attention.attn_int8_kernel.fn
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **k: launches.append(1) or _run(*a, **k))
    return launches


def _record_calls(monkeypatch, backend: str) -> list:
    """Every call diffusers makes to ``backend``: ``(arguments, output)``."""
    name = attention_dispatch.AttentionBackendName(backend)
    original = REGISTRY._backends[name]
    calls: list = []

    def recording(**kwargs):
        out = original(**kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setitem(REGISTRY._backends, name, recording)
    return calls


def _native_fp32(arguments: dict) -> torch.Tensor:
    """diffusers' ``native`` backend (torch SDPA) on the same arguments, q, k and v in float32."""
    names = REGISTRY._supported_arg_names[attention_dispatch.AttentionBackendName.NATIVE]
    kwargs = {k: v for k, v in arguments.items() if k in names}
    for key in ("query", "key", "value"):
        kwargs[key] = kwargs[key].float()
    with torch.no_grad():
        return NATIVE(**kwargs)


def run_checked(model_name: str, backend: str, dtype: torch.dtype, monkeypatch) -> torch.Tensor:
    """The output of ``model_name`` on ``backend`` in ``dtype``, after the three checks of the module
    docstring (accuracy of each call, accuracy of the output, then the launches); AssertionError
    names the first that fails."""
    make, inputs = MODELS[model_name]
    model = make()
    launches = _count_launches(monkeypatch)
    calls = _record_calls(monkeypatch, backend)
    got = run_forward(model, inputs, backend, dtype)
    launched = len(launches)
    case = f"{model_name} on {backend} in {dtype}"
    assert len(calls) == ATTENTION_CALLS[model_name], f"{case}: {len(calls)} attention calls"
    for i, (arguments, out) in enumerate(calls):
        assert out.dtype == dtype and torch.isfinite(out).all(), f"{case}: call {i} gave {out.dtype}, or not finite"
        assert_method_accurate(f"{case}, attention call {i}", out, _native_fp32(arguments))
    assert_method_accurate(f"{case}, model output", got, run_forward(model, inputs, "native", torch.float32))
    assert launched == len(calls), (
        f"{case}: {len(calls)} attention calls launched the 8-bit kernel {launched} times "
        "(a call that did not launch it ran on something else)"
    )
    return got


def test_sageattention_is_seen_as_installed():
    assert attention_dispatch._CAN_USE_SAGE_ATTN
    for name in sage.SAGE_NAMES:
        assert getattr(attention_dispatch, name) is getattr(sage, name)


@DTYPES
@pytest.mark.parametrize("backend", ["sage", "sage_varlen"])
@pytest.mark.parametrize("model_name", ["flux", "wan"])
def test_backend_is_accurate_and_runs_the_kernel(model_name, backend, dtype, monkeypatch):
    run_checked(model_name, backend, dtype, monkeypatch)


@DTYPES
def test_hunyuan_video_on_sage_varlen(dtype, monkeypatch):
    """Two prompts of 7 and 4 tokens: ``sage_varlen`` packs the keys of each (47 and 44 rows), and
    each sequence gets its own K mean and quantization blocks."""
    run_checked("hunyuan", "sage_varlen", dtype, monkeypatch)


def test_hunyuan_video_on_sage_is_refused_by_diffusers():
    """diffusers' ``sage`` backend refuses any ``attn_mask``, and HunyuanVideo always passes one."""
    make, inputs = MODELS["hunyuan"]
    with pytest.raises(ValueError, match="`attn_mask` is not supported for sage attention"):
        run_forward(make(), inputs, "sage", torch.float16)


@DTYPES
@pytest.mark.parametrize("model_name", ["flux", "wan"])
def test_sage_varlen_agrees_with_sage(model_name, dtype, monkeypatch):
    """Without a mask each packed sequence is one batch entry, smoothed and quantized in the same
    blocks: the two backends give the same output, to the bit."""
    dense = run_checked(model_name, "sage", dtype, monkeypatch)
    packed = run_checked(model_name, "sage_varlen", dtype, monkeypatch)
    assert torch.equal(packed, dense), method_metrics(packed, dense)


def test_a_fallback_to_torch_fails_the_check(monkeypatch):
    """``sageattn`` as diffusers holds it (``attention_dispatch.sageattn``, taken from the stand-in
    at import) replaced by torch SDPA: both accuracy checks pass (SDPA is more accurate than 8-bit
    attention), and the launch count catches it."""

    def sdpa_instead(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)
        return out.transpose(1, 2) if tensor_layout == "NHD" else out

    monkeypatch.setattr(attention_dispatch, "sageattn", sdpa_instead)
    with pytest.raises(AssertionError, match="2 attention calls launched the 8-bit kernel 0 times"):
        run_checked("flux", "sage", torch.float16, monkeypatch)


def test_a_wrong_result_fails_the_check(monkeypatch):
    """``sageattn`` as diffusers holds it, its output 3% too large: the per-call check fails (the
    model's output alone, which dilutes attention's error, might not)."""

    def three_percent_off(*args, **kwargs):
        return sage.sageattn(*args, **kwargs) * 1.03

    monkeypatch.setattr(attention_dispatch, "sageattn", three_percent_off)
    with pytest.raises(AssertionError, match="attention call 0: 8-bit attention outside the method's bounds"):
        run_checked("flux", "sage", torch.float16, monkeypatch)


def test_diffusers_constraint_checks_refuse_the_cpu(monkeypatch):
    """With ``DIFFUSERS_ATTN_CHECKS=1`` diffusers runs the ``sage`` backend's constraints, which
    require CUDA tensors: why the other tests run with the checks off."""
    monkeypatch.setattr(REGISTRY, "_checks_enabled", True)
    make, inputs = MODELS["flux"]
    model = make().to(torch.float16)  # on the CPU, GPU or not
    model.set_attention_backend("sage")
    with torch.no_grad(), pytest.raises(ValueError, match="must be on a CUDA device"):
        model(**inputs(torch.float16), return_dict=False)
