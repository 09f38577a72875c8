"""The doctor's rules for building and loading upstream flash-attn: failures 1 to 11.

Rules about *building* upstream flash-attn only speak when flash-attn is in play (installed,
declared by the project, named on the command line, a FLASH_ATTENTION_* variable is set, or a log
was given), so a healthy environment that never asked for it hears nothing.

The failure numbers (``failure=``) refer to the list of known failures in the project's field
notes (flash-attention issues #246, #931, #940, #1736, #219, #389, #773, #489, #1444, uv #17794...).
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, Optional

from . import commands
from .findings import Build, Context, Finding, rule
from .wheels import parse_wheel_filename, resolve

_BUILD_MARKERS = (
    r"(Getting requirements to build|Preparing metadata|setup\.py|build_meta|pip-build-env|Building wheel"
    r"|build backend|uv.*build)"
)


# -- 1. torch missing inside an isolated build ----------------------------------------------------
@rule("build-isolation-no-torch")
def _build_isolation(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"No module named '?torch'?") if ctx.log and re.search(_BUILD_MARKERS, ctx.log) else []
    evidence = [f"install log: {line}" for line in lines[:2]]
    proj = ctx.project
    if not evidence and proj.get("declares_flash_attn") and not ctx.flash_attn.get("installed"):
        if ctx.installer == "poetry":
            evidence.append(
                "pyproject.toml declares flash-attn and Poetry always builds it in isolation (Poetry #9722)"
            )
        elif ctx.installer == "uv" and not proj.get("uv_flash_attn_build_config"):
            evidence.append(
                "pyproject.toml declares flash-attn but sets neither no-build-isolation-package nor "
                "extra-build-dependencies for it"
            )
    if not evidence:
        return None
    if ctx.cpu_only_torch:
        recipe, command = ctx.cuda_torch_fix()
    elif ctx.installer == "poetry":
        # Poetry cannot switch build isolation off: install the published wheel by URL
        res = ctx.resolved()
        recipe = "upstream-flash-attn"
        if res["url"]:
            command = commands.install_wheel_url(res["url"], "poetry")
        else:
            command = commands.no_build_isolation(ctx.facts, "poetry", ctx.version)
    else:
        recipe = "upstream-flash-attn" if ctx.installer == "uv" else "pip-no-build-isolation"
        command = commands.no_build_isolation(ctx.facts, ctx.installer, ctx.version)
    return finding(
        "flash-attn's setup.py imports torch, which an isolated build environment does not have",
        "error" if lines else "warning",
        evidence,
        recipe,
        command,
        failure=1,
        note="Install torch first, then build flash-attn against it with build isolation off.",
    )


# -- 2. build tools missing once isolation is off -------------------------------------------------
@rule("build-tools-missing")
def _build_tools(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"No module named '?(packaging|wheel|setuptools|psutil|ninja)'?")
    evidence = [f"install log: {line}" for line in lines[:3]]
    fa = ctx.flash_attn
    needs_build = ctx.flash_attn_in_play and not fa.get("loads", False)
    missing = ctx.build.get("missing") or []
    if needs_build and missing and torch_ok(ctx):
        evidence.append(f"not installed here: {', '.join(missing)} (a --no-build-isolation build imports them)")
    if not evidence:
        return None
    return finding(
        "the Python build tools flash-attn's setup.py needs are missing",
        "error" if lines else "warning",
        evidence,
        "pip-no-build-isolation",
        commands.build_tools(ctx.installer),
        failure=2,
        note="Python 3.12+ venvs no longer ship setuptools; ninja turns a 2-hour compile into minutes.",
    )


def torch_ok(ctx: Context) -> bool:
    """torch imports and is a GPU build, so a flash-attn build could go ahead."""
    torch = ctx.torch
    return bool(torch.get("installed")) and not torch.get("import_error") and torch.get("build") in ("cuda", "rocm")


def _symbol_lines(ctx: Context) -> list[str]:
    found = []
    error = ctx.flash_attn.get("module_error") or ""
    if "undefined symbol" in error:
        found.append(f"import flash_attn_2_cuda: {error[:240]}")
    found += [f"log: {line}" for line in ctx.log_lines(r"undefined symbol")[:2]]
    return found


# new-ABI symbols carry "cxx11" (St7__cxx11, B5cxx11); old-ABI std::string mangles as "Ss"
_ABI_SYMBOL = re.compile(r"(cxx11|Ss$|SsE|SsS)")


def _symbol_is_abi(text: str) -> bool:
    match = re.search(r"undefined symbol:\s*(\S+)", text)
    return bool(match and _ABI_SYMBOL.search(match.group(1)))


# -- 3. built for another torch --------------------------------------------------------------------
@rule("torch-version-mismatch")
def _torch_mismatch(ctx: Context, finding: Build) -> Optional[Finding]:
    evidence = [line for line in _symbol_lines(ctx) if not _symbol_is_abi(line)]
    parts = ctx.flash_attn.get("wheel_name_parts") or {}
    torch_version = ctx.torch.get("version") or ""
    torch_mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    if parts and torch_mm and parts.get("torch") != torch_mm:
        evidence.append(
            f"installed wheel {ctx.flash_attn.get('wheel_filename')} is for torch {parts['torch']}, "
            f"this is torch {torch_version}"
        )
    if not evidence:
        return None
    recipe, command = ctx.wheel_fix()
    return finding(
        "flash-attn was built for a different torch than the one installed",
        "error",
        evidence,
        recipe,
        command,
        failure=3,
        note="flash-attn's compiled module links against one torch minor release; reinstall it for this torch.",
    )


# -- 4. C++11 ABI mismatch -------------------------------------------------------------------------
@rule("cxx11-abi-mismatch")
def _abi_mismatch(ctx: Context, finding: Build) -> Optional[Finding]:
    evidence = [line for line in _symbol_lines(ctx) if _symbol_is_abi(line)]
    parts = ctx.flash_attn.get("wheel_name_parts") or {}
    torch = ctx.torch
    if parts and torch.get("cxx11abi") is not None and parts.get("cxx11abi") != torch["cxx11abi"]:
        evidence.append(
            f"installed wheel says cxx11abi{str(parts['cxx11abi']).upper()}, "
            f"torch._C._GLIBCXX_USE_CXX11_ABI is {torch['cxx11abi']}"
        )
    if not evidence:
        return None
    recipe, command = ctx.wheel_fix()
    return finding(
        "flash-attn and torch were compiled with different C++ ABIs (std::string layouts)",
        "error",
        evidence,
        recipe,
        command,
        failure=4,
        note="Take the wheel whose cxx11abi flag equals torch's (torch 2.7+ from PyPI: TRUE).",
    )


# -- 5. nvcc missing -----------------------------------------------------------------------------
@rule("nvcc-missing")
def _nvcc_missing(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"(nvcc was not found|CUDA_HOME environment variable is not set|nvcc: (command )?not found)")
    evidence = [f"install log: {line}" for line in lines[:2]]
    torch = ctx.torch
    nvcc = ctx.nvcc
    if _building(ctx) and torch.get("build") == "cuda" and "path" in nvcc and not nvcc.get("path"):
        evidence.append("no nvcc on PATH, under CUDA_HOME or /usr/local/cuda (a source build needs it)")
    if not evidence:
        return None
    recipe, command = ctx.wheel_fix()
    if ctx.resolved()["status"] != "published":
        cuda = torch.get("cuda") or "12.x"
        command = (
            f"conda install -c nvidia cuda-nvcc={cuda}   # or a CUDA 'devel' container image; then export CUDA_HOME\n"
            f"{command}"
        )
    return finding(
        "a flash-attn source build needs nvcc, and none was found",
        "error" if lines else "warning",
        evidence,
        recipe,
        command,
        failure=5,
        note="Only the 'devel' CUDA images ship nvcc; a prebuilt wheel needs no compiler at all.",
    )


def _building(ctx: Context) -> bool:
    """Is a source build of flash-attn ahead? (in play, not loading, and no published wheel)"""
    if not ctx.flash_attn_in_play or ctx.flash_attn.get("loads"):
        return False
    if ctx.env.get("FLASH_ATTENTION_FORCE_BUILD") == "TRUE":
        return True
    return ctx.resolved()["status"] != "published"


# -- 6. nvcc and torch on different CUDA ---------------------------------------------------------
@rule("nvcc-torch-cuda-mismatch")
def _nvcc_mismatch(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"detected CUDA version \(\S+\) mismatches the version that was used to compile")
    evidence = [f"install log: {line}" for line in lines[:1]]
    torch_cuda = ctx.torch.get("cuda")
    nvcc_version = ctx.nvcc.get("version")
    if _building(ctx) and torch_cuda and nvcc_version and torch_cuda.split(".")[0] != nvcc_version.split(".")[0]:
        evidence.append(f"nvcc is CUDA {nvcc_version}, torch was built with CUDA {torch_cuda}")
    if not evidence:
        return None
    recipe, command = ctx.wheel_fix()
    if ctx.resolved()["status"] != "published":
        command = (
            f"conda install -c nvidia cuda-nvcc={torch_cuda or 'X.Y'}   # nvcc matching torch.version.cuda\n{command}"
        )
    return finding(
        "nvcc and torch use different CUDA major versions; torch's extension builder refuses that",
        "error" if lines else "warning",
        evidence,
        recipe,
        command,
        failure=6,
    )


# -- 7. compile runs out of memory ---------------------------------------------------------------
@rule("compile-oom")
def _compile_oom(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(
        r"(Killed signal terminated program|died due to signal 9|\bKilled\b|out of memory|MemoryError)"
    )
    evidence = [f"install log: {line}" for line in lines[:2]]
    env = ctx.env
    safe = commands.max_jobs(ctx.facts)
    if ctx.flash_attn_in_play and "MAX_JOBS" in env:
        try:
            jobs = int(env["MAX_JOBS"])
        except ValueError:
            evidence.append(f"MAX_JOBS={env['MAX_JOBS']!r} is not a whole number")
        else:
            if jobs > safe:
                free = ctx.platform.get("mem_available_gib")
                evidence.append(f"MAX_JOBS={jobs} but {free} GiB free allows about {safe} nvcc jobs of 8-9 GB each")
    if _building(ctx) and not ctx.build.get("ninja"):
        evidence.append("ninja is not installed: without it the build compiles one file at a time (about 2 hours)")
    if not evidence:
        return None
    recipe, command = ctx.build_fix(force_build=True)
    return finding(
        "a flash-attn compile with too many parallel jobs runs out of memory (or crawls without ninja)",
        "error" if lines else "warning",
        evidence,
        recipe,
        command,
        failure=7,
        note=(
            f"MAX_JOBS={safe} follows upstream's own rule (half the cores, one job per 9 GB free); "
            "lower NVCC_THREADS to save more."
        ),
    )


def _guessed_wheels(ctx: Context) -> list[dict[str, Any]]:
    """The wheels upstream's setup.py tried to download ("Guessing wheel URL: ..." in the log),
    each resolved against the published tables."""
    out = []
    for url in re.findall(r"Guessing wheel URL:\s*(\S+)", ctx.log or ""):
        try:
            parts = parse_wheel_filename(url)
        except ValueError:
            continue
        label = parts["cuda_label"]
        digits = label[4:] if label.startswith("rocm") else label[2:]
        version = digits if len(digits) <= 2 else f"{digits[:-1]}.{digits[-1]}"
        device = {"hip": version} if label.startswith("rocm") else {"cuda": version}
        res = resolve(
            parts["version"],
            python=parts["python"],
            torch=parts["torch"],
            cxx11abi=parts["cxx11abi"],
            platform=parts["platform"],
            **device,
        )
        out.append(res)
    return out


# -- 8. wheel download blocked -------------------------------------------------------------------
@rule("wheel-download-blocked")
def _download_blocked(ctx: Context, finding: Build) -> Optional[Finding]:
    evidence = []
    fell_back = bool(ctx.log_lines(r"Precompiled wheel not found"))
    for res in _guessed_wheels(ctx):
        if fell_back and res["status"] == "published":
            evidence.append(
                f"install log: the wheel {res['filename']} is published, yet the build fell back to compiling"
            )
    net = ctx.network
    gpu_torch = ctx.torch.get("build") in ("cuda", "rocm")
    unreachable = bool(net) and net.get("reachable") is False
    if unreachable and gpu_torch and ctx.flash_attn_in_play and not ctx.flash_attn.get("loads"):
        evidence.append(f"{net.get('url')} cannot be reached ({net.get('error')})")
    if not evidence:
        return None
    res = ctx.resolved()
    if res["url"] and not ctx.cpu_only_torch:
        recipe = "upstream-flash-attn"
        command = (
            f"# on a machine with access: curl -LO '{res['url']}' ; copy it here, then:\n"
            f"python -m pip install ./{res['filename']}"
        )
    else:
        recipe, command = ctx.build_fix(force_build=True)
    return finding(
        "setup.py could not download the prebuilt wheel and silently falls back to an hours-long compile",
        "error" if fell_back else "warning",
        evidence,
        recipe,
        command,
        failure=8,
    )


# -- 9. file name vs METADATA version ------------------------------------------------------------
@rule("wheel-version-mismatch")
def _version_mismatch(ctx: Context, finding: Build) -> Optional[Finding]:
    evidence = [f"install log: {line}" for line in ctx.log_lines(r"inconsistent version")[:2]]
    wheel = ctx.wheel or {}
    if wheel.get("name_version") and wheel.get("metadata_version"):
        name_public = wheel["name_version"].split("+")[0]
        meta_public = wheel["metadata_version"].split("+")[0]
        if name_public != meta_public:
            evidence.append(
                f"{wheel.get('filename')}: the file name says {wheel['name_version']}, "
                f"its METADATA says {wheel['metadata_version']}"
            )
    if not evidence:
        return None
    res = ctx.resolved()
    recipe = "upstream-flash-attn"
    if ctx.cpu_only_torch:
        recipe, command = ctx.cuda_torch_fix()
    elif res["url"]:
        command = commands.install_wheel_url(res["url"], ctx.installer)
    else:
        command = "python -m pip install flash-attn==" + ctx.version
    return finding(
        "the wheel's file name and its METADATA disagree on the version (a renamed file)",
        "error",
        evidence,
        recipe,
        command,
        failure=9,
        note=(
            "Keep the release asset's name as published: METADATA says the plain version, "
            "the name adds the +cu..torch.. label."
        ),
    )


# -- 10. hollow package ----------------------------------------------------------------------------
@rule("hollow-package")
def _hollow(ctx: Context, finding: Build) -> Optional[Finding]:
    fa = ctx.flash_attn
    evidence = []
    error = fa.get("module_error") or ""
    if fa.get("installed") and "No module named 'flash_attn_2_cuda'" in error:
        evidence.append(f"import flash_attn_2_cuda: {error}")
        if fa.get("wheel_tags") == ["py3-none-any"]:
            evidence.append("the installed flash-attn wheel is tagged py3-none-any: it carries no compiled code")
    evidence += [f"log: {line}" for line in ctx.log_lines(r"No module named '?flash_attn_2_cuda'?")[:1]]
    skip = ctx.env.get("FLASH_ATTENTION_SKIP_CUDA_BUILD")
    if skip == "TRUE" and not fa.get("loads"):
        evidence.append(
            "FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE is set: a build now produces a package without its CUDA module"
        )
    if not evidence:
        return None
    recipe, command = ctx.wheel_fix()
    gpus = ctx.gpus
    if ctx.torch.get("build") == "cpu" and not (gpus.get("devices") or gpus.get("driver")):
        command = "# no GPU here: flash-attn cannot run at all; flash_recipe falls back to torch SDPA"
        recipe = "upstream-flash-attn"
        if fa.get("installed"):
            command = f"{commands.uninstall_flash_attn(ctx.installer, drop_cache=False)}   {command}"
    elif fa.get("installed"):
        # installers cache the wheel they built from the sdist: drop it or the hollow build comes back
        command = f"{commands.uninstall_flash_attn(ctx.installer)} && {command}"
    if skip is not None:
        command = f"unset FLASH_ATTENTION_SKIP_CUDA_BUILD && {command}"
    return finding(
        "flash-attn is installed without its compiled CUDA module",
        "error" if fa.get("installed") else "warning",
        evidence,
        recipe,
        command,
        failure=10,
    )


# -- 11. no prebuilt wheel for this torch --------------------------------------------------------
@rule("no-prebuilt-wheel")
def _no_wheel(ctx: Context, finding: Build) -> Optional[Finding]:
    evidence = []
    fell_back = ctx.log_lines(r"Precompiled wheel not found")
    for res in _guessed_wheels(ctx):
        if fell_back and res["status"] == "not-published":
            evidence.append(f"install log: {res['filename']} was never published, so setup.py compiled from source")
    fa = ctx.flash_attn
    torch = ctx.torch
    if ctx.flash_attn_in_play and not fa.get("loads") and torch.get("build") in ("cuda", "rocm"):
        res = ctx.resolved()
        if res["status"] == "not-published":
            evidence.append(f"{res['filename']} does not exist: {res['reason']}")
    if not evidence:
        return None
    res = ctx.resolved()
    nearest = res.get("nearest")
    note = None
    if nearest:
        differs = "; ".join(nearest["differs"]) or "same coupling"
        note = f"nearest published: {nearest['filename']} ({differs}); it only loads with that torch."
    recipe, command = ctx.build_fix(force_build=True)
    return finding(
        "upstream published no wheel for this torch/Python/ABI: pip will compile flash-attn for hours",
        "warning",
        evidence,
        recipe,
        command,
        failure=11,
        note=note,
    )


# -- a flash_attn module that no installed distribution owns ---------------------------------------
@rule("flash-attn-unowned-module")
def _unowned_module(ctx: Context, finding: Build) -> Optional[Finding]:
    fa = ctx.flash_attn
    location = fa.get("module_location")
    error = fa.get("package_error")
    if fa.get("installed") or not location or not error:
        return None
    evidence = [
        f"import flash_attn: {error}",
        f"`import flash_attn` finds {location}, which no installed flash-attn distribution owns (no dist-info: "
        "a vendored copy, a directory on PYTHONPATH, or an install whose metadata was removed)",
    ]
    parent = os.path.dirname(location)
    if any(os.path.exists(os.path.join(parent, name)) for name in ("setup.py", "pyproject.toml")):
        # a source tree (a flash-attention clone): never advise deleting it
        evidence.append(f"{parent} is a source tree: Python imports its unbuilt flash_attn from there")
        remove = f"cd ~   # run Python outside the source tree {shlex.quote(parent)}, or take it off PYTHONPATH"
    else:
        remove = f"rm -rf {shlex.quote(location)}   # or take the directory holding it off PYTHONPATH"
    stand_in = "# or run without flash-attn: call flash_recipe.install_as_flash_attn() before the imports that need it"
    if ctx.cpu_only_torch:
        recipe, fix = ctx.cuda_torch_fix()
    else:
        recipe, fix = ctx.wheel_fix()
        fix = f"{fix}   # the flash-attn wheel for this torch, Python and C++ ABI"
    return finding(
        "a flash_attn package that is not an installed distribution fails to import",
        "error",
        evidence,
        recipe,
        "\n".join([remove, fix, stand_in]),
        note=(
            "Installers cannot see or remove it, and every `import flash_attn` (transformers, ring-flash-attn, "
            "your code) raises the error above until it is gone."
        ),
    )
