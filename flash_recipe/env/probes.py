"""Facts about this machine, each read by its own probe: a function returning a dict of facts,
typed by its TypedDict in :mod:`flash_recipe.env.facts`. :func:`collect` runs them one by one and
records ``{"error": ...}`` (:class:`~flash_recipe.env.facts.ProbeError`) for whatever a probe
raises, so one failing probe (no torch, no driver, a broken flash-attn) never stops the others.
Nothing imports torch at module level; probes that need it import it inside and say when it is
missing."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar, Union, cast

from .distinfo import distribution_info, probe_libraries
from .facts import (
    BackendsFacts,
    BuildToolsFacts,
    CompileCheck,
    EnvVarFacts,
    Facts,
    FlashAttnFacts,
    FlexFacts,
    GpuDevice,
    GpusFacts,
    NetworkFacts,
    NvccFacts,
    PlatformFacts,
    ProbeError,
    SdpaFacts,
    SdpaKernelResult,
    SdpaKernels,
    TorchFacts,
    TritonFacts,
)
from .wheels import parse_wheel_filename

# Environment variables that change how flash-attn's setup.py or torch's extension builder behave.
BUILD_ENV_VARS = (
    "FLASH_ATTENTION_FORCE_BUILD",
    "FLASH_ATTENTION_SKIP_CUDA_BUILD",
    "FLASH_ATTENTION_FORCE_CXX11_ABI",
    "FLASH_ATTN_CUDA_ARCHS",
    "MAX_JOBS",
    "NVCC_THREADS",
    "CUDA_HOME",
    "CUDA_PATH",
    "TORCH_CUDA_ARCH_LIST",
    "PIP_NO_BUILD_ISOLATION",
    "UV_NO_BUILD_ISOLATION",
)

# Packages flash-attn's setup.py imports once build isolation is off (facts: #453, #520, #1761).
BUILD_TOOLS = ("packaging", "wheel", "setuptools", "psutil", "ninja")

_SUBPROCESS_TIMEOUT = 60.0


def _run(cmd: list[str], timeout: float = 20.0, env: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """Run ``cmd`` and return (exit status, stdout+stderr); (127, reason) when it cannot start."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return 127, f"{type(exc).__name__}: {exc}"
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


def probe_platform() -> PlatformFacts:
    """OS, architecture, C library, Python version and ABI tag, interpreter and environment."""
    libc, libc_version = platform.libc_ver()
    abi = sysconfig.get_config_var("SOABI") or ""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        tag += "t"
    machine = platform.machine()
    system = sys.platform
    if system.startswith("linux"):
        wheel_platform = f"linux_{machine}"
    elif system == "win32":
        wheel_platform = "win_amd64"
    elif system == "darwin":
        wheel_platform = f"macosx_{machine}"
    else:
        wheel_platform = system
    return {
        "os": platform.system(),
        "machine": machine,
        "libc": libc or None,
        "libc_version": libc_version or None,
        "python": platform.python_version(),
        "python_tag": tag,
        "soabi": abi or None,
        "implementation": sys.implementation.name,
        "executable": sys.executable,
        "virtualenv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
        # a conda environment keeps its package records in conda-meta/
        "conda": os.path.isdir(os.path.join(sys.prefix, "conda-meta")),
        "wheel_platform": wheel_platform,
        "cpu_count": os.cpu_count(),
        "mem_available_gib": _mem_available_gib(),
    }


def _mem_available_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / (1024 * 1024), 1)
    except OSError:
        return None
    return None


