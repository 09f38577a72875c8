"""Sessions of flash-recipe: ``nox -l`` lists them.

- ``tests``: the test suite, run against the built wheel;
- ``install_matrix``: every install recipe in ``recipes/``, one session per path, each in a fresh
  environment against loopback servers only; ``install_matrix_report`` follows automatically;
- ``ring_flash_attn``: ring-flash-attn from PyPI, unchanged, on flash_recipe (``install_as_flash_attn``);
- ``yunchang``: yunchang (USP) from PyPI, unchanged, on flash_recipe;
- ``diffusers``: diffusers transformers on its ``flash`` and ``flash_varlen`` backends and its
  context parallelism, and on its ``sage`` and ``sage_varlen`` backends (8-bit attention), on
  flash_recipe;
- ``hub_kernel``: flash_recipe as a Hugging Face Hub kernel, loaded by ``kernels`` from a local
  build, beside the pip package, and from transformers (``attn_implementation="org/repo"``);
- ``fuzz``: random calls of every entry point against plain-torch oracles (``-- --cases N --seed S``);
- ``compile_check``: the kernels compiled as a launch compiles them, for every GPU target, no GPU needed;
- ``torch_compat``: each supported torch release with the Triton its wheel pins (verify, core tests,
  the compiler path);
- ``compile_check_triton``: the compile check of the default calls under a Triton that torch pins,
  beside the CPU torch (3.6, torch 2.10 and 2.11's);
- ``lint``: ruff's checks and formatting, the import layers and mypy (pyproject.toml's settings);
- ``reproduce_upstream``: two upstream flash-attn install failures, reproduced and diagnosed
  (``recipes/harness/reproduce.py``).

The matrix machinery lives in ``recipes/harness`` (``python -m recipes.harness --help``); the
sessions here only call it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from recipes.harness.config import TOOLS  # noqa: E402
from recipes.harness.paths import PATH_IDS  # noqa: E402

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "virtualenv"

PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# The torch the test environment gets; pip's configuration decides where it comes from.
TORCH = os.environ.get("FLASH_RECIPE_TORCH", "torch==2.13.0")
# One id for all the matrix sessions of this nox invocation, so that their results add up to
# one report.
RUN_ID = os.environ.get("FLASH_RECIPE_MATRIX_RUN") or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
HARNESS = (sys.executable, "-m", "recipes.harness")


def install_built_wheel(
    session: nox.Session, extras: str = "", pins: tuple = (), torch: str | None = TORCH, env: dict | None = None
) -> None:
    """Install ``torch`` (default ``FLASH_RECIPE_TORCH``; None: the one installed) and ``pins``
    first, then the wheel built from this checkout; ``env`` for every pip command."""
    if torch or pins:
        session.install(*filter(None, (torch, *pins)), env=env)
    dist = Path(session.create_tmp()) / "dist"
    session.run("python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(ROOT), env=env)
    wheels = sorted(dist.glob("flash_recipe-*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one built wheel in {dist}, got {[w.name for w in wheels]}")
    session.install(f"{wheels[0]}{extras}", env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """Run pytest against the built wheel (not the source tree): the suite spread over the cores
    (pytest-xdist), then the ``serial`` tests alone. Extra arguments: one plain pytest run with them.

    torch comes first (``FLASH_RECIPE_TORCH``, default ``torch==2.13.0``), so the wheel's
    ``torch>=2.6`` is already satisfied and no other build is pulled in. The wheel is installed
    with its ``transformers`` extra, so the integration tests run too.
    """
    install_built_wheel(session, "[transformers]")
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    # The harness tests start a real pypiserver.
    session.install(*(f"{name}=={TOOLS[name]}" for name in ("pypiserver", "waitress", "passlib")))
    if session.posargs:  # the caller's selection, one pass
        run_pytest(session, str(ROOT / "tests"), *session.posargs)
        return
    # The suite on every core (pytest-xdist), then the tests marked ``serial`` (timing ratios,
    # which another process's load skews) alone.
    session.install(f"pytest-xdist=={PYTEST_XDIST}")
    workers = str(min(4, os.cpu_count() or 1))
    run_pytest(session, str(ROOT / "tests"), "-n", workers, "-m", "not serial", "--durations", "30")
    run_pytest(session, str(ROOT / "tests"), "-m", "serial")


# Spreads `nox -s tests` over the cores (not in the test group: a plain `pytest` runs without it).
PYTEST_XDIST = "3.8.0"


def run_pytest(session: nox.Session, *args: str, env: dict | None = None) -> None:
    """pytest outside the checkout, so that `import flash_recipe` finds the installed wheel
    (pytest puts only tests/ on sys.path, never the checkout's root); checked before it runs."""
    session.chdir(session.create_tmp())
    session.run(
        "python",
        "-c",
        "import flash_recipe, sys; f = flash_recipe.__file__; print('flash_recipe from', f); "
        "sys.exit('site-packages' not in f)",
    )
    session.run(
        "pytest", "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider", *args, env=env
    )


# The ring-flash-attn release the compatibility layer is tested with, and the transformers its
# import needs (its Hugging Face adapter reads names that transformers 5 removed).
RING_FLASH_ATTN = ("ring-flash-attn==0.1.8", "transformers<5")


@nox.session(default=False)
def ring_flash_attn(session: nox.Session) -> None:
    """ring-flash-attn from PyPI, unchanged, on flash_recipe's stand-in for flash-attn
    (``install_as_flash_attn()``), on 2 and 4 gloo processes: ``tests/test_ring_flash_attn.py``.

    An environment of its own, because ring-flash-attn needs transformers < 5 and the tests
    session installs the newest. Extra arguments go to pytest.
    """
    install_built_wheel(session, pins=RING_FLASH_ATTN)
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    run_pytest(
        session,
        str(ROOT / "tests" / "test_ring_flash_attn.py"),
        *session.posargs,
        env={"FLASH_RECIPE_REQUIRE_RING": "1"},
    )


# yunchang's release (installed without its "flash" extra, which would pull flash-attn).
YUNCHANG = ("yunchang==0.6.4",)


@nox.session(default=False)
def yunchang(session: nox.Session) -> None:
    """yunchang from PyPI, unchanged, on flash_recipe's stand-in for flash-attn: UlyssesAttention on
    2 gloo processes and LongContextAttention (Ulysses 2 x ring 2, basic/zigzag/strip rings) on 4,
    fp16 forward and backward: ``tests/test_yunchang.py``. Extra arguments go to pytest."""
    install_built_wheel(session, pins=YUNCHANG)
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    run_pytest(
        session, str(ROOT / "tests" / "test_yunchang.py"), *session.posargs, env={"FLASH_RECIPE_REQUIRE_YUNCHANG": "1"}
    )


# The diffusers release the attention-backend tests run, and the xformers release a diffusion
# environment often holds beside it (diffusers imports xformers.ops at import when it is installed).
DIFFUSERS = ("diffusers==0.42.1", "xformers==0.0.35")


@nox.session(default=False)
def diffusers(session: nox.Session) -> None:
    """Small diffusers transformers (random weights from configs, nothing from a hub) on
    flash_recipe's stand-ins.

    ``tests/test_diffusers.py``: Flux on the ``flash`` and ``flash_varlen`` attention backends
    (stand-in for flash-attn), forward and backward in fp16 and bf16 against ``native`` and
    float64, and diffusers' own context parallelism (ring and Ulysses, 2 gloo processes) on
    ``flash``. ``tests/test_diffusers_sage.py``: Flux, Wan and HunyuanVideo on the ``sage`` and
    ``sage_varlen`` backends (stand-in for SageAttention, 8-bit attention), forward in fp16 and
    bf16, each attention call and the output against ``native`` in float32 by the 8-bit method's
    bounds, and the 8-bit kernel launched once per call. ``tests/test_diffusers_fa3.py``: Flux and
    Wan on the ``_flash_3`` and ``_flash_varlen_3`` backends (stand-in for FlashAttention-3).
    ``tests/test_xformers.py``: xformers and
    diffusers import with the stand-ins active, and xformers' flash operator bodies run on the
    stand-in's ``flash_attn_gpu``. Extra arguments go to pytest."""
    install_built_wheel(session, pins=DIFFUSERS)
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    run_pytest(
        session,
        str(ROOT / "tests" / "test_diffusers.py"),
        str(ROOT / "tests" / "test_diffusers_sage.py"),
        str(ROOT / "tests" / "test_diffusers_fa3.py"),
        str(ROOT / "tests" / "test_xformers.py"),
        *session.posargs,
        env={"FLASH_RECIPE_REQUIRE_DIFFUSERS": "1", "FLASH_RECIPE_REQUIRE_XFORMERS": "1"},
    )


# The Hub-kernel loader and a transformers release of its window (transformers' own bounds: 5.20.2
# to 5.22.x take kernels 0.17.2 or newer, below 0.18; the package index here has kernels 0.17.2).
HUB_KERNEL = ("kernels==0.17.2", "transformers>=5.20.2,<5.23")


@nox.session(default=False)
def hub_kernel(session: nox.Session) -> None:
    """flash_recipe as a Hugging Face Hub kernel (``flash-recipe hub-build``), loaded offline by
    ``kernels`` from a local build: ``kernels info``, ``get_local_kernel`` in a process where
    ``import flash_recipe`` fails, the pip package and the Hub copy in one process, and a tiny
    random Llama with ``attn_implementation="flash-recipe/flash-recipe"`` through ``LOCAL_KERNELS``
    against sdpa: ``tests/test_hub_kernel.py``. Extra arguments go to pytest."""
    install_built_wheel(session, pins=HUB_KERNEL)
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    run_pytest(
        session,
        str(ROOT / "tests" / "test_hub_kernel.py"),
        *session.posargs,
        env={"FLASH_RECIPE_REQUIRE_HUB": "1", "HF_HUB_OFFLINE": "1"},
    )


FUZZ_USAGE = "usage: nox -s fuzz [-- [--cases N] [--seed S] [--case I ...]]"


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """``ruff check`` and ``ruff format --check``, the import layers (``lint-imports``) and the
    types (``mypy``), as pyproject.toml configures them, with the versions its ``lint`` dependency
    group pins. To fix what
    ruff reports: ``ruff check --fix . && ruff format .`` (then review the diff)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.chdir(ROOT)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")
    session.run("mypy")


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """Run the differential fuzz test (``tests/test_fuzz.py``) against the built wheel.

    Random calls of every entry point, each compared with a plain-torch oracle by the accuracy
    rule, and a quarter as many 8-bit attention calls (``test_fuzz_8bit``). Without arguments: 200
    cases of seed 1 and 50 8-bit ones (what CI runs: one to three minutes on a 2-core CPU through
    the Triton interpreter), other cases than the test suite's own 150 of seed 0.
    ``nox -s fuzz -- --cases 2000 --seed 5`` draws other cases; ``--case I`` (repeatable) replays
    case I of the seed, as a failure message names it.
    """
    options = {"--cases": "200", "--seed": "1"}
    cases = []
    args = list(session.posargs)
    if len(args) % 2:
        session.error(FUZZ_USAGE)
    for flag, value in zip(args[::2], args[1::2]):
        if flag not in ("--cases", "--seed", "--case") or not value.isdigit():
            session.error(FUZZ_USAGE)
        if flag == "--case":
            cases += ["--fuzz-case", value]
        else:
            options[flag] = value
    install_built_wheel(session)
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    run_pytest(
        session,
        str(ROOT / "tests" / "test_fuzz.py"),
        "--fuzz-cases",
        options["--cases"],
        "--fuzz-seed",
        options["--seed"],
        *cases,
    )


@nox.session(venv_backend="none", default=False)
@nox.parametrize("path", PATH_IDS, ids=list(PATH_IDS))
def install_matrix(session: nox.Session, path: str) -> None:
    """Run one install recipe in a fresh, hermetic environment and verify what it installed.

    ``nox -s install_matrix`` runs every path, ``nox -s "install_matrix(uv-pip)"`` one of them.
    Options after ``--``: ``--torch-index pip-config|cpu|cu126|cu128|cu130|URL``,
    ``--torch-version 2.13.0``, ``--keep`` (see ``python -m recipes.harness run --help``).
    The harness runs in nox's own interpreter and keeps its tools, build and wheelhouse in a
    cache shared by all paths, so the sessions need no virtualenv of their own.
    """
    session.notify("install_matrix_report", session.posargs)
    session.chdir(ROOT)
    session.run(*HARNESS, "run", path, "--run-id", RUN_ID, *session.posargs, external=True)


@nox.session(venv_backend="none", default=False)
def install_matrix_report(session: nox.Session) -> None:
    """Print and write the report of this invocation's matrix (install-matrix.md, .json).

    Fails when a path failed or the paths' verify fingerprints differ.
    """
    session.chdir(ROOT)
    session.run(*HARNESS, "report", "--run-id", RUN_ID, *session.posargs, external=True)


def run_devtool(session: nox.Session, module: str, *args: str) -> None:
    """``python -m devtools.MODULE ARGS`` (with ``TRITON_INTERPRET=0``) against the installed
    wheel: the checkout's root joins the end of ``sys.path``, where ``devtools`` is found and
    ``flash_recipe`` is not (site-packages comes first)."""
    code = (
        f"import runpy, sys; sys.path.append({str(ROOT)!r}); "
        f"runpy.run_module('devtools.{module}', run_name='__main__', alter_sys=True)"
    )
    session.run("python", "-W", "ignore", "-c", code, *args, env={"TRITON_INTERPRET": "0"})


@nox.session(default=False)
def compile_check(session: nox.Session) -> None:
    """Compile the kernels for every GPU target as a real launch compiles them, no GPU needed.

    Each kernel is compiled through the real launchers and Triton's launch specialisation, and must
    fit its architecture's shared memory, use the matrix units, and (aligned form, head dim up to
    128, plain scores) not spill. Default (what CI runs): the tool's ``ci`` preset (its
    ``PRESETS`` say what it covers). Arguments after ``--`` replace it
    (``python -m devtools.compile_check --help``).
    """
    install_built_wheel(session)
    session.chdir(session.create_tmp())
    run_devtool(session, "compile_check", *(session.posargs or ["--preset", "ci", "--jobs", "2"]))


# Triton releases that torch pairs pin (``TORCH_PAIRS``) and CI covers in no ``torch_compat`` run,
# whose compile check ``compile_check_triton`` runs beside the CPU torch: 3.6.0, the pin of torch
# 2.10 and 2.11 (the torch of the GPU machines this project borrows).
TRITON_ONLY = {"3.6": "3.6.0"}


@nox.session(default=False)
@nox.parametrize("release", list(TRITON_ONLY), ids=list(TRITON_ONLY))
def compile_check_triton(session: nox.Session, release: str) -> None:
    """The compile check of the default calls under a Triton that torch pairs pin, without that
    torch: ``nox -s "compile_check_triton(3.6)"`` compiles as torch 2.10 and 2.11 with their Triton
    3.6.0 do, for less than a ``torch_compat`` run (no CUDA torch of several GB to download): the
    check's ``triton`` preset, the forward, backward and decode step for sm80, sm90 and sm100 at
    head dim 128 in bf16, aligned, and the warp-specialised forward on sm100 at the head dims it is
    offered, compiled where the release rule enables it (``features.WARP_SPEC_TRITON``) and
    reported "not enabled on this Triton" where not. Arguments after ``--`` replace the preset.

    The CPU torch (``FLASH_RECIPE_TORCH``, default 2.13.0 from this machine's disk) stands in for
    the pair's torch: the compiler is Triton's, and torch only supplies the CPU tensors and dtypes
    the launchers are called with (it pins no Triton, so the release asked for is the one used).
    Then the direct launch's equivalence test and the host-path test through Triton's own
    launcher, on the stub CUDA driver (``STUB_DRIVER_TESTS``).
    """
    triton_version = TRITON_ONLY[release]
    install_built_wheel(session, pins=(f"triton=={triton_version}",))
    session.run(
        "python",
        "-c",
        f"import sys, triton; print('triton', triton.__version__); sys.exit(triton.__version__ != {triton_version!r})",
    )
    session.chdir(session.create_tmp())
    run_devtool(session, "compile_check", *(session.posargs or ["--preset", "triton", "--jobs", "2"]))
    if not session.posargs:  # Triton's own launch path under this release, on the stub driver
        session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
        run_pytest(session, *(str(ROOT / "tests" / name) for name in STUB_DRIVER_TESTS))


# The tests that run Triton's own launch path on the stub CUDA driver (``tools.stub_driver``).
STUB_DRIVER_TESTS = ("test_direct_launch.py", "test_host_driver.py")


# Each torch minor release pyproject admits, with the Triton its Linux wheel pins (its
# ``Requires-Dist``). CI runs the first and the last. The CPU build of 2.13.0 on this project's
# machines pins none; the pair's Triton is installed beside it all the same.
TORCH_PAIRS = {
    "2.6": ("2.6.0", "3.2.0"),
    "2.7": ("2.7.1", "3.3.1"),
    "2.8": ("2.8.0", "3.4.0"),
    "2.9": ("2.9.1", "3.5.1"),
    "2.10": ("2.10.0", "3.6.0"),
    "2.11": ("2.11.0", "3.6.0"),
    "2.12": ("2.12.1", "3.7.1"),
    "2.13": ("2.13.0", "3.7.1"),
    "2.14": ("2.14.1", "3.8.0"),
    "2.15": ("2.15.0", "3.9.0"),
}
# The core subset each pair runs: the API, packed sequences, the KV cache, torch.compile, the
# flash-attn stand-in, and the version gates (which must be taken on the torch that lacks a feature).
TORCH_COMPAT_TESTS = (
    "test_api.py",
    "test_varlen.py",
    "test_kvcache.py",
    "test_torch_compile.py",
    "test_flash_attn_compat.py",
    "test_torch_gates.py",
    "test_sinks.py",
)
TORCH_COMPAT_USAGE = "usage: nox -s 'torch_compat(2.9)' [-- --torch-index pip-config|cpu|cu126|cu128|cu130|URL]"


@nox.session(default=False)
@nox.parametrize("minor", list(TORCH_PAIRS), ids=list(TORCH_PAIRS))
def torch_compat(session: nox.Session, minor: str) -> None:
    """One torch release with the Triton its wheel pins, as a user has them: ``flash-recipe verify``
    through the interpreter (small grid, fp16 and fp32), the core tests (``TORCH_COMPAT_TESTS``),
    then the launch-specialised compile of the forward, backward and decode kernels for sm80 and
    sm90 at head dim 128 in bf16. ``nox -s "torch_compat(2.9)"`` runs one pair.

    ``-- --torch-index pip-config|cpu|cu126|...|URL`` picks the build (default: what pip's
    configuration serves; from the registry that is a CUDA build of several GB, which runs on a
    CPU). torch and the environment are removed when the session ends, pip's cache is not used,
    so one build at a time is on disk. torch above the cap of this machine's pip constraints
    (2.14.1) is installed with pip's configuration file lifted (``PIP_CONFIG_FILE``).
    """
    from recipes.harness.config import PIP_CONFIG, torch_index_url

    args = list(session.posargs)
    if args and (len(args) != 2 or args[0] != "--torch-index"):
        session.error(TORCH_COMPAT_USAGE)
    index = torch_index_url(args[-1] if args else PIP_CONFIG)
    torch_version, triton_version = TORCH_PAIRS[minor]
    env = {"PIP_NO_CACHE_DIR": "1"}
    if tuple(map(int, torch_version.split("."))) > (2, 14, 1):
        env["PIP_CONFIG_FILE"] = os.devnull  # lifts the machine's constraint file (it caps torch at 2.14.1)
    try:
        options = ["--index-url", index, "--extra-index-url", "https://pypi.org/simple"] if index else []
        session.install(*options, f"torch=={torch_version}", f"triton=={triton_version}", env=env)
        install_built_wheel(session, torch=None, env=env)  # the same lifted cap: pip would downgrade torch
        session.install(*nox.project.dependency_groups(PYPROJECT, "test"), env=env)
        session.run(
            "python",
            "-c",
            "import sys, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); "
            f"sys.exit(torch.__version__.split('+')[0] != {torch_version!r} "
            f"or triton.__version__ != {triton_version!r})",
        )
        run_pytest(session, *(str(ROOT / "tests" / name) for name in TORCH_COMPAT_TESTS))
        verify = "flash-recipe verify --backend triton --grid small --dtype float16 --dtype float32"
        session.run(*verify.split(), env={"TRITON_INTERPRET": "1"})
        run_devtool(session, "compile_check", "--preset", "compat", "--jobs", "2")
    finally:
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(default=False, venv_backend="venv")
def reproduce_upstream(session: nox.Session) -> None:
    """Reproduce upstream flash-attn's isolated-build and hollow-package failures; check the doctor.

    Downloads the flash-attn sdist from PyPI and installs torch (name a build to avoid a large
    download): ``nox -s reproduce_upstream -- torch==2.13.0 [FLASH_ATTN_VERSION]``.
    """
    from recipes.harness import reproduce

    reproduce.reproduce_upstream(session, session.posargs)
