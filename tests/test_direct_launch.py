"""The direct launch (``flash_recipe.ops.direct``) hands Triton's launcher exactly what
``JITFunction.run`` would, and steps aside where a call changes what Triton specialises on.

Run in a process of its own with the interpreter off, on the stub CUDA driver (a test double for
the GPU driver this machine lacks: ``flash_recipe.tools.stub_driver``), so that Triton's own
launch path runs and its kernels compile for sm90 (``tests/direct_worker.py``). CI runs this file
under Triton 3.9 (the tests session) and 3.6 (``compile_check_triton``); under 3.2 it is run by
hand beside the CPU torch (``pip install --target DIR triton==3.2.0``, then ``PYTHONPATH=DIR``),
not in ``torch_compat``, whose CUDA builds of torch would load the stub library too.

- For each host-cost case (forward, forward under autograd, a KV-cache decode step, forward and
  backward), every launch of a plan that has learnt its launch is made twice with the same
  tensors, through ``JITFunction.run`` and directly: the launcher calls must agree in grid,
  stream, function, metadata and every argument (tensors by identity), the hooks being empty
  either way, and the direct one must not enter ``JITFunction.run``. Where the direct launch
  calls the launcher's own ``launch`` (``direct.INNER``, every release of ``INNER_RELEASES``),
  what that receives is compared with what the launcher passes it on the way from
  ``JITFunction.run``, value by value, the launch metadata and hooks None.
- Planted: a misaligned tensor, a launch hook and a changed global each go through
  ``JITFunction.run`` (which recompiles, calls the hook, or refuses the global); another stream
  is passed directly; after them the plan launches directly again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flash_recipe.ops import direct, targets

WORKER = Path(__file__).with_name("direct_worker.py")
# Whether the installed Triton's launcher is one whose own launch a direct launch calls (``direct.INNER``).
_FIRST, _LAST = direct.INNER_RELEASES
INNER = _FIRST <= targets.triton_release() <= _LAST
CASES = ("fwd", "fwd_autograd", "kvcache", "fwd_bwd")


def _worker(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(WORKER), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "0"},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_direct_launches_pass_the_launcher_what_jit_function_run_passes():
    rows = {row["case"]: row for row in _worker("calls", *CASES)}
    assert set(rows) == set(CASES)
    for case, row in rows.items():
        # A decoding step: the append of keys and values, the forward; the backward: its own launches too.
        assert row["direct_launches"] >= {"kvcache": 2, "fwd_bwd": 3}.get(case, 1), row
        assert row["problems"] == [], row
        assert row["runs_through_run"] == row["direct_launches"] and row["runs_direct"] == 0, row
        if INNER:  # every plan passed the launcher's own launch what the launcher would have
            assert row["inner_launches"] == row["direct_launches"], row


@pytest.mark.slow
def test_a_changed_alignment_hook_or_global_takes_jit_function_run_and_a_stream_is_passed():
    (report,) = _worker("guards")
    assert report["state"] == 2 and report["plain"] == 0  # learnt, then direct
    assert report["inner"] is INNER and report["inner_runs"] == 0 and report["inner_stream"] == 0
    assert report["misaligned"] == 1 and report["misaligned_pointer"]  # recompiled for it, then launched
    assert report["stream"] == 0 and report["stream_passed"] == 7
    assert report["hook"] == 1 and report["hook_entered"] == 1
    assert str(report["global"]).startswith("RuntimeError: Global variable SCALE has changed")
    assert report["back_to_direct"] == 0
