"""``flash-recipe verify``: the report, the exit status and the fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from flash_recipe import cli, verify


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
        assert set(row["errors"]) == {"out", "dq", "dk", "dv"} and len(row["fingerprint"]) == 64
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
