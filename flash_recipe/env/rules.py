"""The doctor's rules: one per known FlashAttention install failure.

A rule reads the probe facts (and, when given, an install log or a wheel file) and returns a
:class:`Finding` or None. Each finding carries a severity, the evidence it saw and the fix: the
recipe folder under ``recipes/`` that documents the cure and the exact command for this
environment. Rules about *building* upstream flash-attn only speak when flash-attn is in play
(installed, declared by the project, named on the command line, a FLASH_ATTENTION_* variable is
set, or a log was given), so a healthy environment that never asked for it hears nothing.

The failure numbers (``failure=``) refer to the list of known failures in the project's field
notes (flash-attention issues #246, #931, #940, #1736, #219, #389, #773, #489, #1444, uv #17794...).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional

from flash_recipe.env import commands, versions
from flash_recipe.env.facts import (
    BackendsFacts,
    BuildToolsFacts,
    EnvVarFacts,
    Facts,
    FlashAttnFacts,
    FlexFacts,
    GpuDevice,
    GpusFacts,
    NetworkFacts,
    NvccFacts,
    PlatformFacts,
    ProjectFacts,
    SdpaFacts,
    TorchFacts,
    TritonFacts,
    WheelFileFacts,
)
from flash_recipe.env.probes import NO_KERNEL
from flash_recipe.env.published import LATEST
from flash_recipe.env.wheels import parse_wheel_filename, resolve

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass
class Finding:
    """One diagnosis: what is wrong, how we know, and the fix to paste."""

    rule: str
    title: str
    severity: str
    evidence: list[str]
    recipe: str
    command: str
    failure: Optional[int] = None
    note: Optional[str] = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Context:
    """What the rules look at: probe facts plus what the user handed the doctor.

    Rules read a probe's facts through the property of the same name (``ctx.torch``, ``ctx.gpus``),
    typed by :mod:`flash_recipe.env.facts`; a test checks that every key a rule reads there is
    declared. A probe that was not run reads as ``{}``, one that failed as ``{"error": ...}``, so
    rules read keys with ``.get()`` unless they know the probe ran.
    """

    facts: Facts
    log: Optional[str] = None
    wheel: Optional[WheelFileFacts] = None  # a wheel file named with --wheel ({"error": ...} when unreadable)
    flash_attn_version: Optional[str] = None  # asked with --flash-attn-wheel
    installer: str = "pip"
    project: ProjectFacts = dataclasses.field(default_factory=dict)  # the project probe's facts ({} when none)

    # -- each probe's facts ----------------------------------------------------------------------
    def _probe(self, name: str) -> Any:
        value = self.facts.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def platform(self) -> PlatformFacts:
        return self._probe("platform")

    @property
    def torch(self) -> TorchFacts:
        return self._probe("torch")

    @property
    def gpus(self) -> GpusFacts:
        return self._probe("gpus")

    @property
    def nvcc(self) -> NvccFacts:
        return self._probe("nvcc")

    @property
    def triton(self) -> TritonFacts:
        return self._probe("triton")

    @property
    def build(self) -> BuildToolsFacts:
        return self._probe("build")

    @property
    def env(self) -> EnvVarFacts:
        return self._probe("env")

    @property
    def flash_attn(self) -> FlashAttnFacts:
        return self._probe("flash_attn")

    @property
    def flex(self) -> FlexFacts:
        return self._probe("flex")

    @property
    def sdpa(self) -> SdpaFacts:
        return self._probe("sdpa")

    @property
    def backends(self) -> BackendsFacts:
        return self._probe("backends")

    @property
    def network(self) -> NetworkFacts:
        return self._probe("network")

    # -- shortcuts -------------------------------------------------------------------------------
    @property
    def version(self) -> str:
        fa = self.flash_attn
        if self.flash_attn_version:
            return self.flash_attn_version
        if fa.get("installed") and fa.get("version"):
            return fa["version"].split("+")[0]
        return LATEST

    @property
    def flash_attn_in_play(self) -> bool:
        env = self.env
        return bool(
            self.flash_attn.get("installed")
            or self.project.get("declares_flash_attn")
            or self.flash_attn_version
            or self.log
            or self.wheel
            or any(name.startswith("FLASH_ATTENTION_") or name.startswith("FLASH_ATTN_") for name in env)
        )

    def log_lines(self, pattern: str) -> list[str]:
        """Lines of the log matching ``pattern`` (regex), stripped and shortened."""
        if not self.log:
            return []
        rx = re.compile(pattern)
        return [line.strip()[:240] for line in self.log.splitlines() if rx.search(line)]

    def resolved(self) -> dict[str, Any]:
        """The upstream wheel for this environment (see :func:`flash_recipe.env.wheels.resolve`);
        a version whose naming is not recorded gives status ``unknown-release`` instead of raising."""
        try:
            return self._resolve()
        except ValueError as exc:
            return {
                "version": self.version,
                "filename": None,
                "url": None,
                "nearest": None,
                "status": "unknown-release",
                "reason": str(exc),
            }

    def _resolve(self) -> dict[str, Any]:
        torch = self.torch
        plat = self.platform
        return resolve(
            self.version,
            python=plat.get("python") or "3",
            torch=torch.get("version") if torch.get("installed") else None,
            cxx11abi=torch.get("cxx11abi"),
            cuda=torch.get("cuda"),
            hip=torch.get("hip"),
            platform=plat.get("wheel_platform") or "linux_x86_64",
        )

    def wheel_fix(self) -> tuple[str, str]:
        """(recipe, command) installing the published wheel for this environment, or a source build."""
        res = self.resolved()
        if res["status"] == "published":
            return "upstream-flash-attn", commands.install_wheel_url(res["url"], self.installer)
        command = commands.no_build_isolation(self.facts, self.installer, self.version, force_build=True)
        return "upstream-flash-attn", command


# A rule's finding, named after the rule: finding(title, severity, evidence, recipe, command, failure=, note=).
Build = Callable[..., Finding]
# A rule as written: it reads the context and returns finding(...) or None.
RuleFunction = Callable[[Context, Build], Optional[Finding]]
# A rule as registered: the context alone.
Rule = Callable[[Context], Optional[Finding]]
RULES: list[tuple[str, Rule]] = []


def rule(name: str) -> Callable[[RuleFunction], RuleFunction]:
    """Register a rule under ``name``, its one spelling: :data:`RULES` gets ``(name, check)`` where
    ``check(ctx)`` calls the rule with ``ctx`` and a ``finding`` builder, :class:`Finding` with
    ``rule=name`` filled in. The rule function itself is returned unchanged."""

    def register(fn: RuleFunction) -> RuleFunction:
        named = functools.partial(Finding, name)
        RULES.append((name, lambda ctx: fn(ctx, named)))
        return fn

    return register


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
    if ctx.installer == "poetry":
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
    return finding(
        "a flash-attn compile with too many parallel jobs runs out of memory (or crawls without ninja)",
        "error" if lines else "warning",
        evidence,
        "upstream-flash-attn",
        commands.no_build_isolation(ctx.facts, ctx.installer, ctx.version, force_build=True),
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
    command = (
        f"# on a machine with access: curl -LO '{res['url']}' ; copy it here, then:\n"
        f"python -m pip install ./{res['filename']}"
        if res["url"]
        else commands.no_build_isolation(ctx.facts, ctx.installer, ctx.version, force_build=True)
    )
    return finding(
        "setup.py could not download the prebuilt wheel and silently falls back to an hours-long compile",
        "error" if fell_back else "warning",
        evidence,
        "upstream-flash-attn",
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
    if res["url"]:
        command = commands.install_wheel_url(res["url"], ctx.installer)
    else:
        command = "python -m pip install flash-attn==" + ctx.version
    return finding(
        "the wheel's file name and its METADATA disagree on the version (a renamed file)",
        "error",
        evidence,
        "upstream-flash-attn",
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
    return finding(
        "upstream published no wheel for this torch/Python/ABI: pip will compile flash-attn for hours",
        "warning",
        evidence,
        "upstream-flash-attn",
        commands.no_build_isolation(ctx.facts, ctx.installer, ctx.version, force_build=True),
        failure=11,
        note=note,
    )


# -- 12. GPU older than sm80 ---------------------------------------------------------------------
# The same facts as flash_recipe.dispatch.pre_ampere_reason (a test keeps the two in step).
TURING_ISSUES = "#330, #542, #720, #887"
PRE_AMPERE_NOTE = (
    "What runs here: flash_recipe's flash_attn_func and scaled_dot_product_attention select its sdpa "
    "backend, which restricts torch SDPA to the memory-efficient kernel (math as the last resort): memory "
    "linear in sequence length, as with FlashAttention, without its speed. Why not more: Triton has no "
    "tensor-core path below sm80 (it lowers tl.dot to FMA instructions on sm75), so flash_recipe's Triton "
    "kernels need sm80 or newer, and upstream flash-attn 2 has no Turing support either (flash-attention "
    f"issues {TURING_ISSUES}). torch's own flash SDPA kernel also needs sm80: sdpa_kernel([SDPBackend."
    "FLASH_ATTENTION]) alone raises 'No available kernel. Aborting execution.' here."
)
EFFICIENT_SDPA_SNIPPET = (
    "# flash_recipe needs no change: flash_attn_func and scaled_dot_product_attention use the memory-efficient "
    "kernel here.\n"
    "# Calling torch SDPA yourself: allow the memory-efficient kernel, never FLASH_ATTENTION alone:\n"
    "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
    "with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):\n"
    "    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
    "# or let flash_recipe choose (same (batch, nheads, seqlen, headdim) layout as torch SDPA):\n"
    "from flash_recipe import scaled_dot_product_attention\n"
    "out = scaled_dot_product_attention(q, k, v, is_causal=True)"
)


def _sm(capability) -> str:
    return f"sm{capability[0]}{capability[1]}"


def _arch_name(capability) -> str:
    major, minor = capability[0], capability[1]
    if major == 7:
        return "Turing" if minor >= 5 else "Volta"
    return {6: "Pascal", 5: "Maxwell", 3: "Kepler"}.get(major, "pre-Ampere")


def _old_gpus(ctx: Context) -> list[GpuDevice]:
    """This machine's NVIDIA GPUs below sm80 (live facts: torch or nvidia-smi)."""
    return [d for d in ctx.gpus.get("devices") or [] if d.get("capability") and tuple(d["capability"]) < (8, 0)]