def probe_torch() -> TorchFacts:
    """torch's version, CUDA / HIP build, C++11 ABI flag, and whether a GPU is usable."""
    dist = distribution_info("torch")
    out: TorchFacts = {"installed": dist["installed"], "version": dist.get("version")}
    if not dist["installed"]:
        return out
    out["installer"] = dist.get("installer")  # pip, uv, conda, ... (who must upgrade it)
    try:
        import torch
    except Exception as exc:  # a torch that is installed but cannot import is a fact, not a crash
        out["import_error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["version"] = torch.__version__
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["hip"] = getattr(torch.version, "hip", None)
    out["cxx11abi"] = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    out["build"] = "cuda" if out["cuda"] else ("rocm" if out["hip"] else "cpu")
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    except Exception as exc:
        out["cuda_available"] = False
        out["device_count"] = 0
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return out


def probe_gpus() -> GpusFacts:
    """Each GPU's name, compute capability, shared memory per block; the driver version.

    Read through torch when it has a usable GPU; otherwise through ``nvidia-smi`` (which knows the
    driver even when torch is missing or CPU-only).
    """
    out: GpusFacts = {"devices": [], "driver": None, "driver_cuda": None, "source": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        code, text = _run([smi])
        match = re.search(r"Driver Version:\s*([\d.]+)", text)
        if match:
            out["driver"] = match.group(1)
        match = re.search(r"CUDA Version:\s*([\d.]+)", text)
        if match:
            out["driver_cuda"] = match.group(1)
        code, text = _run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        if code == 0:
            for line in text.strip().splitlines():
                name, _, cap = line.rpartition(",")
                try:
                    major, minor = (int(x) for x in cap.strip().split("."))
                except ValueError:
                    continue
                out["devices"].append(
                    {"name": name.strip(), "capability": [major, minor], "shared_memory_per_block": None}
                )
            out["source"] = "nvidia-smi"
    elif os.path.exists("/proc/driver/nvidia/version"):
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as handle:
            match = re.search(r"Kernel Module\s+([\d.]+)", handle.read())
        if match:
            out["driver"] = match.group(1)
    if not distribution_info("torch")["installed"]:
        return out
    try:
        import torch

        if not torch.cuda.is_available():
            return out
        devices: list[GpuDevice] = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "name": props.name,
                    "capability": [props.major, props.minor],
                    "shared_memory_per_block": getattr(props, "shared_memory_per_block_optin", None)
                    or getattr(props, "shared_memory_per_block", None),
                    "total_memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
        out["devices"] = devices
        out["source"] = "torch"
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    return out


def probe_nvcc() -> NvccFacts:
    """Where nvcc is and which CUDA release it is; CUDA_HOME as torch's extension builder sees it."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = []
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        candidates.append(found)
    candidates.append("/usr/local/cuda/bin/nvcc")
    path = next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)
    out: NvccFacts = {"path": path, "version": None, "cuda_home": cuda_home, "on_path": found is not None}
    if path:
        code, text = _run([path, "--version"])
        match = re.search(r"release (\d+\.\d+)", text)
        out["version"] = match.group(1) if match else None
        if not match:
            out["error"] = text.strip().splitlines()[-1] if text.strip() else f"exit status {code}"
    return out


def probe_triton() -> TritonFacts:
    """Triton's version and the GPU target it would compile for (none without a GPU)."""
    dist = distribution_info("triton")
    if not dist["installed"]:  # triton-windows installs the same ``triton`` module on Windows
        dist = distribution_info("triton-windows")
    out: TritonFacts = {"installed": dist["installed"], "version": dist.get("version"), "target": None}
    if not dist["installed"]:
        return out
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
        out["target"] = f"{target.backend}:{target.arch}"
    except Exception as exc:
        out["target_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return out
    arch = f"sm{target.arch}" if target.backend == "cuda" else str(target.arch).split(":")[0]
    out["compile"] = triton_compile_check(arch)
    return out


def triton_compile_check(arch: str) -> CompileCheck:
    """Compile flash_recipe's fp16 causal forward kernel (head dim 64) for ``arch`` (``"sm90"``,
    ``"gfx942"``) and report whether it compiled, its shared memory against the architecture's
    limit, and the time taken. Needs no GPU: Triton compiles for a named target anywhere."""
    try:
        # Imported here, as torch is in every probe: a broken install still gets its report.
        from ..ops import configs, targets
    except Exception as exc:
        return {"arch": arch, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if arch not in configs.SHARED_MEMORY_LIMIT:
        try:
            family = configs.arch_family(arch)
        except ValueError as exc:
            return {"arch": arch, "ok": False, "error": str(exc)}
        return {
            "arch": arch,
            "ok": None,
            "error": (
                f"{arch} has no configuration table of its own: flash_recipe uses its most conservative one "
                f"({family}, sized for {configs.FAMILY_SHARED_MEMORY[family]} bytes of shared memory per block) "
                f"when this GPU offers that much, and torch SDPA otherwise (flash_recipe.explain says which)"
            ),
        }
    if targets.interpreter_enabled():
        return {
            "arch": arch,
            "ok": None,
            "error": "TRITON_INTERPRET is set: kernels run in Triton's CPU interpreter, nothing is compiled",
        }
    try:
        row = _compile_forward(arch)
    except Exception as exc:  # the compiler's own message is the useful fact
        return {"arch": arch, "ok": False, "error": f"{type(exc).__name__}: {exc}".strip()[:500]}
    if not row["ok"]:
        row["error"] = "; ".join(row["problems"])
    return row


def _compile_forward(arch: str) -> CompileCheck:
    """The forward launch of an fp16 causal attention (batch 2, 1024 queries and keys, 4 heads of
    dim 64) on CPU tensors, compiled for ``arch`` through Triton's launch path (``ops.offline``)."""
    import torch  # as in every probe: importing the doctor imports no torch

    from ..ops import configs, forward, offline  # imports torch and Triton: the doctor starts without them
    from ..ops.options import ScoreOptions  # imports torch: the doctor starts without it

    q, k, v = (torch.randn(2, 1024, 4, 64, dtype=torch.float16) for _ in range(3))
    causal = ScoreOptions(
        softmax_scale=64**-0.5, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )
    start = time.perf_counter()
    with offline.offline_launches(arch) as compiled:
        forward.attention_forward(q, k, v, causal)
    seconds = round(time.perf_counter() - start, 2)
    ((_, kernel),) = compiled
    shared, limit = kernel.metadata.shared, configs.SHARED_MEMORY_LIMIT[arch]
    problems = [f"shared memory {shared} B over the {limit} B limit"] if shared > limit else []
    return {
        "arch": arch,
        "ok": not problems,
        "case": "fwd-float16-d64-aligned",
        "shared_bytes": shared,
        "shared_limit": limit,
        "num_warps": kernel.metadata.num_warps,
        "num_stages": kernel.metadata.num_stages,
        "seconds": seconds,
        "problems": problems,
    }


def probe_build_tools() -> BuildToolsFacts:
    """ninja on PATH and the Python build tools a non-isolated flash-attn build imports."""
    ninja = shutil.which("ninja")
    version = None
    if ninja:
        code, text = _run([ninja, "--version"])
        version = text.strip() if code == 0 else None
    packages = {name: distribution_info(name).get("version") for name in BUILD_TOOLS}
    return {
        "ninja": ninja,
        "ninja_version": version,
        "packages": packages,
        # the ninja binary on PATH serves as well as the ninja Python package
        "missing": [name for name, ver in packages.items() if ver is None and not (name == "ninja" and ninja)],
    }


def probe_env_vars() -> EnvVarFacts:
    """The build-related environment variables that are set, verbatim."""
    return {name: os.environ[name] for name in BUILD_ENV_VARS if name in os.environ}


# Run in a child process so that a compiled module that crashes on import cannot take the doctor
# down with it. torch is imported first, as flash_attn itself does, so that c10's symbols resolve.
_LOAD_SCRIPT = r"""
import json, sys
out = {}
try:
    import torch  # noqa: F401
except Exception as exc:
    out["torch"] = f"{type(exc).__name__}: {exc}"
for name in ("flash_attn_2_cuda", "flash_attn"):
    try:
        __import__(name)
        out[name] = None
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print("\n" + MARKER + json.dumps(out))
"""
_LOAD_MARKER = "flash-recipe-probe: "


def _module_location(name: str) -> Optional[str]:
    """Where ``import name`` would find the top-level module or package, without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = spec.submodule_search_locations
    location = str(next(iter(locations))) if locations else spec.origin
    # flash_recipe's own stand-in, when this process installed it, is not a flash_attn on the path
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if location and os.path.abspath(location).startswith(own + os.sep):
        return None
    return location


def probe_flash_attn(load: bool = True) -> FlashAttnFacts:
    """Upstream flash-attn: installed or not, versions, wheel tags, compiled module, installer; and
    where ``import flash_attn`` finds a package, which a vendored copy or a half-removed install
    provides without any distribution metadata."""
    dist = distribution_info("flash-attn")
    out = cast(FlashAttnFacts, dict(dist))
    out["module_location"] = _module_location("flash_attn")
    if not dist["installed"]:
        if out["module_location"] and load:
            out.update(_import_check())
        return out
    from importlib import metadata

    try:
        files = metadata.distribution("flash-attn").files or []
        d = metadata.distribution("flash-attn")
        wheel_meta = d.read_text("WHEEL") or ""
    except Exception:  # pragma: no cover - the distribution vanished between two reads
        files, wheel_meta = [], ""
    out["wheel_tags"] = re.findall(r"^Tag:\s*(\S+)", wheel_meta, re.MULTILINE)
    out["extension_files"] = sorted(str(f) for f in files if re.match(r"^flash_attn_2_cuda.*\.(so|pyd)$", str(f)))
    url = dist.get("direct_url") or ""
    name = url.rstrip("/").rsplit("/", 1)[-1].replace("%2B", "+") if url.endswith(".whl") else None
    out["wheel_filename"] = name
    if name:
        try:
            out["wheel_name_parts"] = parse_wheel_filename(name)
        except ValueError:
            out["wheel_name_parts"] = None
    if load:
        out.update(_import_check())
    return out


def _import_check() -> FlashAttnFacts:
    """Import ``flash_attn_2_cuda`` and ``flash_attn`` in a child process: ``module_error``,
    ``package_error`` (each the exception verbatim, or None) and ``loads``."""
    script = _LOAD_SCRIPT.replace("MARKER", repr(_LOAD_MARKER))
    code, text = _run([sys.executable, "-c", script], timeout=_SUBPROCESS_TIMEOUT, env=dict(os.environ))
    line = next((ln for ln in text.splitlines() if ln.startswith(_LOAD_MARKER)), "")
    try:
        import json

        result = json.loads(line[len(_LOAD_MARKER) :])
    except ValueError:
        result = {"flash_attn_2_cuda": f"the import check exited with status {code}: {text.strip()[-300:]}"}
    return {
        "module_error": result.get("flash_attn_2_cuda"),
        "package_error": result.get("flash_attn"),
        "loads": result.get("flash_attn_2_cuda") is None,
    }


def probe_flex() -> FlexFacts:
    """What FlexAttention needs: torch >= 2.5 (the module), a CUDA device; it has no build step."""
    out: FlexFacts = {"module": False, "torch_ok": False, "device": False}
    dist = distribution_info("torch")
    if not dist["installed"]:
        out["reason"] = "torch is not installed"
        return out
    match = re.match(r"^(\d+)\.(\d+)", dist["version"])
    out["torch_ok"] = bool(match) and (int(match.group(1)), int(match.group(2))) >= (2, 5)
    try:
        import importlib

        importlib.import_module("torch.nn.attention.flex_attention")
        out["module"] = True
    except Exception as exc:
        out["module_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        out["device"] = bool(torch.cuda.is_available())
    except Exception as exc:
        out["device_error"] = f"{type(exc).__name__}: {exc}"
    return out


def probe_backends() -> BackendsFacts:
    """Which flash_recipe backends can run here, and why not, for a small fp16 causal call."""
    from ..dispatch import BACKENDS  # imports torch: the doctor starts without it

    availability = {}
    for backend in BACKENDS:
        try:
            availability[backend.name] = backend.is_available()
        except Exception as exc:
            availability[backend.name] = f"is_available() raised {type(exc).__name__}: {exc}"
    import torch

    from .. import explain  # imports torch: the doctor starts without it

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.zeros(1, 16, 2, 64, dtype=torch.float16, device=device)
    return {
        "available": availability,
        "call": f"q, k, v of shape (1, 16, 2, 64), float16, on {device}, causal=True",
        "explain": explain(q, q, q, causal=True),
    }


# torch's own words when SDPA finds no kernel it is allowed to use (sdp_utils.cpp: the error, then
# one "... kernel not used because:" warning per kernel, each followed by its reasons).
NO_KERNEL = r"No available kernel\.?\s*Aborting execution|No available kernel"


def probe_sdpa() -> SdpaFacts:
    """torch SDPA on this machine's first GPU restricted to one kernel at a time: flash (what
    ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` gives) and memory-efficient. Each gets ``ok`` and,
    when it fails, torch's error and the warnings that say why (a GPU below sm80 has no flash kernel:
    "No available kernel. Aborting execution."). Without a usable GPU, nothing runs."""
    out: SdpaFacts = {"device": None, "kernels": {}}
    if not distribution_info("torch")["installed"]:
        out["reason"] = "torch is not installed"
        return out
    import torch

    if not torch.cuda.is_available():
        out["reason"] = "no GPU that torch can use"
        return out
    major, minor = torch.cuda.get_device_capability(0)
    out["device"] = {"name": torch.cuda.get_device_name(0), "capability": [major, minor]}
    out["kernels"] = sdpa_kernel_check("cuda")
    return out


def sdpa_kernel_check(device: str) -> SdpaKernels:
    """Run a small float16 causal SDPA call on ``device`` once per kernel (``FLASH_ATTENTION``,
    ``EFFICIENT_ATTENTION``), each alone; kernel -> ``{"ok", "error", "warnings"}``."""
    import warnings

    import torch

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:  # torch < 2.3
        return {"error": f"{type(exc).__name__}: {exc}"}
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float16, device=device)
    results: SdpaKernels = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                ok, error = True, None
            except RuntimeError as exc:  # torch's refusal ("No available kernel") is the fact sought
                ok, error = False, f"{type(exc).__name__}: {exc}".strip()[:300]
        # torch appends "(Triggered internally at .../sdp_utils.cpp:NNN.)": keep the message
        messages = [re.sub(r"\s*\(Triggered internally at .*", "", str(w.message)).strip()[:240] for w in caught]
        result: SdpaKernelResult = {"ok": ok, "error": error, "warnings": messages}
        results[name] = result
    return results


def probe_network(url: Optional[str] = None, timeout: float = 5.0) -> NetworkFacts:
    """Whether the upstream release download host answers (only run when asked: it goes online)."""
    import urllib.error
    import urllib.request

    target = url or "https://github.com/Dao-AILab/flash-attention/releases"
    start = time.monotonic()
    try:
        request = urllib.request.Request(target, method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - fixed https/http URL
            status = response.status
        return {"url": target, "reachable": True, "status": status, "seconds": round(time.monotonic() - start, 2)}
    except urllib.error.HTTPError as exc:
        # the host answered: the network path works even if this file does not exist
        return {"url": target, "reachable": True, "status": exc.code, "seconds": round(time.monotonic() - start, 2)}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return {"url": target, "reachable": False, "error": f"{type(exc).__name__}: {reason}"}


# A probe: no arguments, a dict of facts (its TypedDict in flash_recipe.env.facts).
Probe = Callable[[], Mapping[str, Any]]
FactsT = TypeVar("FactsT", bound=Mapping[str, Any])

PROBES: dict[str, Probe] = {
    "platform": probe_platform,
    "torch": probe_torch,
    "gpus": probe_gpus,
    "nvcc": probe_nvcc,
    "triton": probe_triton,
    "build": probe_build_tools,
    "env": probe_env_vars,
    "flash_attn": probe_flash_attn,
    "flex": probe_flex,
    "sdpa": probe_sdpa,
    "backends": probe_backends,
    "libraries": probe_libraries,
}


def run_probe(name: str, probe: Callable[[], FactsT]) -> Union[FactsT, ProbeError]:
    """Run one probe; whatever it raises becomes ``{"error": ...}`` instead of propagating."""
    try:
        return probe()
    except BaseException as exc:  # noqa: BLE001 - isolation is the point; KeyboardInterrupt still ends the run
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"error": f"{type(exc).__name__}: {exc}".strip()[:500]}


def collect(names: Optional[list[str]] = None, extra: Optional[dict[str, Probe]] = None) -> Facts:
    """Run the probes named in ``names`` (all of :data:`PROBES` by default) plus every probe in
    ``extra``; returns name -> facts (:class:`~flash_recipe.env.facts.Facts`; an ``extra`` probe's
    entry is there too, under its own name)."""
    if names is None:
        probes = dict(PROBES)
    else:
        unknown = sorted(set(names) - set(PROBES))
        if unknown:
            raise ValueError(f"names must be among {sorted(PROBES)}, got unknown {unknown}")
        probes = {name: PROBES[name] for name in names}
    probes.update(extra or {})
    return cast(Facts, {name: run_probe(name, probe) for name, probe in probes.items()})
