"""The small diffusers Flux transformer that ``test_diffusers.py`` and its context-parallel ranks
(``ring_worker.diffusers_client``) run: random weights from a config, nothing from a hub.

Import it only after ``flash_recipe.install_as_flash_attn()``: diffusers decides at import time
whether flash-attn is usable.
"""

from __future__ import annotations

import copy

import torch
from diffusers import FluxTransformer2DModel

from flash_recipe.testing.accuracy import FACTORS, accuracy_bound, max_error

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