def _sdpa_probe_evidence(ctx: Context) -> list[str]:
    """What the live SDPA probe saw: the flash kernel alone failing (and why), the memory-efficient one."""
    kernels = ctx.sdpa.get("kernels") or {}
    flash, efficient = kernels.get("FLASH_ATTENTION") or {}, kernels.get("EFFICIENT_ATTENTION") or {}
    out = []
    if flash.get("ok") is False:
        out.append(f"live: sdpa_kernel([SDPBackend.FLASH_ATTENTION]) here raises {flash.get('error')}")
        out += [f"live: torch says: {w}" for w in _sdpa_reasons(flash.get("warnings") or [])[:2]]
    if efficient.get("ok") is True and flash.get("ok") is False:
        out.append("live: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) here runs")
    return out


_SDPA_HEADER = re.compile(r"kernel not used because:?\s*$")


def _sdpa_reasons(messages: list[str]) -> list[str]:
    """torch's reasons among its SDPA warnings: not the '... kernel not used because:' headers."""
    out = []
    for text in messages:
        text = re.sub(r"\s*\(Triggered internally at .*", "", text.split("UserWarning:", 1)[-1]).strip()
        if text and not _SDPA_HEADER.search(text) and text not in out:
            out.append(text[:240])
    return out


@rule("gpu-too-old")
def _gpu_old(ctx: Context, finding: Build) -> Optional[Finding]:
    old = _old_gpus(ctx)
    evidence = [
        f"{d['name']} is {_sm(d['capability'])} ({_arch_name(d['capability'])}): no tensor-core path in Triton, "
        "no FlashAttention-2 kernels (they need sm80 or newer)"
        for d in old
    ]
    refusals = ctx.log_lines(r"FlashAttention only supports Ampere GPUs or newer")
    upstream_refused = [f"log: {line}" for line in refusals[:2]]
    evidence += upstream_refused
    if not evidence:
        return None
    explain = ctx.backends.get("explain") or {}
    if old and explain:
        chosen = next((name for name, why in explain.items() if why is None), None)
        if chosen:
            call = ctx.backends.get("call") or "a float16 call"
            evidence.append(f"flash_recipe runs {call} with its {chosen!r} backend")
        if explain.get("triton"):
            evidence.append(f"flash_recipe's triton backend: {explain['triton']}")
    if old:
        evidence += _sdpa_probe_evidence(ctx)
    installed = ctx.flash_attn.get("installed")
    asked = ctx.project.get("declares_flash_attn") or ctx.flash_attn_version or upstream_refused
    uninstall = ""
    if installed:
        uninstall = f"{commands.uninstall_flash_attn(ctx.installer, drop_cache=False)}   # it cannot run here\n"
    if installed and old:
        severity = "error"
    elif asked or installed:
        severity = "warning"
    else:
        severity = "info"  # flash_recipe runs here; the finding says how, and what not to ask for
    return finding(
        "this GPU is older than Ampere (sm80): flash_recipe runs attention through torch SDPA's memory-efficient "
        "kernel; FlashAttention-2 kernels (upstream's or flash_recipe's Triton ones) cannot run on it",
        severity,
        evidence,
        "upstream-flash-attn",
        uninstall + EFFICIENT_SDPA_SNIPPET,
        failure=12,
        note=PRE_AMPERE_NOTE,
    )


