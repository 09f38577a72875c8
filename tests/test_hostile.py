"""Hostile input to the public API ends in a clear error naming the argument (and the fix), or in
the right result: the table is ``tests/hostile.py``; every row runs under the triton and sdpa
backends, each in a child process with a timeout, so a hang fails its row instead of stalling."""

from __future__ import annotations

import hostile
import pytest


@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("name", [case.name for case in hostile.CASES])
def test_hostile_input(name, backend):
    found = hostile.run(name, backend, timeout=120.0)
    assert found["outcome"] == "pass", f"{name} under {backend}: {found['outcome']}: {found['detail']}"
