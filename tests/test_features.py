"""Compiler features the kernels use where Triton and the GPU have them, decided in
``flash_recipe.ops.features``: tensor descriptors (TMA) and warp specialisation."""

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


TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "sm121", "gfx942", "interpreter")


def test_warp_specialization_is_found_in_tl_range():
    """Whether the installed Triton has it is read from ``tl.range``'s signature, not its version:
    3.9's takes ``warp_specialize``, 3.2's (torch 2.6's pin, CI's oldest) does not."""
    release = targets.triton_release()
    if release >= (3, 9):
        assert features.warp_specialization_available()
    if release < (3, 3):
        assert not features.warp_specialization_available()


def test_warp_specialization_is_asked_for_and_offered_where_it_compiles(monkeypatch):
    """Off unless asked for; asked for, only Blackwell (and the interpreter) at head dims up to 128
    take it, and only for calls it serves (``plain``). The block's choice beats the environment's.
    Under Triton 3.9, which compiles it at every head dim offered (``features.WARP_SPEC_TRITON``)."""
    monkeypatch.setattr(features, "warp_specialization_available", lambda: True)
    monkeypatch.setattr(targets, "triton_release", lambda: (3, 9))
    monkeypatch.delenv(features.WARP_SPEC_ENV, raising=False)
    assert not any(features.warp_specialization(t, 128, plain=True) for t in TARGETS)
    with features.using_warp_specialization(True):
        assert [t for t in TARGETS if features.warp_specialization(t, 128, plain=True)] == ["sm100", "interpreter"]
        assert [d for d in (16, 32, 40, 64, 128, 256) if features.warp_specialization("sm100", d, plain=True)] == [
            16,
            32,
            40,
            64,
            128,
        ]
        assert not features.warp_specialization("sm100", 128, plain=False)  # a window's left edge, sinks, ...
    monkeypatch.setenv(features.WARP_SPEC_ENV, "1")
    assert features.warp_specialization("sm100", 64, plain=True)
    with features.using_warp_specialization(False):
        assert not features.warp_specialization("sm100", 64, plain=True)
    monkeypatch.setenv(features.WARP_SPEC_ENV, "0")
    assert not features.warp_specialization("sm100", 64, plain=True)


def test_warp_specialization_is_refused_where_triton_lacks_it(monkeypatch):
    """As under Triton 3.2, whose ``tl.range`` takes no ``warp_specialize`` (the signature is the
    one thing mocked): asking for it raises NotImplementedError naming the fix, in a block or
    through the environment; a call it would not serve is not refused."""
    monkeypatch.setattr(features, "warp_specialization_available", lambda: False)
    with (
        pytest.raises(NotImplementedError, match=r"using_warp_specialization\(True\).*tl.range takes no"),
        features.using_warp_specialization(True),
    ):
        pass
    monkeypatch.setenv(features.WARP_SPEC_ENV, "1")
    with pytest.raises(NotImplementedError, match="FLASH_RECIPE_WARP_SPEC=1: the installed Triton"):
        features.warp_specialization("sm100", 128, plain=True)
    assert not features.warp_specialization("sm100", 128, plain=False)
    assert not features.warp_specialization("sm100", 256, plain=True)


@pytest.mark.skipif(not features.descriptors_available(), reason="this Triton has no tensor descriptors")
def test_a_launch_asked_for_warp_specialization_without_it_is_refused_cleanly(monkeypatch):
    """The refusal reaches the caller as NotImplementedError, not as a compiler error."""
    import flash_recipe

    monkeypatch.setattr(features, "warp_specialization_available", lambda: False)
    monkeypatch.setenv(features.WARP_SPEC_ENV, "1")
    q, k, v = (torch.randn(1, 24, 2, 64, dtype=torch.float16) for _ in range(3))
    with (
        flash_recipe.use_backend("triton"),
        features.using_descriptors(True),
        pytest.raises(NotImplementedError, match="warp_specialize"),
    ):
        flash_recipe.flash_attn_func(q, k, v)