@rule("sdpa-no-kernel")
def _sdpa_no_kernel(ctx: Context, finding: Build) -> Optional[Finding]:
    """torch SDPA limited (sdpa_kernel / enable_math=False) to kernels that cannot take the call."""
    lines = ctx.log_lines(NO_KERNEL)
    evidence = [f"log: {line}" for line in lines[:1]]
    if lines:
        warned = ctx.log_lines(
            r"sdp_utils|only supports gpu architectures|Attempting to run on a sm|has been runtime disabled"
            r"|not compiled with"
        )
        evidence += [f"log: torch says: {reason}" for reason in _sdpa_reasons(warned)[:3]]
    old = _old_gpus(ctx)
    logged = re.findall(r"Attempting to run on a sm (\d+)\.(\d+) gpu", ctx.log or "") if lines else []
    old_logged = sorted({(int(a), int(b)) for a, b in logged if (int(a), int(b)) < (8, 0)})
    live_only = False
    if not lines:
        # live: the probe restricted SDPA to its flash kernel; an old GPU is gpu-too-old's to explain
        if old:
            return None
        live = _sdpa_probe_evidence(ctx)
        if not any(NO_KERNEL_RX.search(line) for line in live):
            return None
        evidence, live_only = live, True
    if lines and old:
        evidence += [
            f"this machine's GPU: {d['name']} is {_sm(d['capability'])} ({_arch_name(d['capability'])})" for d in old
        ]
    if old:
        gpu = "this " + ", ".join(f"{d['name']} ({_sm(d['capability'])})" for d in old) + " GPU"
    else:
        gpu = ("the " + ", ".join(_sm(c) for c in old_logged) + " GPU the log names") if old_logged else ""
    if gpu:
        title = (
            f"torch SDPA was limited to its flash kernel, which needs sm80 or newer: on {gpu} no kernel "
            "was left ('No available kernel')"
        )
        note = PRE_AMPERE_NOTE
    else:
        title = "torch SDPA found no kernel it was allowed to use for this call ('No available kernel')"
        note = (
            "torch tries only the kernels sdpa_kernel([...]) (or the deprecated sdp_kernel / enable_math=False) "
            "leaves on, and prints one 'kernel not used because' warning per kernel before this error: those "
            "warnings say why each refused. Allow the memory-efficient kernel and math as fallbacks."
        )
    return finding(
        title,
        "warning" if live_only else "error",
        evidence,
        "upstream-flash-attn",
        EFFICIENT_SDPA_SNIPPET,
        failure=12,
        note=note,
    )


