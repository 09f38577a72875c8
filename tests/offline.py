"""Compiling for GPU targets in a test: Triton picks the interpreter or the compiler when it is
imported, and the test process runs with the interpreter, so each compile runs in a fresh process
without ``TRITON_INTERPRET``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def compile_in_subprocess(script: str) -> list[dict]:
    """Run ``script`` in a fresh Python without ``TRITON_INTERPRET``; the JSON objects it prints, one per line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
