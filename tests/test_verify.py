"""``flash-recipe verify``: the report, the exit status and the fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from flash_recipe.tools import cli, verify


def _run(capsys, *args):
    status = cli.main(["verify", *args])
    return status, capsys.readouterr().out


def test_verify_json_report_and_stable_fingerprint(capsys, device):
    args = ("--json", "--grid", "small", "--dtype", "float32", "--backend", "triton", "--backend", "reference")
    status, out = _run(capsys, *args)
    report = json.loads(out)
    assert status == 0 and report["passed"]
    assert report["backends"] == ["triton", "reference"]
    assert {"flash_recipe", "torch", "triton"} <= set(report["versions"])
    assert report["install"]["name"] == "flash-recipe"
    assert len(report["cases"]) == 2 * len(verify.SMALL_GRID)
    for row in report["cases"]:
        grads = {"dq", "dk", "dv", "dsink"} if "-sink" in row["case"] else {"dq", "dk", "dv"}
        assert set(row["errors"]) == {"out", *grads} and len(row["fingerprint"]) == 64
        assert all(row["errors"][n] <= row["bounds"][n] for n in row["errors"])
    again = json.loads(_run(capsys, *args)[1])
    assert again["fingerprint"] == report["fingerprint"]
    other_seed = json.loads(_run(capsys, *args, "--seed", "1")[1])
    assert other_seed["fingerprint"] != report["fingerprint"]


def test_verify_table_and_failure_exit_status(capsys, monkeypatch):
    """A backend that gets the numbers wrong makes verify print MISMATCH and exit 1."""
    from flash_recipe import dispatch

    real_run = dispatch.SdpaBackend.run

    def off_by_a_little(self, call):
        out, lse, probs = real_run(self, call)
        return out * 1.001, lse, probs

    monkeypatch.setattr(dispatch.SdpaBackend, "run", off_by_a_little)
    status, out = _run(capsys, "--grid", "small", "--dtype", "float32", "--backend", "sdpa", "--device", "cpu")
    assert status == 1
    assert "MISMATCH" in out and out.rstrip().endswith("FAILED")


def test_verify_requested_backend_that_cannot_run_fails(capsys, monkeypatch):
    monkeypatch.setattr(verify, "SMALL_GRID", verify.SMALL_GRID[:1])
    status, out = _run(capsys, "--json", "--grid", "small", "--backend", "flash_attn", "--device", "cpu")
    report = json.loads(out)
    assert status == 1 and not report["passed"]
    assert "flash_attn" in report["skipped"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_verify_full_grid_on_gpu(capsys):
    status, out = _run(capsys, "--json", "--backend", "triton")
    report = json.loads(out)
    assert status == 0, [row for row in report["cases"] if not row["passed"]]
    assert {row["dtype"] for row in report["cases"]} >= {"float16", "float32"}


def test_the_truth_for_fp32_inputs_is_computed_in_fp64(device):
    """The accuracy rule's ground truth is one precision above the input: fp32 for fp16/bf16 and
    fp64 for fp32. For fp32 the truth's own inputs are fp64, so the reference must stay in fp64
    (an fp32 truth would measure PyTorch's fp32 error as 0 and every bound as the 1e-5 floor)."""
    from flash_recipe.reference import compute_dtype
    from flash_recipe.testing import FLOOR, FORWARD_FACTOR

    assert compute_dtype(torch.float16, upcast=True) == torch.float32
    assert compute_dtype(torch.float32, upcast=True) == torch.float64
    assert compute_dtype(torch.float64, upcast=True) == torch.float64
    row = verify.check_case(verify.Case(1, 33, 40, 2, 1, 24, True), torch.float32, device, "reference", seed=0)
    torch_error = (row["bounds"]["out"] - FLOOR) / FORWARD_FACTOR
    assert 1e-9 < torch_error < FLOOR, row


def test_verify_kvcache_adds_its_cases_after_the_default_ones(capsys):
    """``--kvcache`` appends the KV-cache rows; the default rows are the same, and so is the
    default fingerprint (which the install matrix compares) when the option is not given."""
    base = ("--json", "--grid", "small", "--dtype", "float32", "--backend", "triton", "--backend", "reference")
    plain = json.loads(_run(capsys, *base)[1])
    status, out = _run(capsys, *base, "--kvcache")
    report = json.loads(out)
    assert status == 0 and report["passed"], [row for row in report["cases"] if not row["passed"]]
    assert report["cases"][: len(plain["cases"])] == plain["cases"]
    kv = report["cases"][len(plain["cases"]) :]
    assert len(kv) == 2 * len(verify.KV_SMALL_GRID) and all(row["case"].startswith("kv-") for row in kv)
    assert report["fingerprint"] != plain["fingerprint"]
    for row in kv:
        assert set(row["errors"]) == {"out", "k_cache", "v_cache", "cache_rest"}
        assert row["errors"]["v_cache"] == 0 and row["errors"]["cache_rest"] == 0
    rotated = [row for row in kv if "-rot" in row["case"]]
    assert rotated and all(0 < row["bounds"]["k_cache"] < 1e-3 for row in rotated)
    table = verify.format_table(report)
    assert "kv-* rows" in table and "MISMATCH" not in table


@pytest.mark.parametrize("damage", ["out", "written-row", "other-row"])
def test_verify_kvcache_catches_wrong_outputs_and_cache_writes(damage, monkeypatch):
    """A backend that returns a slightly wrong output, writes a new value inexactly, or touches a
    cache row it should not, fails its KV-cache check."""
    from flash_recipe import dispatch

    real_run_cache = dispatch.ReferenceBackend.run_cache

    def damaged(self, call):
        out, lse = real_run_cache(self, call)
        if damage == "out":
            out = out * 1.001
        elif damage == "written-row":  # batch entry 1 appends its new token at row 40
            call.v_cache[1, 40, 0, 0] = torch.nextafter(call.v_cache[1, 40, 0, 0], torch.tensor(10.0))
        else:  # row 63 is past every entry's tokens
            call.k_cache[0, 63] += 1.0
        return out, lse

    monkeypatch.setattr(dispatch.ReferenceBackend, "run_cache", damaged)
    case = verify.KV_SMALL_GRID[0]
    assert case.page == 0 and case.seqlens == (5, 40) and case.new == 1 and case.capacity == 64
    row = verify.check_kvcache_case(case, torch.float32, torch.device("cpu"), "reference", seed=0)
    assert not row["passed"]
    key = {"out": "out", "written-row": "v_cache", "other-row": "cache_rest"}[damage]
    assert row["errors"][key] > row["bounds"][key]
