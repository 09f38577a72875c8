"""diffusers 0.42 on flash_recipe: its ``flash`` and ``flash_varlen`` attention backends (which import
flash-attn 2) served by the stand-in (``install_as_flash_attn()``), with a small Flux transformer
built from a config with random weights (nothing from a hub).

diffusers decides at import time whether flash-attn is usable (``importlib.metadata``, version
>= 2.6.3), so the stand-in is installed before diffusers is imported, as a user would do
(``docs/use-from.md``). diffusers needs fp16 or bf16 for these backends. On a CPU fp16 runs
flash_recipe's Triton kernels through the interpreter (the test counts their launches); bf16 runs
flash_recipe's torch fallback, since the interpreter computes bf16 dot products wrongly.

The comparison: the model's output and the gradients of its two inputs, forward and backward, on
each backend against the same model in float64 on ``native`` (torch SDPA); the error may be at most
2x (output) and 3x (gradients) the error of ``native`` in the same dtype, plus 1e-5: the accuracy
rule, applied to the whole model. diffusers' context parallelism is not tested: on a machine
without an accelerator diffusers 0.42.1 divides by ``torch.accelerator.device_count()`` (0) when
it places the ranks (``ModelMixin._resolve_parallel_config``). The test lives in its own
environment: ``nox -s diffusers`` (``FLASH_RECIPE_REQUIRE_DIFFUSERS=1``); elsewhere it is skipped.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("diffusers") is None:
    if os.environ.get("FLASH_RECIPE_REQUIRE_DIFFUSERS") == "1":
        raise RuntimeError("FLASH_RECIPE_REQUIRE_DIFFUSERS=1 but diffusers is not installed")
    pytest.skip("diffusers runs in its own environment: nox -s diffusers", allow_module_level=True)

import flash_recipe  # noqa: E402

assert flash_recipe.install_as_flash_attn(), "an upstream flash-attn is installed here"
from diffusers import FluxTransformer2DModel  # noqa: E402
from diffusers.models import attention_dispatch  # noqa: E402

from flash_recipe.testing.accuracy import FACTORS, assert_accurate  # noqa: E402


def _model() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ).eval()


def _inputs():
    gen = torch.Generator().manual_seed(1)
    image, text = 12, 5
    ids = torch.zeros(image, 3)
    ids[:, 1], ids[:, 2] = torch.arange(image) // 4, torch.arange(image) % 4
    return dict(
        hidden_states=torch.randn(1, image, 4, generator=gen),
        encoder_hidden_states=torch.randn(1, text, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=ids,
        txt_ids=torch.zeros(text, 3),
    )


def _run(model, backend: str, dtype: torch.dtype) -> dict:
    """The output and the gradients of the two sequence inputs, from ``output.sum() * w``."""
    model = copy.deepcopy(model).to(dtype)
    model.set_attention_backend(backend)
    inputs = {name: t.to(dtype) if t.is_floating_point() else t for name, t in _inputs().items()}
    leaves = [inputs[name].requires_grad_() for name in ("hidden_states", "encoder_hidden_states")]
    out = model(**inputs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    (out * weights).sum().backward()
    return {"out": out.detach(), "d_hidden": leaves[0].grad, "d_encoder": leaves[1].grad}


def test_flash_attn_is_seen_as_installed():
    assert attention_dispatch._CAN_USE_FLASH_ATTN
    assert attention_dispatch.flash_attn_func is flash_recipe.flash_attn.flash_attn_func


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["flash", "flash_varlen"])
def test_backend_matches_native_by_the_rule(backend, dtype, monkeypatch):
    from flash_recipe.ops import backward, forward

    launches = []
    for kernel in (forward.attn_fwd_kernel, backward.attn_bwd_dq_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **k: launches.append(1) or _run(*a, **k))
    model = _model()
    truth = _run(model, "native", torch.float64)
    same = _run(model, "native", dtype)
    got = _run(model, backend, dtype)
    if dtype == torch.float16:  # the Triton kernels ran: one forward and one backward per attention
        assert len(launches) == 4
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        factor = FACTORS["out"] if name == "out" else FACTORS["dq"]
        assert_accurate(f"{backend} {dtype} {name}", value, truth[name], same[name], factor)
