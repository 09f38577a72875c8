"""flash-attn 2.8.3's internal functions and ``install_as_flash_attn()`` (flash_recipe.flash_attn, flash_recipe.alias).

Upstream's argument lists below are facts of ``flash_attn/flash_attn_interface.py`` at v2.8.3:
libraries fill the arguments by name through ``inspect.getfullargspec``, so names, order and
defaults must match exactly.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import flash_recipe
from flash_recipe.flash_attn import flash_attn_interface as fai
from flash_recipe.flash_attn.bert_padding import index_first_axis, index_put_first_axis
from flash_recipe.flash_attn.layers.rotary import apply_rotary_emb
from flash_recipe.reference import attention_reference, rotary_reference

SCORE = ["dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes"]
VARLEN = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
UPSTREAM = {
    "_flash_attn_forward": (["q", "k", "v", *SCORE, "return_softmax"], None),
    "_flash_attn_varlen_forward": (
        ["q", "k", "v", *VARLEN, *SCORE, "return_softmax", "block_table", "leftpad_k", "seqused_k"],
        (-1, -1, 0.0, None, False, None, None, None),
    ),
    "_flash_attn_backward": (
        ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", *SCORE, "deterministic", "rng_state"],
        (None,),
    ),
    "_flash_attn_varlen_backward": (
        ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", *VARLEN, *SCORE, "deterministic", "rng_state"],
        (None,),
    ),
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_internal_functions_have_upstreams_arguments(name):
    args, defaults = UPSTREAM[name]
    for fn in (getattr(fai, name), getattr(fai, "_wrapped" + name)):
        spec = inspect.getfullargspec(fn)
        assert inspect.isfunction(fn)
        assert spec.args == args and spec.defaults == defaults
        assert spec.varargs is None and spec.varkw is None and not spec.kwonlyargs


def _tensors(batch, seqlen_q, seqlen_k, nheads, nheads_k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, 16, generator=gen).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, nheads_k, 16, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(batch, seqlen_q, nheads, 16, generator=gen).to(dtype)
    return q, k, v, dout


def _reference_grads(q, k, v, dout, **options):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, **options)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


def _max(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dense_forward_and_backward_in_place(backend):
    """Return tuple and layouts as upstream's; the backward writes into strided views of the
    caller's buffers (as ring-flash-attn passes them) and leaves the rest alone."""
    q, k, v, dout = _tensors(2, 9, 13, 4, 2)
    options = dict(softmax_scale=0.3, causal=True, window=(5, -1), softcap=4.0)
    out_ref, lse_ref, *grads_ref = _reference_grads(q, k, v, dout, **options)
    with flash_recipe.use_backend(backend):
        out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, 0.3, True, 5, -1, 4.0, None, False)
        assert out.shape == q.shape and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
        assert s_dmask.shape == (0,) and rng_state.shape == (2,) and rng_state.dtype == torch.int64
        assert _max(out, out_ref) <= 1e-5 and _max(lse, lse_ref) <= 1e-5
        dq_buffer = torch.full((2, 10, 4, 16), 7.0)
        dkv_buffer = torch.full((2, 13, 4, 16), 7.0)  # dk in heads 0-1, dv in heads 2-3
        dq, dk, dv = dq_buffer[:, 1:], dkv_buffer[:, :, :2], dkv_buffer[:, :, 2:]
        softmax_d = fai._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.3, True, 5, -1, 4.0, None, False
        )
    for grad, expected in zip((dq, dk, dv), grads_ref):
        assert _max(grad, expected) <= 1e-5
    assert (dq_buffer[:, 0] == 7.0).all()
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    assert _max(softmax_d[..., :9], (dout * out).sum(-1).transpose(1, 2)) <= 1e-5
    assert (softmax_d[..., 9:] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_layouts(backend):
    seqlens = [5, 0, 11]
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(16, 4, 16, generator=gen) for _ in range(4))
    with flash_recipe.use_backend(backend):
        out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu, cu, 11, 11, 0.0, 0.25, True)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        softmax_d = fai._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu, cu, 11, 11, 0.0, 0.25, True, -1, -1, 0.0, None, False
        )
    assert lse.shape == (4, 16) and softmax_d.shape == (4, 16 + 128 * 3)
    delta = (dout * out).sum(-1).t()  # (H, total)
    for b, (start, n) in enumerate(zip([0, 5, 5], seqlens)):
        part = [t[start : start + n].unsqueeze(0) for t in (q, k, v, dout)]
        out_ref, lse_ref, *grads = _reference_grads(*part, softmax_scale=0.25, causal=True)
        assert _max(out[start : start + n], out_ref[0]) <= 1e-5 if n else True
        assert _max(lse[:, start : start + n], lse_ref[0]) <= 1e-5 if n else True
        for grad, expected in zip((dq, dk, dv), grads):
            assert _max(grad[start : start + n], expected[0]) <= 1e-5 if n else True
        # upstream's layout: sequence b starts at column cu_seqlens_q[b] + 128 * b
        assert (
            _max(softmax_d[:, start + 128 * b : start + 128 * b + n], delta[:, start : start + n]) <= 1e-5
            if n
            else True
        )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_of_one_block_of_a_larger_attention(backend):
    """With the out and lse of a larger attention (ring attention's merged result), the backward of
    each key block gives that block's share: the shares add up to the whole gradient. The causal
    block has a row that sees one key, where the gradient is not 0 (the kernels' exact-0 shortcut
    for such rows holds only for an attention's own out and lse)."""
    q, k, v, dout = _tensors(1, 16, 16, 2, 1, seed=3)
    _, extra_k, extra_v, _ = _tensors(1, 16, 8, 2, 1, seed=4)
    visible = torch.cat([torch.ones(16, 8, dtype=torch.bool), torch.ones(16, 16, dtype=torch.bool).tril()], 1)
    out, lse, dq_all, dk_all, dv_all = _reference_grads(
        q, torch.cat([extra_k, k], 1), torch.cat([extra_v, v], 1), dout, softmax_scale=0.25, attn_mask=visible
    )
    out = out.float()
    dq_sum = torch.zeros_like(q)
    for block_k, block_v, causal, rows in ((extra_k, extra_v, False, slice(0, 8)), (k, v, True, slice(8, 24))):
        dq, dk, dv = (torch.empty_like(t) for t in (q, block_k, block_v))
        with flash_recipe.use_backend(backend):
            fai._flash_attn_backward(
                dout, q, block_k, block_v, out, lse, dq, dk, dv, 0.0, 0.25, causal, -1, -1, 0.0, None, False
            )
        dq_sum += dq
        assert _max(dk, dk_all[:, rows]) <= 1e-5 and _max(dv, dv_all[:, rows]) <= 1e-5
    assert _max(dq_sum, dq_all) <= 1e-5


