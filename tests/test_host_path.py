"""The shortcuts a repeated call takes on the host give what the long way gives.

- ``environ.getenv`` reads what ``os.environ.get`` reads: set, unset, changed, non-ASCII, and
  with ``os.environ`` replaced by a plain mapping;
- ``AttentionCall.repeated`` gives the call that its constructor and ``signed`` give, every field;
- ``features.rebased`` gives the tensor descriptors Triton's ``TensorDescriptor`` builds;
- an eager call under autograd through the C ``apply`` gives the gradients ``Function.apply`` gives,
  and a functorch transform still meets ``Function.apply``'s error;
- a repeated forward keyed by ``features.settings`` plans again when a setting changes.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from flash_recipe import call_builder, environ
from flash_recipe.dispatch.call import AttentionCall
from flash_recipe.ops import attention, features
from flash_recipe.ops.options import ScoreOptions

NAME = "FLASH_RECIPE_TEST_SETTING"
# Causal attention at scale 1/4, nothing else.
CAUSAL = ScoreOptions(softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None)


def test_getenv_reads_what_os_environ_reads(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert environ.getenv(NAME) == "" and environ.getenv(NAME, "1") == "1"
    for value in ("0", "on", " spaced ", "grüße", ""):
        monkeypatch.setenv(NAME, value)
        assert environ.getenv(NAME) == os.environ.get(NAME) == value
    os.environ[NAME] = "direct"
    assert environ.getenv(NAME) == "direct"
    del os.environ[NAME]
    assert environ.getenv(NAME, "gone") == "gone"


def test_getenv_falls_back_where_os_environ_is_a_plain_mapping(monkeypatch):
    monkeypatch.setattr(os, "environ", {NAME: "plain"})
    assert environ.getenv(NAME) == "plain" and environ.getenv(NAME + "_UNSET", "d") == "d"


def _checked_call(**extra) -> AttentionCall:
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    options = call_builder.FlashOptions(causal=True, window_size=(3, 7), softcap=0.5, **extra)
    return call_builder.build_flash_call(q, k, v, options)


def test_a_repeated_call_has_every_field_of_the_constructed_one():
    built = _checked_call(return_lse=True, learnable_sink=torch.randn(4))
    fields = call_builder._derived_fields(built)
    tensors = {name: getattr(built, name) for name in call_builder._TENSOR_FIELDS}
    again = AttentionCall.repeated(fields, ("a", "key"), **tensors)
    names = [f.name for f in dataclasses.fields(AttentionCall)]
    assert set(vars(again)) == set(names)  # every field set, nothing else
    assert again == built and again.window == built.window == (3, 0)  # causal's right edge, as constructed
    assert again.signature == ("a", "key")
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.causal = False


def test_a_memo_hit_of_the_public_layer_returns_the_constructed_call():
    first = _checked_call()
    second = call_builder.build_flash_call(
        first.q, first.k, first.v, call_builder.FlashOptions(causal=True, window_size=(3, 7), softcap=0.5)
    )
    assert second.signature is not None and second.signature == first.signature
    assert second == first


@pytest.mark.skipif(not features.descriptors_available(), reason="this Triton has no tensor descriptors")
def test_rebased_descriptors_are_the_ones_triton_builds():
    k = torch.randn(2, 64, 2, 32, dtype=torch.float16)
    v = torch.randn(2, 64, 2, 32, dtype=torch.float16)
    form = features.descriptor_form(features.descriptors(k, v, 16))
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    got, want = features.rebased(form, k2, v2), features.descriptors(k2, v2, 16)
    for g, w in zip(got, want):
        assert type(g) is type(w) and vars(g).keys() == vars(w).keys()
        assert g.base is w.base and all(vars(g)[n] == vars(w)[n] for n in vars(w) if n != "base")
    assert got[0].base is k2 and got[1].base is v2


def _grads(q, k, v, options):
    out, _ = attention.attention(q, k, v, options)
    return torch.autograd.grad(out.float().square().sum(), (q, k, v))


@pytest.mark.skipif(attention._C_APPLY is None, reason="this torch lacks the C apply")
def test_the_c_apply_gives_function_apply_s_gradients(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    direct = _grads(q, k, v, CAUSAL)
    monkeypatch.setattr(attention, "_C_APPLY", None)  # the public Function.apply
    plain = _grads(q, k, v, CAUSAL)
    for a, b in zip(direct, plain):
        assert torch.equal(a, b)


def test_a_functorch_transform_meets_function_apply(monkeypatch):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: attention.attention(q, k, v, CAUSAL)[0].sum())(q)


def test_forward_plans_are_keyed_by_the_settings_as_read(monkeypatch):
    monkeypatch.delenv("FLASH_RECIPE_TMA", raising=False)
    before = features.settings()
    monkeypatch.setenv("FLASH_RECIPE_TMA", "0")
    assert features.settings() != before and features.requested() is False
    with features.using_descriptors(False):
        assert features.settings()[0] is False
