"""Where the kernels use tensor descriptors (TMA): decided in ``flash_recipe.ops.features``."""

from __future__ import annotations

import pytest
import torch

from flash_recipe.ops import features, targets


def test_descriptors_on_hopper_and_blackwell_where_triton_has_them(monkeypatch):
    """Whether the installed Triton has descriptors is found by looking for their module."""
    monkeypatch.delenv("FLASH_RECIPE_TMA", raising=False)
    assert features.descriptors_available() is (targets.triton_release() >= (3, 4))  # shipped since 3.4
    monkeypatch.setattr(features, "descriptors_available", lambda: True)
    assert [
        t
        for t in ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "sm121", "gfx942", "interpreter")
        if features.descriptors_enabled(t)
    ] == ["sm90", "sm100"]
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("FLASH_RECIPE_TMA", off)
        assert not features.descriptors_enabled("sm90"), off
    monkeypatch.delenv("FLASH_RECIPE_TMA")
    monkeypatch.setattr(features, "descriptors_available", lambda: False)  # a Triton without the module
    assert not features.descriptors_enabled("sm90")
    with (
        pytest.raises(NotImplementedError, match="has no triton.tools.tensor_descriptor"),
        features.using_descriptors(True),
    ):
        pass
    with features.using_descriptors(False):
        assert not features.descriptors_enabled("sm90")


def test_a_forced_choice_holds_in_its_block_only(monkeypatch):
    monkeypatch.setattr(features, "descriptors_available", lambda: True)
    with features.using_descriptors(True):
        assert features.descriptors_enabled("interpreter") and features.descriptors_enabled("sm80")
        with features.using_descriptors(False):
            assert not features.descriptors_enabled("sm90")
        assert features.descriptors_enabled("sm86")
    assert not features.descriptors_enabled("interpreter")


def test_only_tensors_tma_can_read_as_row_tiles_qualify():
    k = torch.empty(2, 80, 4, 64, dtype=torch.float16)
    assert features.descriptor_problem(k, 64) is None
    assert features.descriptor_problem(torch.empty(1, 80, 4, 64, dtype=torch.bfloat16)[:, 1:], 64) is None
    qkv = torch.empty(2, 80, 3, 4, 64, dtype=torch.float16)  # a packed qkv view: heads side by side, batches stacked
    assert features.descriptor_problem(qkv[:, :, 1], 64) is None
    problems = {
        "fp32": (k.float(), "fp16 or bf16"),
        "odd base": (torch.empty(2 * 80 * 4 * 64 + 1, dtype=torch.float16)[1:].view(2, 80, 4, 64), "16 bytes"),
        "heads apart": (torch.empty(2, 80, 4, 72, dtype=torch.float16)[..., :64], "contiguous heads"),
        "(B, H, S, D)": (torch.empty(2, 4, 80, 64, dtype=torch.float16).transpose(1, 2), "contiguous heads"),
        "batches apart": (torch.empty(2, 96, 4, 64, dtype=torch.float16)[:, :80], "contiguous heads"),
        "head dim 96": (torch.empty(2, 80, 4, 96, dtype=torch.float16), "box limits"),
        "empty": (torch.empty(2, 0, 4, 64, dtype=torch.float16), "non-empty"),
    }
    for name, (tensor, reason) in problems.items():
        assert reason in (features.descriptor_problem(tensor, 64) or ""), name
    assert "box limits" in features.descriptor_problem(k, 512)


def test_tma_views_are_row_tiles_of_keys_and_values(monkeypatch):
    k, v = (torch.empty(2, 80, 4, 64, dtype=torch.float16) for _ in range(2))
    assert features.tma_views(k, v, 32) is None  # the CPU (interpreter target): pointers
    monkeypatch.setattr(targets, "triton_release", lambda: (3, 9))
    with features.using_descriptors(True):
        tiles = features.tma_views(k, v, 32)
        assert features.tma_views(k, v.float(), 32) is None
    layout = [(list(t.shape), list(t.strides), list(t.block_shape)) for t in tiles]
    assert layout == [([160, 256], [256, 1], [32, 64])] * 2
    assert tiles[0].base is k and tiles[1].base is v