NO_KERNEL_RX = re.compile(NO_KERNEL)


# -- 13. fp32 inputs -----------------------------------------------------------------------------
@rule("fp32-inputs")
def _fp32(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"(only supports? fp16 and bf16|only support fp16 and bf16)")
    if not lines:
        return None
    return finding(
        "flash-attn was called with float32 tensors; it runs fp16 and bf16 only",
        "error",
        [f"log: {line}" for line in lines[:2]],
        "upstream-flash-attn",
        "q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))   # or torch.autocast('cuda', dtype=torch.bfloat16)",
        failure=13,
    )


# -- beyond the list: facts that produce the failures above --------------------------------------
@rule("torch-missing")
def _torch_missing(ctx: Context, finding: Build) -> Optional[Finding]:
    torch = ctx.torch
    if torch.get("installed") and not torch.get("import_error"):
        return None
    if not torch.get("installed"):
        evidence = ["torch is not installed in this environment"]
    else:
        evidence = [f"import torch: {torch['import_error']}"]
    return finding(
        "torch is missing or broken: neither flash_recipe nor flash-attn can run",
        "error",
        evidence,
        f"torch-index-{ctx.installer}",
        commands.install_torch(ctx.facts, ctx.installer),
        note="Install torch from the index that matches this machine before anything that builds against it.",
    )


