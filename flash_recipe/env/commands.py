"""The exact shell commands the doctor and ``flash-recipe recipe`` print for this environment.

Each function takes the probe facts (see :mod:`flash_recipe.env.probes`) and returns a command
string ready to paste. Nothing here runs a command.
"""

from __future__ import annotations

from typing import Any, Optional

INSTALLERS = ("pip", "uv", "poetry")

TORCH_INDEX = "https://download.pytorch.org/whl/{label}"


def _check_installer(installer: str) -> None:
    if installer not in INSTALLERS:
        raise ValueError(f"installer must be one of {', '.join(INSTALLERS)}, got {installer!r}")


def max_jobs(facts: dict[str, Any]) -> int:
    """Upstream setup.py's own choice of MAX_JOBS: half the cores, at most one job per 9 GB free.

    flash-attn 2.8.3's ``NinjaBuildExtension`` uses ``min(cpu_count // 2, free_GB / 9)`` (at least
    1), noting that each nvcc job peaks at 8-9 GB with NVCC_THREADS=4.
    """
    plat = facts.get("platform", {})
    cores = plat.get("cpu_count") or 1
    free = plat.get("mem_available_gib")
    by_cores = max(1, cores // 2)
    if free is None:
        return by_cores
    return max(1, min(by_cores, int(free / 9)))


def torch_index_label(facts: dict[str, Any]) -> Optional[str]:
    """The download.pytorch.org index for this machine: the installed torch's build (``cu128``,
    ``rocm6.3``, ``cpu``) or, without torch, ``cpu`` when no NVIDIA driver is seen; None when a
    driver is seen but no torch tells which CUDA build to take."""
    torch = facts.get("torch", {})
    if torch.get("cuda"):
        major, minor = torch["cuda"].split(".")[:2]
        return f"cu{major}{minor}"
    if torch.get("hip"):
        major, minor = torch["hip"].split(".")[:2]
        return f"rocm{major}.{minor}"
    gpus = facts.get("gpus", {})
    if gpus.get("driver") or gpus.get("devices"):
        return None
    return "cpu"


def torch_index_url(facts: dict[str, Any]) -> str:
    label = torch_index_label(facts)
    if label is None:
        cuda = facts.get("gpus", {}).get("driver_cuda")
        hint = f"cu{cuda.replace('.', '')}" if cuda else "cuXYZ"
        return TORCH_INDEX.format(label=hint)
    return TORCH_INDEX.format(label=label)


def install_torch(facts: dict[str, Any], installer: str) -> str:
    """Install torch from the dedicated index matching this machine."""
    _check_installer(installer)
    url = torch_index_url(facts)
    if installer == "pip":
        return f"python -m pip install torch --index-url {url}"
    if installer == "uv":
        return (
            f'uv add torch --index pytorch={url}   # writes [[tool.uv.index]] and [tool.uv.sources] torch = {{ index = "pytorch" }}'
        )
    return f"poetry source add --priority=explicit pytorch {url} && poetry add --source pytorch torch"


def install_flash_recipe(installer: str) -> str:
    _check_installer(installer)
    return {"pip": "python -m pip install flash-recipe", "uv": "uv add flash-recipe", "poetry": "poetry add flash-recipe"}[
        installer
    ]


def install_wheel_url(url: str, installer: str) -> str:
    """Install one upstream flash-attn wheel by its release URL."""
    _check_installer(installer)
    if installer == "pip":
        return f'python -m pip install "{url}"'
    if installer == "uv":
        return f'uv add "flash-attn @ {url}"'
    return f'poetry add "{url}"'


def build_tools(installer: str) -> str:
    _check_installer(installer)
    tools = "packaging wheel setuptools psutil ninja"
    return {"pip": f"python -m pip install {tools}", "uv": f"uv pip install {tools}", "poetry": f"poetry run pip install {tools}"}[
        installer
    ]


def no_build_isolation(facts: dict[str, Any], installer: str, version: str, force_build: bool = False) -> str:
    """Build or fetch flash-attn against the torch already installed (build isolation off)."""
    _check_installer(installer)
    prefix = f"MAX_JOBS={max_jobs(facts)} "
    if force_build:
        prefix = "FLASH_ATTENTION_FORCE_BUILD=TRUE " + prefix
    if installer == "uv":
        return (
            "# pyproject.toml\n"
            "[tool.uv]\n"
            'no-build-isolation-package = ["flash-attn"]\n'
            "# or: [tool.uv.extra-build-dependencies]\n"
            '#     flash-attn = [{ requirement = "torch", match-runtime = true }]\n'
            f"{build_tools('uv')} && {prefix}uv add flash-attn=={version}"
        )
    if installer == "poetry":
        return f"{build_tools('poetry')} && {prefix}poetry run pip install --no-build-isolation flash-attn=={version}"
    return f"{build_tools('pip')} && {prefix}python -m pip install --no-build-isolation flash-attn=={version}"


def uninstall_flash_attn(installer: str, drop_cache: bool = True) -> str:
    """Remove an installed flash-attn and (by default) the wheel the installer cached for it, so
    that a broken build is not served again from the cache."""
    _check_installer(installer)
    if installer == "uv":
        return "uv pip uninstall flash-attn" + (" && uv cache clean flash-attn" if drop_cache else "")
    run = "poetry run " if installer == "poetry" else ""
    python = "pip" if run else "python -m pip"
    return f"{run}{python} uninstall -y flash-attn" + (f" && {run}{python} cache remove flash_attn" if drop_cache else "")
