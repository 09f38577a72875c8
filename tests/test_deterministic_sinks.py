"""``deterministic=True`` with attention sinks: no kernel of the three-kernel backward uses atomics,
the sinks' gradient included (the dQ kernel stores each row's sum of P dP once; the one pass adds
it per key block with atomics), so dq, dk, dv and dsink are bit-identical from run to run.

The compile test checks the TTIR of the kernels a launch compiles for sm90 (where the one pass is
the default, so the deterministic path is a choice); the interpreter tests check the gradients by
the accuracy rule. The interpreter runs one program at a time, so atomics land in the same order
there: its repeated runs agree whatever the kernels do, and the compile test is the one that sees
an atomic.
"""

from __future__ import annotations

import pytest
import torch
from offline import compile_in_subprocess

import flash_recipe
from devtools import compile_check
from flash_recipe.ops import backward
from flash_recipe.reference import attention_reference, compute_dtype
from flash_recipe.testing import FACTORS, assert_accurate

# Every kernel launch here stays inside its tensors (checked under the interpreter: tests/bounds.py).
pytestmark = pytest.mark.usefixtures("bounds_checked")

NAMES = ("dq", "dk", "dv", "dsink")


@pytest.mark.slow
def test_the_deterministic_backward_with_sinks_compiles_without_atomics():
    """The "sinks" call of the compile check (aligned, bf16, head dim 64, sm90): the deterministic
    path's kernels hold no atomic op in their TTIR and pass; the one pass holds them (dQ's and the
    sinks' adds), as does a deterministic dK/dV kernel given the sinks' buffer (planted below, the
    launches planned again), which the check fails."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe import memo_keys
        from flash_recipe.ops import backward, backward_launch
        from devtools import compile_check
        case = compile_check.Case("sinks", "bfloat16", 64, "aligned")
        for row in compile_check.check_case(case, "sm90"):
            print(json.dumps(row))
        original = backward_launch.plan

        def planted(kernel, grid, args, device):  # the dK/dV kernel adds the sinks' sums on both paths
            if kernel is backward.attn_bwd_dkdv_kernel and args["DQ_ACC"] is None:
                args = {**args, "SINK_DELTA": args["DELTA"]}
            return original(kernel, grid, args, device)

        backward_launch.plan = planted
        memo_keys.forget()  # plan the launches again
        for row in compile_check.check_case(case, "sm90"):
            print(json.dumps({**row, "planted": True}))
    """)
    found = {}
    for row in rows:
        found.setdefault((row["kernel"], row.get("planted", False)), []).append(row)
    for kernel in compile_check.DETERMINISTIC_KERNELS:
        for row in found[(kernel, False)]:
            assert row["atomic_ops"] == 0 and row["ok"], row
    assert [row["atomic_ops"] > 0 and row["ok"] for row in found[("bwd_onepass", False)]] == [True]
    (bad,) = found[("bwd_dkdv", True)]
    assert bad["atomic_ops"] > 0 and not bad["ok"]
    assert any("atomic operations in a kernel of the deterministic backward" in p for p in bad["problems"]), bad
    assert all(row["ok"] for row in found[("bwd_dq", True)])  # the planted dK/dV kernel alone fails


def _rand(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.fixture
def sink_buffers(monkeypatch):
    """Whether each backward kernel launch was given the sinks' row-sum buffer (``SINK_DELTA``) or
    the one pass's dQ workspace, as ``(kernel, has SINK_DELTA, has DQ_ACC)``."""
    seen: list = []
    for name, kernel in (("dq", backward.attn_bwd_dq_kernel), ("dkdv", backward.attn_bwd_dkdv_kernel)):
        original = kernel.fn.run

        def run(*args, _name=name, _original=original, **kwargs):
            seen.append((_name, kwargs.get("SINK_DELTA") is not None, kwargs.get("DQ_ACC") is not None))
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel.fn, "run", run)
    return seen


def _grads(q, k, v, sinks, dout, causal, backend="triton", **options) -> dict:
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    if backend == "triton":
        with flash_recipe.use_backend("triton"):
            out = flash_recipe.flash_attn_func(*leaves[:3], causal=causal, learnable_sink=leaves[3], deterministic=True)
    else:
        out, _ = attention_reference(*leaves[:3], causal=causal, sinks=leaves[3], **options)
    return dict(zip(NAMES, torch.autograd.grad(out, leaves, dout.to(out.dtype))))


def _case(*values):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, dtype = values
    mask = "causal" if causal else "full"
    name = f"B{batch}-Sq{seqlen_q}-Sk{seqlen_k}-H{nheads}-Hk{nheads_k}-D{head_dim}-{mask}"
    return pytest.param(*values, id=f"{name}-{str(dtype).removeprefix('torch.')}")


@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, dtype",
    [
        _case(2, 37, 29, 3, 3, 24, True, torch.float16),  # MHA; causal with Sq > Sk: rows that see only the sink
        _case(1, 45, 70, 4, 2, 40, False, torch.float16),  # GQA, ragged key and query blocks
        _case(1, 29, 53, 6, 2, 16, True, torch.float16),
        _case(1, 33, 47, 2, 2, 24, False, torch.float32),  # fp32 (FIX_LSE: the row sums of the renormalised P)
        _case(2, 45, 37, 4, 1, 20, True, torch.float32),  # MQA
    ],
)
def test_deterministic_backward_with_sinks_is_bit_identical_and_accurate(
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, dtype, sink_buffers, device, nan_outputs
):
    q, dout = (_rand(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device, seed=s) for s in (1, 2))
    k, v = (_rand(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device, seed=s) for s in (3, 4))
    sinks = (0.5 + torch.linspace(-1.0, 1.0, nheads)).to(device)
    first = _grads(q, k, v, sinks, dout, causal)
    # The three kernels: the dQ kernel takes the sinks' buffer, the dK/dV kernel neither it nor a workspace.
    assert sink_buffers == [("dq", True, False), ("dkdv", False, False)]
    again = _grads(q, k, v, sinks, dout, causal)
    for name in NAMES:
        assert torch.equal(first[name], again[name]), name
    high = compute_dtype(dtype, upcast=True)
    truth = _grads(*(t.to(high) for t in (q, k, v, sinks)), dout, causal, backend="reference")
    same = _grads(q, k, v, sinks.to(dtype), dout, causal, backend="reference", upcast=False)
    assert truth["dsink"].abs().max() > 0.01  # the sinks carry a gradient worth checking
    for name in NAMES:
        assert_accurate(name, first[name], truth[name], same[name], FACTORS[name])
