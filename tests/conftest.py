"""Shared fixtures.

Without a GPU, the test process runs the Triton kernels through Triton's CPU interpreter: the
interpreter is chosen when ``flash_recipe.ops`` is imported, so it is switched on here, before
any test imports it. With a GPU, the kernels are compiled and run on it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


def _import_from_checkout(name: str) -> None:
    """Make the checkout's package ``name`` (``recipes``, the install-matrix harness; ``devtools``,
    the developers' tools) importable without putting the checkout on sys.path, which would shadow
    the installed flash_recipe under test."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / name / "__init__.py", submodule_search_locations=[str(ROOT / name)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def pytest_addoption(parser):
    group = parser.getgroup("fuzz", "the differential fuzz test (tests/test_fuzz.py)")
    group.addoption(
        "--fuzz-cases", type=int, default=None, help="how many random cases to run (default: the bounded CI count)"
    )
    group.addoption("--fuzz-seed", type=int, default=0, help="the seed every case is drawn from")
    group.addoption(
        "--fuzz-case",
        type=int,
        action="append",
        default=None,
        help="run only this case index (repeatable): the replay of a reported failure",
    )


def pytest_configure(config):
    if not HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # Triton fixes interpreter-or-compiler when first imported: import it now, so no test that
        # changes TRITON_INTERPRET (or runs a tool that does) can leave it in the other mode.
        import triton  # noqa: F401
    _import_from_checkout("recipes")
    _import_from_checkout("devtools")


@pytest.fixture
def device() -> torch.device:
    """Where the kernel tests run: the GPU if there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def nan_outputs(monkeypatch):
    """Kernel outputs start as NaN, so a tile the kernel forgets to write shows up."""
    from flash_recipe.ops import tiles

    def nan_buffer(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tiles, "output_buffer", nan_buffer)


@pytest.fixture
def flash_recipe_warnings(monkeypatch):
    """Collects the warnings, issued or logged through torch's loggers, while the test runs; call it
    for those that name flash_recipe's code. Dynamo's warn-once cache starts empty, so a warning
    it gave in an earlier test shows again."""
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(f"{record.pathname}: {record.getMessage()}")
    torch_logger = logging.getLogger("torch")
    torch_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield lambda: [w for w in [f"{c.filename}: {c.message}" for c in caught] + logged if "flash_recipe" in w]
    finally:
        torch_logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    """Tests start from automatic backend selection, whatever the caller's environment says."""
    monkeypatch.delenv("FLASH_RECIPE_BACKEND", raising=False)


# Set on a test item whose call phase failed with the bounds checker's own exception.
_FAILED_OUT_OF_BOUNDS = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Note which tests already failed with ``OutOfBoundsAccess``, so ``bounds_checked`` does
    not report the same access again at teardown."""
    report = yield
    if report.when == "call" and call.excinfo is not None:
        item.stash[_FAILED_OUT_OF_BOUNDS] = call.excinfo.typename == "OutOfBoundsAccess"
    return report


@pytest.fixture
def int_overflow_checked(monkeypatch):
    """Triton's interpreter checks every int32 (and narrower) add, sub and mul of the kernels the
    test launches for overflow: a wrapped product raises ``int32 overflow detected for operation
    mul`` (inside the interpreter's ``InterpreterError``). This is the interpreter's own sanitiser,
    which Triton 3.9 switches on only with its options' ``debug`` (neither ``TRITON_DEBUG`` nor
    ``triton.jit(debug=True)`` reaches the interpreter), so the fixture replaces those options for
    the test; ``tl.device_assert`` is then checked too. Yields True, or None where there is nothing
    to switch on: with a GPU (kernels run compiled) or an interpreter without the sanitiser
    (Triton before 3.3)."""
    if HAS_CUDA:
        yield None
        return
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not {"debug", "sanitize_overflow"} <= {f.name for f in dataclasses.fields(options)}:
        yield None
        return
    monkeypatch.setattr(builder, "options", dataclasses.replace(options, debug=True, sanitize_overflow=True))
    yield True


@pytest.fixture
def bounds_checked(monkeypatch, request):
    """Every load, store and atomic of the Triton kernels the test launches stays inside the
    storage of a tensor passed to that launch (see ``tests/bounds.py``); yields the checker.

    A stray access raises ``OutOfBoundsAccess`` where it happens; one that the code under test
    swallowed fails the test at teardown. The check wraps Triton's CPU interpreter, so it runs
    only without a GPU: on a machine with one the kernels are compiled and run on the GPU, which
    cannot be instrumented this way, and the fixture does nothing (yields None). A failure to
    install the hooks fails the test.
    """
    if HAS_CUDA:
        yield None
        return
    import bounds

    checker = bounds.BoundsChecker()
    try:
        checker.install(monkeypatch)
    except bounds.HooksUnavailable as exc:
        pytest.fail(f"cannot check kernel memory accesses: {exc}", pytrace=False)
    yield checker
    if request.node.stash.get(_FAILED_OUT_OF_BOUNDS, False):
        checker.take_violations()  # the test already failed with it
    checker.verify()
