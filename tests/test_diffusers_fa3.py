"""diffusers 0.42's FlashAttention-3 backends, ``_flash_3`` and ``_flash_varlen_3``, served by the
FA3 stand-in (``install_as_flash_attn_3()``), on small Flux and Wan transformers built from configs
with random weights (``diffusers_model``, which installs the stand-ins before diffusers imports:
diffusers decides at import whether FA3 is there, by ``find_spec`` and ``version("flash_attn_3")``).

The comparison is the accuracy rule applied to the whole model, as in ``test_diffusers.py``: on
each backend against the same model in float64 on ``native``, at most 2x (output) and 3x
(gradients) the error of ``native`` in the same dtype, plus 1e-5. fp16 runs flash_recipe's Triton
kernels through the interpreter, bf16 its torch fallback.

``_flash_3`` calls FA3 through diffusers' own custom op, which diffusers registers for CUDA only
and without a backward: here the same function is registered for CPU tensors too (the one stand-in
for a GPU in these tests), and the backend is checked forward only, as diffusers can use it.
``_flash_varlen_3`` calls the stand-in directly: forward and backward on Flux, forward on Wan.
The tests run in the diffusers session (``nox -s diffusers``); elsewhere they are skipped.
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
from diffusers_model import MODELS, attention_dispatch, errors_and_bounds, flux_model, run_forward, run_model  # noqa: E402
from multiprocess import assert_within_bounds  # noqa: E402

from flash_recipe.flash_attn_3 import flash_attn_interface  # noqa: E402

DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])


@pytest.fixture
def counted(monkeypatch):
    """The stand-in's calls, by function, as diffusers makes them."""
    calls = {"flash_attn_3_func": 0, "flash_attn_3_varlen_func": 0}  # diffusers' names for the two
    for name in calls:
        function = getattr(attention_dispatch, name)

        def counting(*args, _function=function, _name=name, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(attention_dispatch, name, counting)
    return calls


@pytest.fixture(scope="module")
def cpu_kernel_for_diffusers_op():
    """diffusers' ``_diffusers_flash_attn_3::_flash_attn_forward`` op, registered for CPU tensors
    with diffusers' own body (diffusers registers it for CUDA only)."""
    op = attention_dispatch._wrapped_flash_attn_3
    op.register_kernel("cpu", op._init_fn)


def test_fa3_is_seen_as_installed():
    assert attention_dispatch._CAN_USE_FLASH_ATTN_3
    assert attention_dispatch.flash_attn_3_func is flash_attn_interface.flash_attn_func
    assert attention_dispatch.flash_attn_3_varlen_func is flash_attn_interface.flash_attn_varlen_func


@DTYPES
def test_flash_varlen_3_trains_flux_by_the_rule(dtype, counted):
    model = flux_model()
    truth = run_model(model, "native", torch.float64)
    same = run_model(model, "native", dtype)
    got = run_model(model, "_flash_varlen_3", dtype)
    assert counted["flash_attn_3_varlen_func"] == 2  # one per attention block
    assert_within_bounds([errors_and_bounds(got, truth, same)], [dict(backend="_flash_varlen_3", dtype=str(dtype))])


@DTYPES
@pytest.mark.parametrize("backend", ["_flash_3", "_flash_varlen_3"])
@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_fa3_backends_run_flux_and_wan_by_the_rule(kind, backend, dtype, counted, cpu_kernel_for_diffusers_op):
    build, inputs = MODELS[kind]
    model = build()
    truth = run_forward(model, inputs, "native", torch.float64)
    same = run_forward(model, inputs, "native", dtype)
    got = run_forward(model, inputs, backend, dtype)
    assert sum(counted.values()) > 0
    report = errors_and_bounds({"out": got}, {"out": truth}, {"out": same})
    assert_within_bounds([report], [dict(kind=kind, backend=backend, dtype=str(dtype))])
