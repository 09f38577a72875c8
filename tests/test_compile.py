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


@pytest.mark.slow
def test_kvcache_kernels_compile_for_nvidia_targets():
    """The KV-cache variants (paged forward with split-KV partials, decode tiles, rotary/append,
    split merge) at the largest head-dim bucket, fp16, for sm80, sm86, sm89 and sm90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    kernels = ("fwd", "decode", "rotary_append", "split_combine")
    targets = ("sm80", "sm86", "sm89", "sm90")
    cmd = [sys.executable, "-W", "ignore", "-m", "flash_recipe.ops.compile_check", "--json", "--jobs", "2",
           "--dtype", "float16", "--head-dim", "256", "--mode", "kvcache",
           *(a for t in targets for a in ("--target", t)), *(a for k in kernels for a in ("--kernel", k))]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {(row["target"], row["variant"].split("-")[0]) for row in rows} == {
        (target, kernel) for target in targets for kernel in kernels
    }, result.stderr[-3000:]
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    assert all(row["matrix_instructions"] for row in rows if row["variant"].split("-")[0] in ("fwd", "decode"))
    assert result.returncode == 0
