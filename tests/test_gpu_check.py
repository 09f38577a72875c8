"""The campaign's correctness step (``devtools.gpu_check`` and its cases,
``gpu_check_cases``) on the CPU.

The real step logic runs the interpreter's table (float16 and float32; bfloat16 skipped and said
so): it passes as the package stands, and it fails when a 1 % error is planted in the output or in
one gradient of the call under test. The SDPA-flash peer (used on CUDA) is checked here against
the fp64 truth through torch's CPU flash kernel, so its layout, GQA and varlen handling are right
before a GPU runs it.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch
from offline import devtool_argv

from devtools import gpu_check, gpu_check_cases
from devtools import warmup as campaign_warmup
from flash_recipe import api, decoding
from flash_recipe.ops.configs import head_dim_bucket
from flash_recipe.testing import max_error
from flash_recipe.tools import verify_kvcache, warmup

CPU = torch.device("cpu")
DTYPES = ["float16", "float32"]  # what the interpreter computes correctly


def _by_name(rows: list) -> dict:
    return {(row["case"], row["dtype"]): row for row in rows}


def test_the_gpu_table_covers_every_feature_in_head_dims_64_128_256():
    covered = {f for case in gpu_check.GPU_TABLE for f in case.features}
    wanted = {"MHA", "GQA", "MQA", "causal", "Sq!=Sk", "D64", "D128", "D256", "varlen", "KV cache", "paged"}
    assert wanted | {"append", "window", "softcap", "ALiBi", "dropout"} <= covered, covered
    assert {case.head_dim for case in gpu_check.GPU_TABLE} == {64, 128, 256}
    assert {case.kind for case in gpu_check.GPU_TABLE} == {case.kind for case in gpu_check.TINY_TABLE}
    assert set(gpu_check.KINDS) == {case.kind for case in gpu_check.GPU_TABLE}
    ids = [case.id for case in gpu_check.GPU_TABLE + gpu_check.TINY_TABLE]
    assert len(set(ids)) == len(ids)
    causal_sq_gt_sk = [c for c in gpu_check.GPU_TABLE if c.kind == "dense" and c.causal and c.seqlen_q > c.seqlen_k]
    assert causal_sq_gt_sk, "rows that see no key"
    assert all(c.page == 256 for c in gpu_check.GPU_TABLE if c.kind == "kvcache")  # upstream's page size


def test_rows_are_validated():
    with pytest.raises(ValueError, match="kind must be one of"):
        gpu_check.Case(1, 8, 8, 2, 2, 16, kind="sparse")
    with pytest.raises(ValueError, match=r"nheads \(3\) must be a multiple of nheads_k \(2\)"):
        gpu_check.Case(1, 8, 8, 3, 2, 16)
    with pytest.raises(ValueError, match="varlen needs 2 lengths each side"):
        gpu_check.Case(2, 8, 8, 2, 2, 16, kind="varlen", lens_q=(8,), lens_k=(8, 8))


def test_the_step_passes_on_the_interpreters_table_as_the_campaign_runs_it(tmp_path):
    """The campaign's own command, in a subprocess on the CPU through the interpreter."""
    from devtools import campaign

    result = tmp_path / "check.json"
    argv = {s.name: s for s in campaign.build_plan()}["check"].command(str(tmp_path))
    assert argv[1:5] == ["-m", "devtools.gpu_check", "--json", str(result)]
    # The campaign's step environment (the checkout on PYTHONPATH), on the CPU through the interpreter.
    env = {**campaign.step_environment(tmp_path), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*argv, "--fuzz-cases", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(result.read_text())
    assert doc["passed"] and doc["complete"] and doc["interpreter"] and doc["dtypes"] == DTYPES
    assert len(doc["rows"]) == 2 * len(gpu_check.TINY_TABLE)
    assert {row["kind"] for row in doc["rows"]} == set(gpu_check.KINDS)
    for row in doc["rows"]:
        assert row["passed"] and set(row["errors"]) == set(row["bounds"])
        if row["kind"] != "kvcache":
            assert {"out", "dq", "dk", "dv"} <= set(row["errors"]) and row["peer"] == "torch_math"
    assert all("kept" in row["errors"] for row in doc["rows"] if row["kind"] == "dropout")
    assert doc["fuzz"]["cases"] == doc["fuzz"]["passed"] == 3 and not doc["fuzz"]["failed"]
    assert "bfloat16" in doc["skipped_dtypes"] and "interpreter" in doc["skipped_dtypes"]["bfloat16"]
    assert doc["summary"].startswith(f"PASSED: {len(doc['rows'])} of {len(doc['rows'])} table checks")
    assert "bfloat16 skipped: the Triton interpreter" in doc["summary"] and doc["summary"] in done.stdout


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by 1.01 (a planted 1 % error in one gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def _planted(real, where: str):
    """``real`` with a 1 % error in its output (``out``) or in the gradient of one input."""

    def call(q, k, v, *args, **kwargs):
        inputs = {"dq": q, "dk": k, "dv": v}
        if where in inputs:
            inputs[where] = _ScaleGrad.apply(inputs[where])
        result = real(inputs["dq"], inputs["dk"], inputs["dv"], *args, **kwargs)
        if where == "out" and isinstance(result, torch.Tensor):
            return result + 0.01 * result.detach()  # the output only: its gradients stay exact
        return result

    return call


@pytest.mark.parametrize("where", ["out", "dq", "dk", "dv"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_planted_1_percent_error_fails_the_step(where, dtype, monkeypatch, device):
    """Every dense, varlen and dropout row fails on the planted result and only on it; the run fails.
    (The same rows pass unplanted: ``test_the_step_passes_on_the_interpreters_table_as_the_campaign_runs_it``.)"""
    if device.type != "cpu":
        pytest.skip("the interpreter's table; on a GPU the campaign runs the GPU table")
    table = gpu_check.TINY_TABLE
    cases = [table[0], next(c for c in table if c.kind == "varlen"), next(c for c in table if c.kind == "dropout")]
    for name in ("flash_attn_func", "flash_attn_varlen_func"):  # the calls the check makes
        monkeypatch.setattr(gpu_check_cases, name, _planted(getattr(api, name), where))
    lines = []
    doc = gpu_check.run(tuple(cases), [dtype], device, 300, fuzz=False, progress=lines.append)
    assert not doc["passed"] and len(doc["rows"]) == len(cases)
    for row in doc["rows"]:
        failing = {name for name in row["errors"] if row["errors"][name] > row["bounds"][name]}
        assert failing == {where}, (row["case"], row["errors"], row["bounds"])
    assert all(line.startswith("FAIL") for line in lines)
    assert gpu_check.summary(doc).startswith(f"FAILED: 0 of {len(cases)} table checks")


def test_a_planted_error_in_the_kv_cache_call_fails_its_row(monkeypatch, device):
    if device.type != "cpu":
        pytest.skip("the interpreter's table")
    case = next(c for c in gpu_check.TINY_TABLE if c.kind == "kvcache")
    real = decoding.flash_attn_with_kvcache
    monkeypatch.setattr(verify_kvcache, "flash_attn_with_kvcache", lambda *a, **k: real(*a, **k) * 1.01)
    row = gpu_check.safe_check(case, torch.float16, device)
    assert not row["passed"] and row["errors"]["out"] > row["bounds"]["out"]
    assert row["errors"]["k_cache"] == row["errors"]["cache_rest"] == 0.0


def test_a_check_that_raises_is_a_failed_row(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image\nmore lines")

    monkeypatch.setattr(gpu_check_cases, "flash_attn_func", broken)
    row = gpu_check.safe_check(gpu_check.TINY_TABLE[0], torch.float16, CPU)
    assert row["passed"] is False and row["error"] == "RuntimeError: no kernel image"
    assert "FAIL" in gpu_check._line(row)


def test_dropout_is_checked_against_its_own_mask(monkeypatch, device):
    """A run whose replay draws another mask (a different seed) fails the output and gradients."""
    if device.type != "cpu":
        pytest.skip("the interpreter's table")
    case = next(c for c in gpu_check.TINY_TABLE if c.kind == "dropout")
    real = gpu_check_cases._replayed_mask

    def other_seed(case, q, k, v, options, seed):
        return real(case, q, k, v, options, seed + 1)

    monkeypatch.setattr(gpu_check_cases, "_replayed_mask", other_seed)
    row = gpu_check.check(case, torch.float32, device)
    assert not row["passed"] and row["errors"]["out"] > row["bounds"]["out"]
    assert row["errors"]["kept"] <= row["bounds"]["kept"]  # another mask keeps as many


def test_the_time_bound_cuts_the_table_and_says_what_was_not_reached():
    doc = gpu_check.run(gpu_check.TINY_TABLE, DTYPES, CPU, 1e-9, progress=lambda line: None)
    assert doc["rows"] == [] and not doc["complete"] and not doc["passed"]  # nothing checked proves nothing
    assert len(doc["not_reached"]) == 2 * len(gpu_check.TINY_TABLE) and doc["fuzz"]["cases"] == 0
    assert f"not reached in {1e-9} s: {len(doc['not_reached'])} checks" in gpu_check.summary(doc)


def test_without_cuda_or_the_interpreter_the_step_refuses(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--seconds", "5"]) == 2
    assert "TRITON_INTERPRET is unset" in capsys.readouterr().err
    assert gpu_check.main(["--seconds", "0"]) == 2


def test_sdpa_flash_is_the_peer_only_where_it_computes_the_same_attention():
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    table = {case.id: case for case in gpu_check.GPU_TABLE}
    reasons = {i: gpu_check_cases.sdpa_flash_reason(c, torch.bfloat16, cuda) for i, c in table.items()}
    peers = [i for i, why in reasons.items() if why is None]
    assert {table[i].kind for i in peers} == {"dense", "varlen"} and len(peers) >= 5
    assert all(not table[i].causal or table[i].seqlen_q == table[i].seqlen_k for i in peers)
    case = gpu_check.GPU_TABLE[0]
    assert "not on CUDA" in gpu_check_cases.sdpa_flash_reason(case, torch.bfloat16, CPU)
    assert "fp16/bf16, not float32" in gpu_check_cases.sdpa_flash_reason(case, torch.float32, cuda)
    assert "top-left" in gpu_check_cases.sdpa_flash_reason(gpu_check.GPU_TABLE[3], torch.float16, cuda)
    assert "no window" in gpu_check_cases.sdpa_flash_reason(gpu_check.GPU_TABLE[6], torch.float16, cuda)


@pytest.mark.parametrize(
    "case",
    [
        gpu_check.TINY_TABLE[0],
        gpu_check.TINY_TABLE[1],
        gpu_check.Case(3, 17, 12, 4, 2, 32, kind="varlen", lens_q=(5, 17, 1), lens_k=(9, 3, 12)),
        gpu_check.Case(2, 17, 17, 2, 1, 16, kind="varlen", causal=True, lens_q=(17, 4), lens_k=(17, 4)),
    ],
    ids=["dense-causal", "dense-gqa", "varlen-gqa", "varlen-causal-mqa"],
)
def test_the_sdpa_flash_peer_computes_the_rows_attention(case):
    """Through torch's CPU flash kernel in fp32, against the fp64 truth: output and gradients, on
    rows where it is the peer on CUDA."""
    assert gpu_check_cases.sdpa_flash_reason(case, torch.float16, torch.device("cuda")) is None
    q, k, v, dout, extra = gpu_check_cases.inputs(case, torch.float32, CPU, 0)
    options = case.options(CPU)
    peer = gpu_check_cases.grads(gpu_check_cases.sdpa_flash(case, extra), q, k, v, dout)
    truth_fn = gpu_check_cases.torch_math(case, options, extra, upcast=True)
    truth = gpu_check_cases.grads(truth_fn, *(t.double() for t in (q, k, v, dout)))
    for name, p, t in zip(("out", "dq", "dk", "dv"), peer, truth):
        assert p.shape == t.shape and max_error(p, t) < 1e-4, name


def test_the_fuzz_is_seeded_and_stays_in_the_tables_head_dim_buckets():
    templates = [c for c in gpu_check.GPU_TABLE if c.kind in ("dense", "varlen")]
    first = [gpu_check.fuzz_case(random.Random(7), templates, 512) for _ in range(1)]
    rng_a, rng_b = random.Random(7), random.Random(7)
    drawn = [gpu_check.fuzz_case(rng_a, templates, 512) for _ in range(200)]
    assert drawn == [gpu_check.fuzz_case(rng_b, templates, 512) for _ in range(200)] and drawn[0] == first[0]
    assert {head_dim_bucket(c.head_dim) for c in drawn} == {64, 128, 256}
    assert {c.kind for c in drawn} == {"dense", "varlen"} and len({c.id for c in drawn}) > 150
    assert all(max(c.seqlen_q, c.seqlen_k) <= 512 for c in drawn)


def test_the_fuzz_runs_only_variants_the_table_launched(monkeypatch):
    """Each fuzz case it checks launches only variants of the table's; the others are redrawn."""
    checked = []
    real = gpu_check.safe_check

    def spy(case, dtype, device, seed=0):
        checked.append((case, dtype))
        return real(case, dtype, device, seed)

    table = gpu_check.TINY_TABLE[:3]
    doc = gpu_check.run(table, ["float16"], CPU, 300, fuzz=False, progress=lambda line: None)
    monkeypatch.setattr(gpu_check, "safe_check", spy)
    known = set().union(*(gpu_check.variant_keys(c, torch.float16, CPU) for c in table))
    gpu_check._fuzz(doc, table, table, ["float16"], CPU, float("inf"), 3, lambda: None, lambda line: None, 4)
    assert doc["fuzz"]["cases"] == 4 == len(checked) and doc["fuzz"]["redrawn"] > 0
    assert all(gpu_check.variant_keys(case, dtype, CPU) <= known for case, dtype in checked)


def test_warmup_lists_exactly_what_the_step_launches():
    """The interpreter's table, fuzz off: its launches (recorded) are ``warmup --for check``'s list."""
    with warmup.recorded_launches() as launches:
        gpu_check.run(gpu_check.TINY_TABLE, DTYPES, CPU, 300, fuzz=False, progress=lambda line: None)
    truth = {warmup.to_variant(fn, args, kwargs, "truth").key for fn, args, kwargs in launches}
    listed, skipped = warmup.variants(campaign_warmup.check_calls("small", None), CPU)
    assert not skipped and truth == {v.key for v in listed}
    gpu_calls = campaign_warmup.check_calls("full", None)
    assert len(gpu_calls) == 2 * len(gpu_check.GPU_TABLE) and {c.dtype for c in gpu_calls} == {"bfloat16", "float16"}


def test_the_module_runs_as_a_script_and_documents_its_options():
    done = subprocess.run(devtool_argv("gpu_check", "--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--seconds" in done.stdout and "--no-fuzz" in done.stdout
