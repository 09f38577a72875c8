"""diffusers 0.42 on flash_recipe: its ``flash`` and ``flash_varlen`` attention backends (which import
flash-attn 2) served by the stand-in (``install_as_flash_attn()``), with a small Flux transformer
built from a config with random weights (nothing from a hub).

diffusers decides at import time whether flash-attn is usable (``importlib.metadata``, version
>= 2.6.3), so the stand-in is installed before diffusers is imported, as a user would do
(``docs/use-from.md``). diffusers needs fp16 or bf16 for these backends. On a CPU fp16 runs
flash_recipe's Triton kernels through the interpreter (the test counts their launches); bf16 runs
flash_recipe's torch fallback, since the interpreter computes bf16 dot products wrongly.

The comparison: the model's output and the gradients of its two inputs, forward and backward, on
each backend against the same model in float64 on ``native`` (torch SDPA); the error may be at most
2x (output) and 3x (gradients) the error of ``native`` in the same dtype, plus 1e-5: the accuracy
rule, applied to the whole model. diffusers' own context parallelism (ring and Ulysses) on the
``flash`` backend runs on 2 gloo processes (``ring_worker.diffusers_client``); the one mock there
is an accelerator count of 1, since diffusers 0.42.1 divides by ``torch.accelerator.device_count()``
(0 on this machine) when it places the ranks. The test lives in its own environment:
``nox -s diffusers`` (``FLASH_RECIPE_REQUIRE_DIFFUSERS=1``); elsewhere it is skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("diffusers") is None:
    if os.environ.get("FLASH_RECIPE_REQUIRE_DIFFUSERS") == "1":
        raise RuntimeError("FLASH_RECIPE_REQUIRE_DIFFUSERS=1 but diffusers is not installed")
    pytest.skip("diffusers runs in its own environment: nox -s diffusers", allow_module_level=True)

# diffusers_model installs the stand-ins, then imports diffusers.
from diffusers_model import errors_and_bounds, flux_model, run_model  # noqa: E402
from multiprocess import assert_within_bounds, run_ranks  # noqa: E402

import flash_recipe  # noqa: E402


def test_flash_attn_is_seen_as_installed():
    from diffusers.models import attention_dispatch

    assert attention_dispatch._CAN_USE_FLASH_ATTN
    assert attention_dispatch.flash_attn_func is flash_recipe.flash_attn.flash_attn_func


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["flash", "flash_varlen"])
def test_backend_matches_native_by_the_rule(backend, dtype, monkeypatch):
    from flash_recipe.ops import backward, forward

    launches = []
    for kernel in (forward.attn_fwd_kernel.fn, backward.attn_bwd_dkdv_kernel.fn):  # both backward paths launch dK/dV
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **k: launches.append(1) or _run(*a, **k))
    model = flux_model()
    truth = run_model(model, "native", torch.float64)
    same = run_model(model, "native", dtype)
    got = run_model(model, backend, dtype)
    if dtype == torch.float16:  # the Triton kernels ran: one forward and one backward per attention
        assert len(launches) == 4
    case = dict(backend=backend, dtype=str(dtype))
    assert_within_bounds([errors_and_bounds(got, truth, same)], [case])


def _parallel_case(parallel: str, dtype: str) -> dict:
    return dict(kind="diffusers", parallel=parallel, dtype=dtype)


def test_context_parallel_on_two_ranks():
    """diffusers' own context parallelism (``enable_parallelism``) on the ``flash`` backend, the
    one of the two that supports it, over 2 gloo processes: ring (diffusers gathers the keys and
    values and merges the partial outputs by their log-sum-exp, re-driving the stand-in's
    ``_wrapped_flash_attn_forward/_backward`` per chunk) and Ulysses (all-to-all over heads).
    Each rank's gathered output and the summed input gradients against the single-process model
    in float64, by the rule (``ring_worker.diffusers_client``)."""
    cases = [_parallel_case(p, d) for p in ("ring", "ulysses") for d in ("float16", "bfloat16")]
    results = run_ranks(2, {"cases": cases}, timeout=420, env={"TRITON_INTERPRET": "1"})
    assert_within_bounds(results, cases)


def test_context_parallel_comparison_fails_a_wrong_lse():
    """The stand-in's forward returning its log-sum-exp shifted by log 2 (which diffusers' ring
    saves for the backward, where P = exp(S - lse) then halves): the comparison must fail."""
    case = dict(_parallel_case("ring", "float16"), shift_lse=True)
    results = run_ranks(2, {"cases": [case]}, timeout=420, env={"TRITON_INTERPRET": "1"})
    with pytest.raises(AssertionError, match="error"):
        assert_within_bounds(results, [case])
