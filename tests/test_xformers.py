"""The flash-attn stand-in's ``flash_attn_gpu`` (``flash_recipe.flash_attn.extension``): flash-attn
2.8.3's compiled extension as xformers calls it.

Its four functions are checked here by the accuracy rule against fp32 math, called with the
extension's positional arguments. Where xformers is installed (``FLASH_RECIPE_REQUIRE_XFORMERS=1``:
the diffusers session installs xformers 0.0.35 beside diffusers), ``import xformers.ops`` and
``from diffusers import FluxTransformer2DModel`` run with the stand-in active, and xformers' own
``fa2F``/``fa2B`` operator bodies (``xformers_flash::flash_fwd``/``flash_bwd``, registered for
CUDA only, so called here through the functions they wrap) compute on the CPU what the rule
expects. On a GPU xformers registers those operators and dispatches its flash operator
(``fa2F@2.8.3``) to them, and so to flash_recipe's Triton kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rule_checks import SCALE, check, tensors, truths

import flash_recipe
from flash_recipe.flash_attn import extension

REQUIRED = os.environ.get("FLASH_RECIPE_REQUIRE_XFORMERS") == "1"


def test_the_extensions_dense_forward_and_backward_meet_the_rule():
    """``fwd`` then ``bwd`` with xformers' arguments (``out``, ``gen`` None; ``dq, dk, dv`` given)."""
    q, k, v, dout = tensors((2, 37, 4, 32), (2, 45, 2, 32))
    truth, same = truths(q, k, v, dout, True, (-1, -1))
    with torch.no_grad():
        out, lse, probs, rng = extension.fwd(q, k, v, None, None, 0.0, SCALE, True, -1, 0, 0.0, False, None)
        assert lse.shape == (2, 4, 37) and probs.numel() == 0 and rng.shape == (2,)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        grads = extension.bwd(dout, q, k, v, out, lse, dq, dk, dv, None, 0.0, SCALE, True, -1, 0, 0.0, False, None, rng)
    assert grads[0] is dq and grads[1] is dk and grads[2] is dv and grads[3].shape == (2, 4, 128)
    check({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, truth, same)
    mine = torch.full_like(q, float("nan"))
    assert extension.fwd(q, k, v, mine, None, 0.0, SCALE, True, -1, 0, 0.0, False, None)[0] is mine
    assert torch.equal(mine, out)


def test_the_extensions_varlen_forward_and_backward_meet_the_rule():
    """``varlen_fwd`` then ``varlen_bwd`` (``dq, dk, dv`` None: allocated), two packed sequences."""
    lengths, key_lengths = [13, 24], [20, 24]
    q, k, v, dout = tensors((37, 4, 32), (44, 2, 32), seed=1)
    cu_q, cu_k = (torch.tensor([0, n[0], sum(n)], dtype=torch.int32) for n in (lengths, key_lengths))
    with torch.no_grad():
        out, lse, _, rng = extension.varlen_fwd(
            q, k, v, None, cu_q, cu_k, None, None, None, None, 24, 24, 0.0, SCALE, False, True, -1, 0, 0.0, False,
            None,
        )  # fmt: skip
        dq, dk, dv, softmax_d = extension.varlen_bwd(
            dout, q, k, v, out, lse, None, None, None, cu_q, cu_k, None, 24, 24, 0.0, SCALE, False, True, -1, 0,
            0.0, False, None, rng,
        )  # fmt: skip
    assert lse.shape == (4, 37) and softmax_d.shape == (4, 37 + 128 * 2)
    for b in range(2):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        truth, same = truths(q[rows][None], k[keys][None], v[keys][None], dout[rows][None], True, (-1, -1))
        got = {"out": out[rows][None], "lse": lse[:, rows][None], "dq": dq[rows][None], "dk": dk[keys][None],
               "dv": dv[keys][None]}  # fmt: skip
        check(got, truth, same)


def test_what_the_stand_in_cannot_take_is_refused_by_name():
    q, k, v, _ = tensors((1, 8, 2, 16), (1, 8, 2, 16))
    with pytest.raises(NotImplementedError, match="gen must be None"):
        extension.fwd(q, k, v, None, None, 0.0, SCALE, False, -1, -1, 0.0, False, torch.Generator())
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        extension.varlen_fwd(q[0], k[0], v[0], None, cu, cu, cu[1:], None, None, None, 8, 8, 0.0, SCALE, False,
                             False, -1, -1, 0.0, False, None)  # fmt: skip
    from flash_recipe.flash_attn import flash_attn_interface

    assert flash_attn_interface.flash_attn_gpu is extension
    assert not hasattr(flash_attn_interface, "flash_attn_cuda")  # xformers asks for it first


XFORMERS_CHECK = """
import json, torch, flash_recipe
flash_recipe.install_as_flash_attn()
flash_recipe.install_as_flash_attn_3()
flash_recipe.install_as_sageattention()
import xformers.ops
from xformers.ops.fmha import flash
from diffusers import FluxTransformer2DModel
from flash_recipe.flash_attn import extension
print(json.dumps({"cuda": flash._flash_attn_cuda is extension, "version": flash.FLASH_VERSION,
                  "fw": flash.FwOp.NAME, "flux": FluxTransformer2DModel.__name__}))
"""


@pytest.mark.skipif(not REQUIRED, reason="xformers is not installed here (nox -s diffusers installs it)")
def test_xformers_and_diffusers_import_with_the_stand_in_active():
    import json

    proc = subprocess.run([sys.executable, "-c", XFORMERS_CHECK], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"cuda": True, "version": "2.8.3", "fw": "fa2F@2.8.3", "flux": "FluxTransformer2DModel"}


def xformers_operator_bodies() -> None:
    """xformers' ``flash_fwd`` and ``flash_bwd`` bodies, with the arguments its operators pass, on
    the stand-in's extension, by the rule (run in a process whose first import of xformers comes
    after the stand-in: xformers reads ``flash_attn`` when ``xformers.ops`` first imports)."""
    flash_recipe.install_as_flash_attn()
    from xformers.ops.fmha import flash

    assert flash._flash_attn_cuda is extension
    forward, backward = flash._flash_fwd._init_fn, flash._flash_bwd._init_fn
    q, k, v, dout = tensors((2, 29, 4, 32), (2, 29, 2, 32), seed=2)
    truth, same = truths(q, k, v, dout, True, (-1, -1))
    out, lse, rng = forward(q, k, v, None, None, None, 29, 29, 0.0, SCALE, True, -1, 0, False, None)
    dq, dk, dv = backward(False, dout, q, k, v, out, lse, None, None, 29, 29, 0.0, SCALE, True, -1, 0, rng)
    check({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, truth, same)


@pytest.mark.skipif(not REQUIRED, reason="xformers is not installed here (nox -s diffusers installs it)")
def test_xformers_flash_operator_bodies_run_on_the_stand_in():
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_xformers; test_xformers.xformers_operator_bodies()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
