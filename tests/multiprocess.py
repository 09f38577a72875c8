"""Start the ranks of a gloo process group as separate Python processes, on this machine only.

``run_ranks(world_size, spec)`` runs ``ring_worker.py`` once per rank (``RANK``, ``WORLD_SIZE``,
a ``file://`` rendezvous in a temporary directory, gloo on the loopback interface) and returns
rank 0's results. Every run has a hard timeout: ranks still running then (a hung collective) are
killed and the test fails with every rank's output, instead of blocking the suite. The ranks also
end with the test process: on Ctrl-C or any other exception they are killed, and on Linux each
rank gets SIGKILL from the kernel when the process that started it dies, by any signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ring_worker.py")


def _die_with_parent() -> None:
    """For ``preexec_fn``: on Linux, the rank gets SIGKILL when the test process dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_ranks(world_size: int, spec: dict, timeout: float = 240.0, env: dict | None = None) -> list:
    """Rank 0's ``RESULTS`` of ``ring_worker.py SPEC`` on ``world_size`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        common = {
            **os.environ,
            "FLASH_RECIPE_INIT": f"file://{tmp}/rendezvous",
            "WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs = []
        try:
            for rank in range(world_size):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), json.dumps(spec)],
                        env={**common, "RANK": str(rank)},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        cwd=tmp,
                        preexec_fn=_die_with_parent,
                    )
                )
            deadline = time.monotonic() + timeout
            outputs, hung = [], False
            for proc in procs:
                try:
                    outputs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    hung = True
                    for other in procs:
                        other.kill()
                    outputs.append(proc.communicate()[0])
        except BaseException:  # Ctrl-C, or a failure starting a rank: no rank outlives the test
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        report = "\n".join(
            f"--- rank {rank} (exit {p.returncode}) ---\n{out[-4000:]}"
            for rank, (p, out) in enumerate(zip(procs, outputs))
        )
        if hung:
            pytest.fail(f"the ranks did not finish within {timeout:.0f} s and were killed\n{report}")
        if any(p.returncode != 0 for p in procs):
            pytest.fail(f"a rank failed\n{report}")
        lines = [line for line in outputs[0].splitlines() if line.startswith("RESULTS ")]
        if len(lines) != 1:
            pytest.fail(f"rank 0 printed no results\n{report}")
        return json.loads(lines[0][len("RESULTS ") :])


def assert_within_bounds(results: list, cases: list) -> None:
    """Every error of every case within its accuracy-rule bound (the message lists them all)."""
    failures = [
        f"{case} {name}: error {r['error']:.3e} > bound {r['bound']:.3e}"
        for case, result in zip(cases, results)
        for name, r in result.items()
        if not r["error"] <= r["bound"]
    ]
    assert not failures, "\n".join(failures)