def test_dropout_backward_regenerates_the_mask():
    """triton: the backward replays the forward's dropout mask from rng_state (checked against the
    kernels' own custom ops with that seed; the backward as flash-attn's, whose out and lse may be
    a larger attention's: ``own_lse=False``); S_dmask is negative where dropped."""
    from flash_recipe.ops.attention import attention, attn_bwd, flatten
    from flash_recipe.ops.options import ScoreOptions

    q, k, v, dout = _tensors(1, 24, 24, 2, 2, seed=5)
    with flash_recipe.use_backend("triton"):
        out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.3, 0.25, False, -1, -1, 0.0, None, True)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        fai._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.25, False, -1, -1, 0.0, None, False, rng_state
        )
    assert s_dmask.shape == (1, 2, 128, 128) and (s_dmask[:, :, :24, :24] < 0).any()
    options = ScoreOptions(
        softmax_scale=0.25,
        diag_offset=0,
        window_left=-1,
        window_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        dropout_p=0.3,
        seed=rng_state[:1],
    )
    expected_out, expected_lse = attention(q, k, v, options)
    expected = attn_bwd(dout, q, k, v, expected_out, expected_lse, *flatten(options, None), False, False)
    assert _max(out, expected_out) == 0.0
    for grad, want in zip((dq, dk, dv), expected):
        assert _max(grad, want) == 0.0


