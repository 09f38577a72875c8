"""yunchang 0.6.4 from PyPI (USP: Ulysses all-to-all over heads, ring attention over the sequence),
unchanged, on flash_recipe's stand-in for flash-attn (``install_as_flash_attn()``), on 2 and 4
gloo processes on loopback.

yunchang is installed without its ``flash`` extra (which would pull flash-attn), in an environment
of its own: ``nox -s yunchang``, where this module must run (``FLASH_RECIPE_REQUIRE_YUNCHANG=1``);
elsewhere it is skipped. Each case cuts the full sequence with yunchang's own extract functions,
runs forward and backward in fp16, gathers the rows and compares them by the accuracy rule with the
fp32 reference of the whole sequence (``ring_worker.yunchang_client``). What yunchang itself cannot
do, on any hardware: its fp32 ring backward aliases its accumulators (``dq = buf.to(torch.float32)``),
its varlen rings call flash-attn's pre-2.6.3 private API, and its ring of one sends to itself, which
gloo refuses; so the cases are fp16 and every ring has two ranks.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from multiprocess import assert_within_bounds, run_ranks

# Not imported here: yunchang imports flash_attn, which only the ranks install.
if importlib.util.find_spec("yunchang") is None:
    if os.environ.get("FLASH_RECIPE_REQUIRE_YUNCHANG") == "1":
        raise RuntimeError("FLASH_RECIPE_REQUIRE_YUNCHANG=1 but yunchang is not installed")
    pytest.skip("yunchang runs in its own environment: nox -s yunchang", allow_module_level=True)


def _case(function, causal, nheads_k=4, **extra):
    return dict(
        kind="yunchang",
        function=function,
        causal=causal,
        dtype="float16",
        batch=1,
        seqlen=32,
        nheads=4,
        nheads_k=nheads_k,
        headdim=16,
        **extra,
    )


def test_ulysses_attention_on_two_ranks():
    cases = [_case("ulysses", True), _case("ulysses", False, nheads_k=2)]
    assert_within_bounds(run_ranks(2, {"cases": cases}, env={"TRITON_INTERPRET": "1"}), cases)


def test_long_context_attention_ulysses_2_by_ring_2():
    cases = [
        _case("usp", True, ring_impl="basic", ulysses=2),
        _case("usp", True, ring_impl="zigzag", ulysses=2),
        _case("usp", True, ring_impl="strip", ulysses=2),
        _case("usp", False, nheads_k=2, ring_impl="basic", ulysses=2),  # yunchang's zigzag asserts causal
    ]
    assert_within_bounds(run_ranks(4, {"cases": cases}, env={"TRITON_INTERPRET": "1"}), cases)
