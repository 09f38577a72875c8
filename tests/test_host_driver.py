"""The host path per call through Triton's own launcher, on the stub CUDA driver.

``flash_recipe.tools.stub_driver`` builds a stub ``libcuda.so.1`` (a test double for the GPU
driver this machine lacks) and makes Triton's ``CudaDriver`` on it the active driver, so that a
call on CPU tensors runs every line of ``JITFunction.run`` and of Triton's C launcher, after
compiling its kernels for sm90 for real. ``host_cost.gpu_route`` sends the call down the path a
GPU's tensors take. Checked here, in a subprocess with the interpreter off:

- each case reaches the stub's ``cuLaunchKernelEx`` as often as it launches, with the grid the
  launcher computed (Triton's C launcher ran, not a recorder);
- Python calls per repeated call stay within ``BOUNDS`` (set from this tool's counts under the
  Triton releases named, on CPython 3.11; another release or Python counts differently and is
  not bounded here), and a planted regression (memos that never hit) breaks them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from flash_recipe.ops import targets

# Launches per call: the forward; the KV-cache step at 64 key rows appends k and v in one launch
# (rotary/append), then attends (one split); forward and backward: the forward, the preprocess, then
# the one pass or the dQ and dK/dV kernels (the installed Triton's release rule, ``configs.ONE_PASS_TRITON``).
LAUNCHES = {"fwd": (1,), "fwd_autograd": (1,), "kvcache": (2,), "fwd_bwd": (3, 4)}
# Python calls per repeated call through Triton's launcher on CPython 3.11, direct launches on (the
# tool's counts on 2026-12-04, 64 key rows: 39, 43, 38 and 84 under Triton 3.9 and 3.6 alike, since
# the public call's token keys its forward and decoding plans and a direct launch calls the
# launcher's own launch, ``direct.INNER``: Triton's Python left in a repeated call is the expansion
# of the forward's two tensor descriptors; 47, 51, 56 and 113 under 3.9, and 44, 48, 50 and 101 under
# 3.6 on 2026-12-02; before the host path was cut, 97, 114, 111 and 185 under 3.9), with two calls of room.
# fwd_bwd under 3.9 since sm90 runs the three kernels at head dim 128, as the H200 measured
# (``configs.MEASURED_BACKWARD_PATHS``): a launch more than the one pass (3.6 ran the three kernels
# there already: its one-pass tile spills).
BOUNDS = {
    (3, 9): {"fwd": 41, "fwd_autograd": 45, "kvcache": 40, "fwd_bwd": 86},
    (3, 6): {"fwd": 41, "fwd_autograd": 45, "kvcache": 40, "fwd_bwd": 86},
}

SCRIPT = """
import json, sys, torch
from flash_recipe import memo_keys
from flash_recipe.tools import host_cost, stub_driver
if sys.argv[1] == "planted":
    memo_keys.Memo.get = lambda self, key, default=None: None
cpu = torch.device("cpu")
with host_cost.gpu_route("sm90"):
    for case in sys.argv[2:]:
        before = stub_driver.launches()
        row = host_cost.measure(cpu, torch.float16, 64, False, reps=2, cases=(case,))[0]
        row["stub_launches"] = stub_driver.launches() - before
        row["last"] = stub_driver.last_launch()
        print(json.dumps(row))
"""


def _measure(mode: str, *cases: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(SCRIPT), mode, *cases],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


@pytest.mark.slow
def test_every_case_runs_tritons_launcher_on_the_stub_driver_within_its_bound():
    rows = _measure("plain", *LAUNCHES)
    bounds = BOUNDS.get(targets.triton_release())
    for case, launches in LAUNCHES.items():
        row = rows[case]
        assert row["launches"] in launches, row
        # The first call, the two learning ones, the recorded one, the counted one, 3 warming and
        # 5 rounds x 2 timed ones (``host_cost.time_beside``): each launches.
        assert row["stub_launches"] == row["launches"] * (1 + 2 + 1 + 1 + 3 + 5 * 2), row
        assert row["last"]["block"][0] % 32 == 0 and row["last"]["grid"][0] >= 1, row
        if bounds:
            assert row["calls"] <= bounds[case], f"{case}: {row['calls']} Python calls, bound {bounds[case]}"
    assert rows["fwd"]["arguments"][0] > 50  # the forward kernel takes every option as an argument


@pytest.mark.slow
@pytest.mark.skipif(targets.triton_release() not in BOUNDS, reason="bounds are set for Triton 3.6 and 3.9")
def test_the_bound_fails_when_every_call_does_the_first_calls_work():
    rows = _measure("planted", "fwd", "kvcache")
    bounds = BOUNDS[targets.triton_release()]
    for case, row in rows.items():
        assert row["launches"] in LAUNCHES[case]
        assert row["calls"] > bounds[case], row
