"""The doctor's rules beyond building flash-attn: old GPUs, SDPA, fp32 inputs, torch, Triton,
environment switches and flash_recipe's own backends (failures 12 and 13, and the facts that
produce the others)."""

from __future__ import annotations

import re
from typing import Optional

from . import commands, versions
from .facts import GpuDevice
from .findings import Build, Context, Finding, rule
from .probes import NO_KERNEL

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
            "which falls back to torch SDPA:\n"
            + commands.install_flash_recipe(ctx.installer, ctx.release, uv_project=bool(ctx.project.get("pyproject")))
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


# -- transformers and kernels: Hub kernels (attn_implementation="org/repo") -------------------------
# The kernels releases each transformers release accepts, by transformers' own bounds:
# (first transformers, last transformers) -> (lowest kernels, the first kernels release refused).
TRANSFORMERS_KERNELS = {
    ((5, 18, 0), (5, 19, 0)): ((0, 17, 0), (0, 18, 0)),
    ((5, 20, 2), (5, 22, 2)): ((0, 17, 2), (0, 18, 0)),
    ((5, 23, 0), (5, 24, 0)): ((0, 18, 2), (0, 19, 0)),
}


def _version3(version: Optional[str]) -> Optional[tuple[int, int, int]]:
    """(major, minor, patch) of a release such as ``5.22.2`` or ``0.17.2.dev0``; None if unreadable."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)) if match else None


@rule("transformers-kernels-pair")
def _transformers_kernels(ctx: Context, finding: Build) -> Optional[Finding]:
    libraries = ctx.libraries
    transformers, kernels = _version3(libraries.get("transformers")), _version3(libraries.get("kernels"))
    if transformers is None or kernels is None:
        return None
    rows = [(first, last, accepted) for (first, last), accepted in TRANSFORMERS_KERNELS.items()]
    row = next(((first, last, accepted) for first, last, accepted in rows if first <= transformers <= last), None)
    if row is None:
        return None  # a transformers release outside the known table: nothing to say
    first, last, (low, refused) = row
    if low <= kernels < refused:
        return None
    spec = f"kernels>={_dotted(low)},<{_dotted(refused)}"
    return finding(
        f"transformers {libraries['transformers']} cannot load Hub kernels with kernels {libraries['kernels']}",
        "error",
        [
            f"transformers {_dotted(first)} to {_dotted(last)} accept {spec}; kernels {libraries['kernels']} "
            f"is installed",
            'attn_implementation="<org>/<repo>" (a Hub kernel, flash-recipe\'s among them) fails to load',
        ],
        "",  # no recipe folder: one install command is the whole fix
        commands.install_package(ctx.facts, ctx.installer, spec, ctx.project),
        note=(
            "Or move transformers to the kernels you have: transformers 5.18-5.19 take kernels 0.17.x, "
            "5.20.2-5.22.2 take 0.17.2 or newer below 0.18, 5.23-5.24 take 0.18.2 or newer below 0.19. "
            'flash-recipe from pip needs neither: attn_implementation="recipe_attention" '
            "(flash_recipe.integrations.transformers.register())."
        ),
    )