@rule("cpu-torch-with-gpu")
def _cpu_torch_gpu(ctx: Context, finding: Build) -> Optional[Finding]:
    torch = ctx.torch
    gpus = ctx.gpus
    if torch.get("build") != "cpu" or not (gpus.get("devices") or gpus.get("driver")):
        return None
    names = ", ".join(d["name"] for d in gpus.get("devices") or []) or f"driver {gpus.get('driver')}"
    return finding(
        "an NVIDIA GPU is present but torch is a CPU-only build",
        "warning",
        [f"torch {torch.get('version')} has no CUDA; GPU: {names}"],
        f"torch-index-{ctx.installer}",
        commands.install_torch(ctx.facts, ctx.installer),
    )


@rule("cpu-torch-flash-attn")
def _cpu_torch_flash_attn(ctx: Context, finding: Build) -> Optional[Finding]:
    lines = ctx.log_lines(r"Invalid version: None")
    torch = ctx.torch
    evidence = [
        f"install log: {line} (setup.py parses torch.version.cuda, which is None on a CPU torch)" for line in lines[:1]
    ]
    if ctx.flash_attn_in_play and torch.get("build") == "cpu" and not ctx.flash_attn.get("loads"):
        evidence.append(
            f"torch {torch.get('version')} is CPU-only: flash-attn has no CPU build "
            "(flash_recipe falls back to SDPA here)"
        )
    if not evidence:
        return None
    gpus = ctx.gpus
    if gpus.get("devices") or gpus.get("driver"):
        recipe, command = f"torch-index-{ctx.installer}", commands.install_torch(ctx.facts, ctx.installer)
    else:
        evidence.append("no NVIDIA GPU or driver found on this machine")
        recipe = "upstream-flash-attn"
        command = (
            "# flash-attn cannot run without an NVIDIA (or AMD) GPU; here use flash_recipe, "
            "which falls back to torch SDPA:\n" + commands.install_flash_recipe(ctx.installer)
        )
    return finding(
        "upstream flash-attn needs a CUDA (or ROCm) build of torch",
        "error" if lines else "warning",
        evidence,
        recipe,
        command,
    )


@rule("env-switch-not-true")
def _env_switch(ctx: Context, finding: Build) -> Optional[Finding]:
    env = ctx.env
    bad = {
        name: value
        for name, value in env.items()
        if name in ("FLASH_ATTENTION_FORCE_BUILD", "FLASH_ATTENTION_SKIP_CUDA_BUILD", "FLASH_ATTENTION_FORCE_CXX11_ABI")
        and value != "TRUE"
        and value.strip().lower() in ("1", "true", "yes", "on", "y")
    }
    if not bad:
        return None
    fixed = " ".join(f"{name}=TRUE" for name in sorted(bad))
    return finding(
        "flash-attn's setup.py only honours the exact string TRUE; this switch is ignored",
        "warning",
        [f"{name}={value!r} has no effect upstream (it compares with 'TRUE')" for name, value in sorted(bad.items())],
        "upstream-flash-attn",
        f"export {fixed}",
    )