def test_varlen_dropout_runs_and_replays_the_mask():
    """Varlen with dropout on the triton backend: the backward regenerates the forward's mask (the
    same gradients as the kernels' custom ops with that seed, ``own_lse=False`` as above)."""
    from flash_recipe.ops.attention import attention, attn_bwd, flatten
    from flash_recipe.ops.options import ScoreOptions, Varlen

    gen = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(20, 2, 16, generator=gen) for _ in range(4))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with flash_recipe.use_backend("triton"):
        out, lse, s_dmask, rng_state = fai._flash_attn_varlen_forward(q, k, v, cu, cu, 13, 13, 0.3, 0.25, True)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        fai._flash_attn_varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu, cu, 13, 13, 0.3, 0.25, True, -1, -1, 0.0, None, False, rng_state
        )
    assert s_dmask.shape == (0,)
    options = ScoreOptions(
        softmax_scale=0.25,
        diag_offset=0,
        window_left=-1,
        window_right=0,
        softcap=0.0,
        alibi_slopes=None,
        dropout_p=0.3,
        seed=rng_state[:1],
    )
    varlen = Varlen(cu, cu, 13, 13)
    expected, expected_lse = attention(q, k, v, options, varlen)
    grads = attn_bwd(dout, q, k, v, expected, expected_lse, *flatten(options, varlen), False, False)
    assert _max(out, expected) == 0.0
    for grad, want in zip((dq, dk, dv), grads):
        assert _max(grad, want) == 0.0


def test_errors_name_the_argument():
    q, k, v, dout = _tensors(1, 8, 8, 2, 2)
    with flash_recipe.use_backend("reference"), pytest.raises(NotImplementedError, match="dropout"):
        fai._flash_attn_forward(q, k, v, 0.1, 0.25, False, -1, -1, 0.0, None, False)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        fai._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, 0.0, 0.25, False, seqused_k=cu[1:])
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, False)
    with pytest.raises(ValueError, match="softmax_lse must have shape"):
        fai._flash_attn_backward(
            dout, q, k, v, out, lse[:, :1], None, None, None, 0.0, 0.25, False, -1, -1, 0.0, None, False
        )
    with pytest.raises(ValueError, match="dq must be None or a tensor of shape"):
        fai._flash_attn_backward(
            dout, q, k, v, out, lse, q[:, 1:], None, None, 0.0, 0.25, False, -1, -1, 0.0, None, False
        )
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        fai._flash_attn_backward(
            dout.half(), q, k, v, out, lse, None, None, None, 0.0, 0.25, False, -1, -1, 0.0, None, False
        )
    with pytest.raises(TypeError, match="dk must be None or a torch.Tensor"):
        fai._flash_attn_backward(dout, q, k, v, out, lse, None, [], None, 0.0, 0.25, False, -1, -1, 0.0, None, False)
    with pytest.raises(NotImplementedError, match="return_softmax"):
        fai._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, 0.0, 0.25, False, return_softmax=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, 1, -1, -1, 0.0, None, False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb(interleaved):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, 3, 16, generator=gen)
    cos, sin = torch.randn(20, 6, generator=gen), torch.randn(20, 6, generator=gen)
    offsets = torch.tensor([0, 5])
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    positions = torch.arange(7)[None, :] + offsets[:, None]
    assert torch.equal(out, rotary_reference(x, cos, sin, positions, interleaved))
    assert torch.equal(out[..., 12:], x[..., 12:])
    packed = x.reshape(14, 3, 16)[:11]  # sequences of 4 and 7 tokens
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    out = apply_rotary_emb(packed.clone(), cos, sin, interleaved, inplace=True, seqlen_offsets=3, cu_seqlens=cu)
    expected = torch.cat(
        [
            rotary_reference(packed[a:b].unsqueeze(0), cos, sin, 3 + torch.arange(b - a)[None], interleaved)[0]
            for a, b in ((0, 4), (4, 11))
        ]
    )
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="seqlen_rotary"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=14)
    with pytest.raises(TypeError, match="seqlen_offsets must be an int"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1.5)


