"""The version gates, on the torch that runs the tests: a gate must be taken exactly where the
installed torch lacks what is behind it. ``nox -s torch_compat`` runs this file under every
supported torch release, so on 2.6 to 2.9 the gates below are taken for real (no stand-in module)."""

from __future__ import annotations

import pytest
import torch

from flash_recipe.integrations import sdpa_registry


def _release() -> tuple[int, int]:
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[return-value]


def test_sdpa_registry_gate_matches_the_installed_torch():
    """torch's flash-attention registry appears in 2.10: before it ``register()`` raises the
    RuntimeError that names 2.10 and the direct route; from it on the registry is returned."""
    first = tuple(int(part) for part in sdpa_registry.FIRST_TORCH.split("."))
    if _release() < first:
        with pytest.raises(RuntimeError, match=r"first appears in torch 2\.10.*scaled_dot_product_attention"):
            sdpa_registry.register()
    else:
        import torch.nn.attention as attention

        assert sdpa_registry.check_registry() is attention


def test_the_direct_route_runs_on_every_torch():
    """What the gate's message offers instead, ``flash_recipe.scaled_dot_product_attention``, runs
    on this torch (the reference backend on a CPU) and matches torch's SDPA."""
    import flash_recipe

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    got = flash_recipe.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want)
