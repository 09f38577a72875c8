"""The one-launch backward (``ops.backward_one_launch``): dK/dV and dQ programs in one launch,
without atomics.

Its programs run the three kernels' bodies (``backward.dkdv_program`` and ``dq_program``), so
with the same tiles (the interpreter's: 32 x 32 for every kernel) its gradients are bit-identical
to the three kernels', which test_kernels.py holds to the accuracy rule; here that identity for
every score option, what it launches, that it is bit-identical from run to run, and where it is
offered. One case is also checked by the rule directly.
"""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe.ops import backward, backward_one_launch, choose, configs
from flash_recipe.reference import attention_reference
from flash_recipe.testing import FACTORS, assert_accurate

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")


def _rand(*shape, dtype=torch.float16, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.fixture
def launches(monkeypatch):
    """The backward kernels each call launches, in order."""
    seen: list = []
    kernels = (
        ("dq", backward.attn_bwd_dq_kernel),
        ("dkdv", backward.attn_bwd_dkdv_kernel),
        ("one_launch", backward_one_launch.attn_bwd_one_launch_kernel),
    )
    for name, kernel in kernels:
        original = kernel.fn.run

        def run(*args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel.fn, "run", run)
    return seen


def _grads(path, q, k, v, dout, sinks=None, varlen=None, **options):
    """dq, dk, dv (and dsink) on ``path``, through the public API on the Triton kernels."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = [sinks.clone().requires_grad_()] if sinks is not None else []
    torch.manual_seed(0)  # the same dropout mask on every path
    with flash_recipe.use_backend("triton"), choose.taking_path(path):
        if varlen is not None:
            out = flash_recipe.flash_attn_varlen_func(*leaves, *varlen, learnable_sink=(extra or [None])[0], **options)
        else:
            out = flash_recipe.flash_attn_func(*leaves, learnable_sink=(extra or [None])[0], **options)
        return torch.autograd.grad(out, leaves + extra, dout)  # the backward inside the block: its path


CASES = {
    "causal-more-queries": ((2, 45, 6, 40), (2, 37, 2, 40), dict(causal=True)),
    "causal-more-keys": ((1, 29, 4, 32), (1, 70, 4, 32), dict(causal=True)),
    "window-softcap": ((2, 45, 6, 40), (2, 37, 2, 40), dict(window_size=(7, 3), softcap=4.0)),
    "alibi": ((1, 33, 4, 16), (1, 41, 1, 16), dict(alibi_slopes="slopes", causal=True)),
    "dropout": ((1, 40, 2, 32), (1, 40, 2, 32), dict(dropout_p=0.25)),
    "sinks": ((2, 45, 6, 40), (2, 37, 2, 40), dict(causal=True, sinks="sinks")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_launch_equals_the_three_kernels_bit_for_bit(case, device, launches, nan_outputs):
    shape_q, shape_k, options = CASES[case]
    q, dout = (_rand(*shape_q, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(*shape_k, device=device, seed=s) for s in (3, 4))
    options = dict(options)
    if options.get("alibi_slopes") == "slopes":
        options["alibi_slopes"] = torch.linspace(0.1, 0.9, shape_q[2], device=device)
    sinks = torch.linspace(-1.0, 1.0, shape_q[2], device=device) if options.pop("sinks", None) else None
    three = _grads("three_kernels", q, k, v, dout, sinks=sinks, **options)
    launches.clear()
    one = _grads("one_launch", q, k, v, dout, sinks=sinks, **options)
    assert launches == ["one_launch"]
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), one, three):
        assert torch.equal(a, b), name


def test_varlen_and_strided_inputs_equal_the_three_kernels(device, nan_outputs):
    """Three packed sequences (one empty of keys), GQA, q a strided view of a wider tensor."""
    wide = _rand(60, 4, 48, device=device, seed=1)
    q = wide[..., :32]  # rows and heads strided past the head dim
    k, v = (_rand(70, 2, 32, device=device, seed=s) for s in (3, 4))
    dout = _rand(60, 4, 32, device=device, seed=2)
    cu_q = torch.tensor([0, 17, 40, 60], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 30, 30, 70], dtype=torch.int32, device=device)
    varlen = (cu_q, cu_k, 23, 40)
    one = _grads("one_launch", q, k, v, dout, varlen=varlen, causal=True)
    three = _grads("three_kernels", q, k, v, dout, varlen=varlen, causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), one, three):
        assert torch.equal(a, b), name


def test_one_launch_meets_the_rule(device):
    q, dout = (_rand(2, 45, 6, 40, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(2, 37, 2, 40, device=device, seed=s) for s in (3, 4))
    got = _grads("one_launch", q, k, v, dout, causal=True)
    results = []
    for dtype in (torch.float32, torch.float16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = attention_reference(*leaves, causal=True, upcast=False)
        results.append(torch.autograd.grad(out, leaves, dout.to(dtype)))
    truth, same = results
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_accurate(name, got[i].float(), truth[i].float(), same[i].float(), FACTORS[name])


# The tiles GPU launches take (``configs.ONE_LAUNCH`` rows of every family but the interpreter's):
# (BLOCK_M, BLOCK_N), a key block's query step over its keys, the dQ programs' key step over their rows.
GPU_TILES = sorted(
    {
        tuple(config[:2])
        for family in configs.ONE_LAUNCH_FAMILIES
        if family != "interpreter"
        for _, _, config in configs._TABLE[(family, configs.ONE_LAUNCH)]
    }
)


@pytest.mark.parametrize("tile", GPU_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_the_gpu_tiles_meet_the_rule_and_equal_the_three_kernels(tile, device, launches):
    """Causal GQA with sinks, both lengths off every block size, on each tile a GPU family's table
    gives the one launch: dQ, dK and dV by the accuracy rule, and bit-identical to the three kernels
    on the same tiles (dK/dV ``BLOCK_M x BLOCK_N``, dQ its transpose)."""
    block_m, block_n = tile
    q, dout = (_rand(1, 150, 4, 64, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(1, 139, 2, 64, device=device, seed=s) for s in (3, 4))
    sinks = torch.linspace(-1.0, 1.0, 4, device=device)
    one_launch = configs.Config(block_m, block_n, 4, 1)
    with choose.overriding(configs.ONE_LAUNCH, 64, 2, one_launch):
        got = _grads("one_launch", q, k, v, dout, sinks=sinks, causal=True)
    with (
        choose.overriding("bwd_dkdv", 64, 2, one_launch),
        choose.overriding("bwd_dq", 64, 2, configs.Config(block_n, block_m, 4, 1)),
    ):
        three = _grads("three_kernels", q, k, v, dout, sinks=sinks, causal=True)
    assert launches[0] == "one_launch" and "one_launch" not in launches[1:]
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, three):
        assert torch.equal(a, b), name
    results = []
    for dtype in (torch.float32, torch.float16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        out, _ = attention_reference(*leaves[:3], causal=True, upcast=False, sinks=leaves[3])
        results.append(torch.autograd.grad(out, leaves, dout.to(dtype)))
    truth, same = results
    for i, name in enumerate(("dq", "dk", "dv", "dsink")):
        assert_accurate(name, got[i].float(), truth[i].float(), same[i].float(), FACTORS[name])


def test_one_launch_is_bit_identical_from_run_to_run_and_deterministic_keeps_it(device, launches):
    q, dout = (_rand(1, 64, 4, 64, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(1, 96, 2, 64, device=device, seed=s) for s in (3, 4))
    first = _grads("one_launch", q, k, v, dout, causal=True)
    again = _grads("one_launch", q, k, v, dout, causal=True, deterministic=True)
    assert launches == ["one_launch", "one_launch"]  # no atomics: deterministic=True keeps the path
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_fp32_with_its_own_lse_takes_the_three_kernels(device, launches):
    """FIX_LSE needs dQ's row sums before dK/dV: one launch cannot give them."""
    q, k, v, dout = (_rand(1, 24, 2, 16, dtype=torch.float32, device=device, seed=s) for s in range(4))
    _grads("one_launch", q, k, v, dout, causal=True)
    assert launches == ["dq", "dkdv"]


def test_where_the_one_launch_backward_is_offered():
    """Its tiles are in the table for every NVIDIA family and the interpreter, fp16/bf16 up to head
    dim 128 (each family its own: sm89 takes sm86's, sm121 sm120's); AMD has none, and wherever a
    call has no row its path becomes the three kernels."""
    assert configs.has_config("sm90", configs.ONE_LAUNCH, 128, 2)
    # sm90: FlexAttention's own tile (64/128/128/64, 8 warps, 3 stages); sm100: it with 8 warps
    assert configs.get_config("sm90", configs.ONE_LAUNCH, 128, 2) == configs.Config(64, 128, 8, 3)
    assert configs.get_config("sm90", configs.ONE_LAUNCH, 64, 2) == configs.Config(64, 128, 8, 3)
    assert configs.get_config("sm100", configs.ONE_LAUNCH, 96, 2) == configs.Config(64, 128, 8, 3)
    assert configs.get_config("interpreter", configs.ONE_LAUNCH, 256, 4) == configs.Config(32, 32, 1, 1)
    assert configs.get_config("sm80", configs.ONE_LAUNCH, 64, 2) == configs.Config(32, 64, 4, 2)
    assert configs.get_config("sm89", configs.ONE_LAUNCH, 64, 2) == configs.Config(64, 64, 4, 3)
    assert configs.get_config("sm121", configs.ONE_LAUNCH, 32, 2) == configs.Config(32, 64, 4, 2)
    for target in ("sm80", "sm86", "sm89", "sm120", "sm121"):
        assert configs.get_config(target, configs.ONE_LAUNCH, 128, 2) == configs.Config(64, 64, 8, 2)
    assert not configs.has_config("sm90", configs.ONE_LAUNCH, 256, 2)
    assert not configs.has_config("sm90", configs.ONE_LAUNCH, 64, 4)
    assert not configs.has_config("sm80", configs.ONE_LAUNCH, 64, 4)
    assert not configs.has_config("gfx942", configs.ONE_LAUNCH, 64, 2)
    with pytest.raises(ValueError, match="no launch configuration"):
        configs.get_config("sm86", configs.ONE_LAUNCH, 256, 2)
    assert all(path != "one_launch" for paths in configs.BACKWARD_PATHS.values() for path in paths.values())
