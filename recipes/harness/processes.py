"""Child processes that end with the harness, however the harness ends.

A step (a recipe's shell, and the pip, uv or Poetry it starts) runs in a process group of its own
(``start_new_session``), so one signal reaches all of it. ``die_with_parent`` gives the step's
first process SIGTERM when the harness dies, but its children would outlive it; so each step
also gets a watchdog (``ended_with_harness``): a small process that waits on a pipe the harness
holds open and, when the pipe closes (the step finished, or the harness died by any signal,
SIGKILL included, since the kernel closes a dead process's files), ends the step's whole group:
SIGTERM, then SIGKILL two seconds later. The watchdog starts before the step, and the step's
first process writes its process group into the pipe itself, before it runs the step's command
(``preexec_fn``): so a signal that ends the harness at any moment after the step exists, even
before ``Popen`` has returned to the harness, finds the watchdog knowing which group to end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

_WATCHDOG = r"""
import os, signal, sys, time
line = sys.stdin.buffer.readline()  # the step's process group, once the step has started
if not line.strip():
    sys.exit(0)  # the harness ended before it started the step
pgid = int(line)
sys.stdin.buffer.read()  # returns at end of file: the harness closed its end or died
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        break
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            sys.exit(0)
        time.sleep(0.05)
"""


def die_with_parent() -> None:
    """For ``preexec_fn``: on Linux, the child gets SIGTERM when the harness dies, even by SIGKILL
    (nox kills a session's command half a second after Ctrl-C)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def ended_with_harness(start: Callable[..., subprocess.Popen]) -> Iterator[subprocess.Popen]:
    """Start a watchdog, then the step (``start(preexec_fn=...)``, a Popen with
    ``start_new_session``; the ``preexec_fn`` given announces the step's group to the watchdog and
    calls ``die_with_parent``), and yield the step: while the block runs the watchdog ends the
    step's group if the harness dies; on leaving the block the group is ended too, so no child of
    the step outlives it."""
    read_end, write_end = os.pipe()  # both close-on-exec: no step process inherits the write end
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", "-c", _WATCHDOG],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C at the terminal does not end it before the step
        )
    finally:
        os.close(read_end)

    def announce() -> None:  # in the step's first process, after setsid, before its command runs
        os.write(write_end, f"{os.getpid()}\n".encode())
        die_with_parent()

    try:
        yield start(preexec_fn=announce)
    finally:
        os.close(write_end)
        watchdog.wait()