def test_bert_padding_index_helpers():
    x = torch.arange(24.0).reshape(6, 4).requires_grad_()
    indices = torch.tensor([4, 0, 3])
    picked = index_first_axis(x, indices)
    assert torch.equal(picked, x.detach()[indices])
    placed = index_put_first_axis(picked, indices, 6)
    assert torch.equal(placed[indices], picked) and (placed[[1, 2, 5]] == 0).all()
    placed.sum().backward()
    assert x.grad[indices].eq(1).all() and x.grad[[1, 2, 5]].eq(0).all()


def _python(code: str, *paths) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (installing the stand-in changes sys.modules for good),
    with ``paths`` first on sys.path."""
    env_path = "import sys; sys.path[:0] = %r\n" % [str(p) for p in paths]
    return subprocess.run([sys.executable, "-c", env_path + textwrap.dedent(code)], capture_output=True, text=True)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_install_as_flash_attn_resolves_the_modules():
    result = _python(
        """
        import importlib.util, warnings
        warnings.simplefilter("error")
        import flash_recipe
        assert importlib.util.find_spec("flash_attn") is None
        assert flash_recipe.install_as_flash_attn() and flash_recipe.install_as_flash_attn()
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
        from flash_attn.flash_attn_interface import _flash_attn_forward, _wrapped_flash_attn_backward
        from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
        from flash_attn.layers.rotary import apply_rotary_emb
        from packaging.version import Version
        assert Version(flash_attn.__version__) >= Version("2.8.3")
        assert importlib.util.find_spec("flash_attn") is not None  # transformers probes this
        assert flash_attn_func.__wrapped__ is flash_recipe.flash_attn_func  # it also takes s_aux
        assert "stand-in" in flash_recipe.explain(*[__import__("torch").randn(1, 4, 2, 16)] * 3)["flash_attn"]
        for statement in ("import flash_attn.ops.triton.layer_norm", "from flash_attn import flash_attn_triton",
                          "from flash_attn.flash_attn_interface import flash_attn_unknown"):
            try:
                exec(statement)
            except ImportError as exc:
                print(type(exc).__name__, exc)
            else:
                raise SystemExit(statement + " did not raise")
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "does not provide the module flash_attn.ops" in lines[0]
    assert "flash_attn_triton" in lines[1]
    assert "flash_attn_unknown" in lines[2]


def _fake_flash_attn(root, body: str):
    package = root / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "2.7.4"\n')
    (package / "flash_attn_interface.py").write_text(body)
    return root


def test_a_working_flash_attn_is_not_shadowed(tmp_path):
    """A stand-in for an installed, working flash-attn package (a fake one: the real one needs a GPU)."""
    root = _fake_flash_attn(tmp_path, "def _flash_attn_forward(): return 'upstream'\n")
    result = _python(
        """
        import warnings, flash_recipe
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert flash_recipe.install_as_flash_attn() is False
        print(caught[0].message)
        from flash_attn.flash_attn_interface import _flash_attn_forward
        assert _flash_attn_forward() == "upstream"
        assert flash_recipe.install_as_flash_attn(force=True)
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_forward
        assert flash_attn.__version__ == "2.8.3" and _flash_attn_forward is not None
        """,
        root,
    )
    assert result.returncode == 0, result.stderr
    assert "flash-attn 2.7.4 is installed and imports" in result.stdout


def test_a_broken_flash_attn_is_replaced(tmp_path):
    root = _fake_flash_attn(tmp_path, "import flash_attn_2_cuda\n")  # the compiled module is missing
    result = _python(
        """
        import warnings, flash_recipe
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert flash_recipe.install_as_flash_attn() is True
        print(caught[0].message)
        import flash_attn
        assert flash_attn.__version__ == "2.8.3"
        """,
        root,
    )
    assert result.returncode == 0, result.stderr
    assert "fails to import (ModuleNotFoundError" in result.stdout


def test_return_softmax_without_dropout_gives_the_probabilities():
    q, k, v, _ = _tensors(1, 9, 13, 2, 2, seed=7)
    _, _, s_dmask, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, True)
    _, probs = attention_reference(q, k, v, 0.25, True, return_probs=True)
    assert s_dmask.shape == (1, 2, 128, 128) and s_dmask.dtype == q.dtype
    assert _max(s_dmask[:, :, :9, :13], probs) <= 1e-6 and (s_dmask[:, :, 9:] == 0).all()
