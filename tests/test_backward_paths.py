"""The backward's two paths: one pass over the keys with dQ added by atomics (the default), and the
three deterministic kernels (``deterministic=True``, and fp32 with its own lse).

Both paths' accuracy by the rule is in test_kernels.py (``verify.check_case`` checks the default
path beside the deterministic one); here which kernels each call launches, and that they agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flash_recipe
from devtools import backward_paths
from flash_recipe.ops import backward, choose, configs, limits

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")


def _rand(*shape, dtype=torch.float16, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.fixture
def launches(monkeypatch):
    """The backward kernels each call launches, in order: ``"dq"``, ``"dkdv"`` or ``"dkdv+dq"`` (the
    dK/dV kernel adding dQ with atomics)."""
    seen: list = []
    for name, kernel in (("dq", backward.attn_bwd_dq_kernel), ("dkdv", backward.attn_bwd_dkdv_kernel)):
        original = kernel.fn.run

        def run(*args, _name=name, _original=original, **kwargs):
            seen.append(_name + ("+dq" if kwargs.get("ATOMIC_DQ") else ""))
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel.fn, "run", run)
    return seen


def _grads(q, k, v, dout, **options):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with flash_recipe.use_backend("triton"):
        out = flash_recipe.flash_attn_func(*leaves, **options)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize(
    "dtype, deterministic, expected",
    [
        (torch.float16, False, ["dkdv+dq"]),
        (torch.float16, True, ["dq", "dkdv"]),
        (torch.float32, False, ["dq", "dkdv"]),  # fp32 renormalises P by dQ's row sums: dQ first
        (torch.float32, True, ["dq", "dkdv"]),
    ],
    ids=["fp16-default", "fp16-deterministic", "fp32-default", "fp32-deterministic"],
)
def test_each_path_launches_its_kernels(dtype, deterministic, expected, launches, device):
    q, dout = (_rand(2, 40, 4, 32, dtype=dtype, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(2, 50, 2, 32, dtype=dtype, device=device, seed=s) for s in (3, 4))
    _grads(q, k, v, dout, causal=True, deterministic=deterministic)
    if expected == ["dkdv+dq"] and choose.backward_path(q.device, 32, 2) != "one_pass":
        expected = ["dq", "dkdv"]  # a GPU whose family (or tuned file) runs the three kernels there
    assert launches == expected


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True),
        dict(window_size=(7, 3), softcap=4.0),
        dict(dropout_p=0.25),
        dict(causal=True, learnable_sink="sinks"),
    ],
    ids=["causal", "window-softcap", "dropout", "sinks"],
)
def test_one_pass_agrees_with_the_deterministic_path(options, device, nan_outputs):
    """GQA with ragged lengths (a key block past the last key, query rows past the last query): the
    two paths' gradients differ only by the rounding of the order dQ is summed in."""
    q, dout = (_rand(2, 45, 6, 40, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(2, 37, 2, 40, device=device, seed=s) for s in (3, 4))
    if options.get("learnable_sink"):
        options = {**options, "learnable_sink": torch.linspace(-1.0, 1.0, 6, device=device)}
    results = []
    for deterministic in (False, True):
        torch.manual_seed(0)  # the same dropout mask
        results.append(_grads(q, k, v, dout, deterministic=deterministic, **options))
    (dq, dk, dv), (dq_det, dk_det, dv_det) = results
    assert torch.equal(dk, dk_det) and torch.equal(dv, dv_det)  # the same kernel computes them
    scale = dq_det.abs().max().item()
    assert 0 < (dq.float() - dq_det.float()).abs().max().item() <= 2e-3 * scale or torch.equal(dq, dq_det)


def test_deterministic_path_is_bit_identical_from_run_to_run(device):
    q, dout = (_rand(1, 64, 4, 64, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(1, 96, 4, 64, device=device, seed=s) for s in (3, 4))
    first = _grads(q, k, v, dout, causal=True, deterministic=True)
    again = _grads(q, k, v, dout, causal=True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_stand_in_backward_takes_the_deterministic_flag(launches, device):
    """flash-attn's internal ``_flash_attn_backward`` (ring-flash-attn calls it) passes its
    ``deterministic`` argument through."""
    from flash_recipe.flash_attn import flash_attn_interface as fai

    q, k, v, dout = (_rand(1, 32, 2, 16, device=device, seed=s) for s in range(4))
    with flash_recipe.use_backend("triton"):
        out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
        for deterministic in (True, False):
            launches.clear()
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            fai._flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, deterministic, rng_state
            )
            one_pass = not deterministic and choose.backward_path(q.device, 16, 2) == "one_pass"
            assert launches == (["dkdv+dq"] if one_pass else ["dq", "dkdv"])


@pytest.mark.parametrize(
    "target, head_dim, release, expected",
    [
        ("sm90", 128, (3, 2), False),  # spilled (compile check's --call one_pass under each release)
        ("sm90", 128, (3, 3), False),
        ("sm90", 128, (3, 4), True),
        ("sm90", 128, (3, 6), False),
        ("sm90", 128, (3, 9), True),
        ("sm90", 128, (3, 10), True),  # newer than every release measured
        ("sm90", 64, (3, 2), True),
        ("sm80", 128, (3, 2), True),
        ("sm100", 128, (3, 2), False),  # 3.2's ptxas has no sm100
        ("sm100", 128, (3, 3), True),
        ("sm100", 128, (3, 6), True),
        ("interpreter", 128, (3, 2), True),
    ],
)
def test_one_pass_where_the_installed_triton_fits_its_tile(monkeypatch, target, head_dim, release, expected):
    from flash_recipe.ops import targets

    monkeypatch.setattr(targets, "triton_release", lambda: release)
    monkeypatch.setattr(targets, "target_of", lambda device: target)
    assert choose.one_pass_fits(torch.device("cpu"), head_dim) is expected


def test_the_three_kernels_run_where_the_one_pass_tile_does_not_fit(monkeypatch, launches, device):
    monkeypatch.setattr(choose, "one_pass_fits", lambda device, head_dim: False)
    q, dout = (_rand(1, 40, 4, 32, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(1, 50, 2, 32, device=device, seed=s) for s in (3, 4))
    _grads(q, k, v, dout, causal=True)
    assert launches == ["dq", "dkdv"]


@pytest.mark.parametrize("head_dim, transposed", [(32, False), (40, True)])
def test_dq_is_transposed_where_the_query_tile_has_fewer_rows_than_the_fast_unit_takes(
    head_dim, transposed, monkeypatch, device
):
    """The one-pass dQ product is ``K^T dS^T`` (its M the head dim) where the query tile has fewer
    rows than the family's fast matrix instruction takes (``configs.MMA_MIN_ROWS``: 64 on Hopper
    and Blackwell, and under the interpreter, whose tile has 32) and the head dim's bucket has as
    many; the direct ``dS K`` below. Both agree with the deterministic path (the test above, at
    head dim 40, runs the transposed product; test_kernels.py's cases run both)."""
    flags = []
    original = backward.attn_bwd_dkdv_kernel.fn.run

    def run(*args, **kwargs):
        flags.append(kwargs["DQ_TRANSPOSED"])
        return original(*args, **kwargs)

    monkeypatch.setattr(backward.attn_bwd_dkdv_kernel.fn, "run", run)
    from flash_recipe.ops import configs, targets

    q, dout = (_rand(1, 40, 2, head_dim, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(1, 50, 2, head_dim, device=device, seed=s) for s in (3, 4))
    tile = choose.launch_config(q.device, "bwd_onepass", head_dim, q.element_size())
    least = configs.MMA_MIN_ROWS.get(configs.arch_family(targets.target_of(q.device)), 1)
    expected = tile.block_m < least <= configs.head_dim_bucket(head_dim)
    if q.device.type == "cpu":
        assert expected is transposed  # the interpreter covers both products
    with choose.taking_path("one_pass"):
        one_pass = _grads(q, k, v, dout, causal=True)
    assert flags == [expected]
    three = _grads(q, k, v, dout, causal=True, deterministic=True)
    assert flags == [expected, False]  # the deterministic dK/dV kernel adds no dQ
    assert torch.equal(one_pass[1], three[1]) and torch.equal(one_pass[2], three[2])
    scale = three[0].abs().max().item()
    assert (one_pass[0].float() - three[0].float()).abs().max().item() <= 2e-3 * scale


def test_each_familys_default_backward_is_the_documented_path_with_fewer_instructions():
    """docs/performance.md's table ("The backward path per family", printed by
    ``devtools.backward_paths``) covers every NVIDIA family, every AMD target and every
    head-dim bucket, each
    row's ``fewer`` is the path with fewer warp-instructions per element (MHA and GQA summed), and
    ``configs.BACKWARD_PATHS`` runs it, but where it spills (``backward_paths.SPILLING``: then the
    other) or a GPU measured a path faster (``configs.MEASURED_BACKWARD_PATHS``: then that one);
    each row names which of the three chose it. tests/test_compile.py checks rows of it against a
    compile."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    table = backward_paths.read_markdown(text)
    assert [(row["target"], row["head_dim"]) for row in table] == [
        (target, bucket) for target in backward_paths.TARGETS for bucket in limits.HEAD_DIM_BUCKETS
    ]
    assert backward_paths.markdown(table) in text  # the table reads back as it was printed
    for row in table:
        sums = {path: sum(row[path]) for path in backward_paths.PATH_KERNELS}
        assert row["fewer"] == min(sums, key=sums.__getitem__), row
        assert row["default"] == configs.backward_path(row["target"], row["head_dim"]), row
        measured = configs.MEASURED_BACKWARD_PATHS.get((row["target"], row["head_dim"]))
        if measured is not None:  # a GPU's measurement wins over the counts
            assert (row["source"], row["default"]) == ("GPU", measured[0]), row
        elif (row["target"], row["head_dim"]) in backward_paths.SPILLING:  # the fewer spills: the other
            assert (row["source"], row["default"]) == (
                "spills",
                next(path for path in backward_paths.PATH_KERNELS if path != row["fewer"]),
            ), row
        else:
            assert (row["source"], row["default"]) == ("instructions", row["fewer"]), row
    assert {key for key in configs.MEASURED_BACKWARD_PATHS} <= {(r["target"], r["head_dim"]) for r in table}
    for target, family in (("sm89", "sm86"), ("sm121", "sm120"), ("gfx942", "amd"), ("gfx940", "amd")):
        assert target not in configs.BACKWARD_PATHS  # the family's row
        assert configs.BACKWARD_PATHS[configs.arch_family(target)] is configs.BACKWARD_PATHS[family]
