"""Fresh processes for tests.

Compiling for GPU targets: Triton picks the interpreter or the compiler when it is imported, and
the test process runs with the interpreter, so each compile runs in a fresh process without
``TRITON_INTERPRET``. Both helpers give the process the checkout's ``devtools`` at the end of its
``sys.path``, so that ``flash_recipe`` is still the installed package under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run first in each fresh process: the checkout's root after site-packages.
_CHECKOUT_LAST = f"import sys; sys.path.append({str(ROOT)!r})\n"


def devtool_argv(module: str, *args: str) -> list:
    """The command running ``python -m devtools.MODULE ARGS`` against the installed flash_recipe."""
    code = _CHECKOUT_LAST + f"import runpy; runpy.run_module('devtools.{module}', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code, *args]


def compile_in_subprocess(script: str) -> list[dict]:
    """Run ``script`` in a fresh Python without ``TRITON_INTERPRET``; the JSON objects it prints, one per line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _CHECKOUT_LAST + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
