"""The small diffusers transformers the diffusers tests run: random weights from a config, nothing
from a hub. Flux (``test_diffusers.py`` and its context-parallel ranks, ``ring_worker.diffusers_client``:
forward and backward) and, for 8-bit attention (``test_diffusers_sage.py``: forward only), Flux,
Wan and HunyuanVideo.

diffusers decides at import time whether flash-attn and SageAttention are usable, so importing
this module installs the stand-ins (``install_as_flash_attn()``, ``install_as_flash_attn_3()``,
``install_as_sageattention()``) before it imports diffusers: import it before anything imports
diffusers.
"""

from __future__ import annotations

import copy

import torch

import flash_recipe

for _install in (
    flash_recipe.install_as_flash_attn,
    flash_recipe.install_as_flash_attn_3,
    flash_recipe.install_as_sageattention,
):
    if not _install():
        raise RuntimeError(f"{_install.__name__}() left an upstream package in place; these tests need the stand-in")

from diffusers import FluxTransformer2DModel, HunyuanVideoTransformer3DModel, WanTransformer3DModel  # noqa: E402
from diffusers.models import attention_dispatch  # noqa: E402, F401  (the tests reach diffusers' registry here)

from flash_recipe.testing.accuracy import FACTORS, accuracy_bound, max_error  # noqa: E402

# Image rows (a 3 x 4 grid of patches) and text rows; both even, so context parallelism over two
# ranks splits each sequence into equal halves, as diffusers requires.
IMAGE_ROWS, TEXT_ROWS = 12, 6


def flux_model() -> FluxTransformer2DModel:
    """One double-stream and one single-stream block, 2 heads of 16, in float32."""
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


def flux_inputs(dtype: torch.dtype) -> dict:
    """hidden_states (1, 12, 4), encoder_hidden_states (1, 6, 32), pooled_projections (1, 32), a
    timestep and the rotary position ids of both sequences; seeded, all in ``dtype``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(IMAGE_ROWS, 3)
    ids[:, 1], ids[:, 2] = torch.arange(IMAGE_ROWS) // 4, torch.arange(IMAGE_ROWS) % 4
    inputs = dict(
        hidden_states=torch.randn(1, IMAGE_ROWS, 4, generator=gen),
        encoder_hidden_states=torch.randn(1, TEXT_ROWS, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=ids,
        txt_ids=torch.zeros(TEXT_ROWS, 3),
    )
    return {name: t.to(dtype) for name, t in inputs.items()}


def run_model(model, backend: str, dtype: torch.dtype, parallel=None) -> dict:
    """The output (1, 12, 4) and the gradients of the two sequence inputs, from
    ``(output * w).sum()`` with a seeded ``w``, on a copy of ``model`` in ``dtype`` on ``backend``.

    ``parallel``: a diffusers ``ContextParallelConfig``; the copy is then parallelised with it
    (``enable_parallelism``), and each rank returns the whole output (diffusers gathers it) and
    the gradients of the input rows it holds (zero elsewhere).
    """
    model = copy.deepcopy(model).to(dtype)
    model.set_attention_backend(backend)
    if parallel is not None:
        model.enable_parallelism(config=parallel)
    inputs = flux_inputs(dtype)
    leaves = [inputs[name].requires_grad_() for name in ("hidden_states", "encoder_hidden_states")]
    out = model(**inputs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    (out * weights).sum().backward()
    return {"out": out.detach(), "d_hidden": leaves[0].grad, "d_encoder": leaves[1].grad}


def errors_and_bounds(got: dict, truth: dict, same: dict) -> dict:
    """Per tensor, the error of ``got`` against the float64 ``truth`` and the accuracy rule's bound
    from ``same`` (``native`` in the same dtype), applied to the whole model: 2x for the output,
    3x for the gradients, plus 1e-5."""
    report = {}
    for name, value in got.items():
        if not torch.isfinite(value).all():
            raise AssertionError(f"{name} is not finite")
        factor = FACTORS["out"] if name == "out" else FACTORS["dq"]
        report[name] = {
            "error": max_error(value, truth[name]),
            "bound": accuracy_bound(max_error(same[name], truth[name]), factor),
        }
    return report


def wan_model() -> WanTransformer3DModel:
    """One Wan block (self-attention over the video patches, cross-attention to the text), 2 heads
    of 16, in float32."""
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
    ).eval()


def wan_inputs(dtype: torch.dtype) -> dict:
    """A latent video (1, 4, 2, 8, 10): 2 frames of 4 x 5 patches, 40 rows; 7 text rows of 32."""
    gen = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 4, 2, 8, 10, generator=gen).to(dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=gen).to(dtype),
    )


def hunyuan_model() -> HunyuanVideoTransformer3DModel:
    """One double-stream and one single-stream HunyuanVideo block and one text-refiner block, 2 heads
    of 16, in float32."""
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=32,
        pooled_projection_dim=16,
        rope_axes_dim=(4, 4, 8),
        guidance_embeds=False,
    ).eval()


def hunyuan_inputs(dtype: torch.dtype) -> dict:
    """Two latent videos (2, 4, 2, 4, 5), 40 rows each, and 7 text rows of 32 whose mask pads the
    second prompt to 4 tokens: the joint attention then sees 47 and 44 keys (the model passes that
    key mask to every attention call)."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    return dict(
        hidden_states=torch.randn(2, 4, 2, 4, 5, generator=gen).to(dtype),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=gen).to(dtype),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(2, 16, generator=gen).to(dtype),
    )


# name -> (model, inputs): the models the 8-bit attention test runs.
MODELS = {
    "flux": (flux_model, flux_inputs),
    "wan": (wan_model, wan_inputs),
    "hunyuan": (hunyuan_model, hunyuan_inputs),
}


def run_forward(model, inputs, backend: str, dtype: torch.dtype) -> torch.Tensor:
    """The output of a copy of ``model`` in ``dtype`` on the attention ``backend``, forward only
    (under ``torch.no_grad()``), on ``inputs(dtype)``; on the GPU where there is one (the 8-bit
    kernel runs on CPU tensors only through the interpreter)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = copy.deepcopy(model).to(device, dtype)
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in inputs(dtype).items()}, return_dict=False)[0]
