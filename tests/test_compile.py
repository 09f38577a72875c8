"""The kernels compile for real GPU targets without a GPU, fit shared memory and use the matrix units.

``triton.compile`` builds PTX and cubin for sm80/86/89/90 and code objects for gfx90a/gfx942 on
this CPU machine. Triton picks the interpreter or the compiler when it is imported, so the check
runs in a fresh process without ``TRITON_INTERPRET``.

Here the three attention kernels are compiled for every target at the largest head-dim bucket
(the largest tiles), fp16, with every option on (window, softcap, ALiBi, dropout) and every mask. The full sweep (every dtype, bucket and
variant) is ``nox -s compile_check``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flash_recipe.ops.compile_check import TARGETS


@pytest.mark.slow
def test_largest_tiles_compile_and_fit_every_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-W", "ignore", "-m", "flash_recipe.ops.compile_check", "--json", "--jobs", "2",
           "--kernel", "fwd", "--kernel", "bwd_dkdv", "--kernel", "bwd_dq",
           "--dtype", "float16", "--head-dim", "256", "--mode", "all-options", "--even", "no"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {(row["target"], row["variant"].split("-")[0]) for row in rows} == {
        (target, kernel) for target in TARGETS for kernel in ("fwd", "bwd_dkdv", "bwd_dq")
    }, result.stderr[-3000:]
    bad = [row for row in rows if not row["ok"]]
    assert not bad, bad
    for row in rows:
        assert 0 < row["shared_bytes"] <= row["shared_limit"]
        assert row["matrix_instructions"], row
    assert result.returncode == 0