def _release(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string such as ``3.2.0+git35c6c7c6``; None if unreadable."""
    match = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _dotted(release: tuple) -> str:
    return ".".join(str(part) for part in release)


@rule("triton-too-old")
def _triton_old(ctx: Context, finding: Build) -> Optional[Finding]:
    triton = ctx.triton
    have = _release(triton.get("version")) if triton.get("installed") else None
    if have is None or have >= versions.TRITON_MIN:
        return None
    need_triton, need_torch = _dotted(versions.TRITON_MIN), _dotted(versions.TORCH_MIN)
    torch = ctx.torch
    torch_release = _release(torch.get("version")) if torch.get("installed") else None
    evidence = [f"Triton {triton['version']} is installed; flash_recipe's kernels need Triton {need_triton} or newer"]
    recipe = f"torch-index-{ctx.installer}"
    note = None
    if torch.get("build") in ("cuda", "rocm") and torch_release is not None:
        pinned = versions.TRITON_OF_TORCH.get(torch_release)
        pin = f"Triton {_dotted(pinned)}" if pinned else "one Triton release"
        if torch_release >= versions.TORCH_MIN:
            # torch is recent enough: Triton itself was changed after torch was installed
            evidence.append(f"torch {torch['version']} pins {pin}: Triton was changed after torch was installed")
            spec = f"triton=={_dotted(pinned)}.*" if pinned else f"triton>={need_triton}"
            command = commands.install_package(ctx.facts, ctx.installer, spec, ctx.project)
            note = "Reinstall the Triton this torch pins; another one conflicts with torch (and its torch.compile)."
        else:
            evidence.append(
                f"torch {torch['version']} pins {pin}: Triton comes with torch, so the fix is torch {need_torch} or "
                f"newer, whose wheels bring Triton {need_triton} or newer"
            )
            command = commands.upgrade_torch(ctx.facts, ctx.installer, need_torch, ctx.project)
            index = (ctx.project.get("torch_index") or {}).get("url") or commands.torch_index_url(ctx.facts)
            driver_cuda = ctx.gpus.get("driver_cuda")
            note = (
                f"Upgrade torch, not Triton alone: a Triton other than the one torch pins conflicts with it. "
                f"Each download.pytorch.org/whl/cuXYZ index carries a few torch releases: if {index} has none "
                f"at {need_torch} or newer, take the newest cuXYZ index"
                + (f" up to this driver's CUDA {driver_cuda}" if driver_cuda else " that the NVIDIA driver supports")
                + ". Upgrade torchvision and torchaudio in the same command if they are installed (they pin torch)."
            )
    else:
        # a CPU torch does not depend on Triton (here it only runs the interpreter): upgrade it alone
        if torch.get("installed"):
            evidence.append(f"torch {torch.get('version')} is a CPU build: it does not pin Triton")
        command = commands.install_package(ctx.facts, ctx.installer, f"triton>={need_triton}", ctx.project)
    return finding(
        f"Triton {triton['version']} is older than flash_recipe supports (Triton {need_triton}+, torch {need_torch}+)",
        "error" if torch.get("build") in ("cuda", "rocm") else "warning",
        evidence,
        recipe,
        command,
        note=note,
    )


@rule("no-backend")
def _no_backend(ctx: Context, finding: Build) -> Optional[Finding]:
    backends = ctx.backends
    explain = backends.get("explain")
    if not explain or any(reason is None for reason in explain.values()):
        return None
    return finding(
        "no flash_recipe backend can run even a plain fp16 call here",
        "error",
        [f"{name}: {reason}" for name, reason in explain.items()],
        f"torch-index-{ctx.installer}",
        commands.install_torch(ctx.facts, ctx.installer),
    )


SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def evaluate(ctx: Context) -> list[Finding]:
    """Run every rule; a rule that raises becomes an ``info`` finding naming the rule, not a crash."""
    findings = []
    for name, fn in RULES:
        try:
            found = fn(ctx)
        except Exception as exc:  # one broken rule must not hide the others
            evidence = [f"{type(exc).__name__}: {exc}"]
            found = Finding(name, f"rule {name} could not be evaluated", "info", evidence, "upstream-flash-attn", "")
        if found is not None:
            findings.append(found)
    findings.sort(key=lambda f: SEVERITY_ORDER[f.severity])
    return findings


def cited_recipes() -> set[str]:
    """Every recipe folder name a rule or ``flash-recipe recipe`` can cite (a test checks that each
    exists under recipes/)."""
    names = {"upstream-flash-attn", "pip-no-build-isolation", "uv-project", "uv-pip", "poetry-index"}
    names |= {f"torch-index-{installer}" for installer in commands.INSTALLERS}
    return names
