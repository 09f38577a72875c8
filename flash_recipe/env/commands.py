"""The exact shell commands the doctor and ``flash-recipe recipe`` print for this environment.

Each function takes the probe facts (see :mod:`flash_recipe.env.probes`) and returns a command
string ready to paste. Nothing here runs a command.
"""

from __future__ import annotations

import shlex
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
            f"uv add torch --index pytorch={url}   "
            '# writes [[tool.uv.index]] and [tool.uv.sources] torch = { index = "pytorch" }'
        )
    return f"poetry source add --priority=explicit pytorch {url} && poetry add --source pytorch torch"


# The CUDA torch index offered when no NVIDIA driver says which CUDA it supports.
DEFAULT_CUDA_LABEL = "cu128"


def install_cuda_torch(facts: dict[str, Any], installer: str) -> str:
    """Replace a CPU-only torch with a CUDA build: from the index of the driver's CUDA when a
    driver is seen, else from ``DEFAULT_CUDA_LABEL``'s (a comment says to pick the driver's)."""
    _check_installer(installer)
    driver = (facts.get("gpus") or {}).get("driver_cuda")
    label = "cu" + "".join(driver.split(".")[:2]) if driver else DEFAULT_CUDA_LABEL
    url = TORCH_INDEX.format(label=label)
    hint = "" if driver else f"   # {label}: or the cuXYZ index of the CUDA your NVIDIA driver supports"
    if installer == "pip":
        return f"python -m pip uninstall -y torch && python -m pip install torch --index-url {url}{hint}"
    project = facts.get("project") or {}
    if installer == "uv":
        if project.get("pyproject"):
            return f"uv add torch --index pytorch={url}{hint}"
        return f"uv pip uninstall torch && uv pip install torch --index-url {url}{hint}"
    return f"poetry source add --priority=explicit pytorch {url} && poetry add --source pytorch torch{hint}"


def upgrade_torch(facts: dict[str, Any], installer: str, minimum: str, project: Optional[dict[str, Any]] = None) -> str:
    """Upgrade torch to ``minimum`` or newer from the index this environment takes torch from: the
    project's own torch index when the probes found one, else the download.pytorch.org index of
    the installed build. Each torch wheel brings the Triton it pins. A torch that conda installed
    is upgraded with conda (conda-forge: the pytorch channel publishes nothing after 2.5).
    ``project``: the project probe's facts (default: ``facts["project"]``)."""
    _check_installer(installer)
    spec = f'"torch>={minimum}"'
    if (facts.get("torch") or {}).get("installer") == "conda":
        return f'conda install -c conda-forge "pytorch>={minimum}"   # conda-forge: the pytorch channel stops at 2.5'
    project = project if project is not None else facts.get("project") or {}
    index = project.get("torch_index") or {}
    url = index.get("url") or torch_index_url(facts)
    if installer == "poetry":
        if index.get("url"):
            return f"poetry add --source {index['name']} {spec}"
        return f"poetry source add --priority=explicit pytorch {url} && poetry add --source pytorch {spec}"
    if installer == "uv":
        if not project.get("pyproject"):
            return f"uv pip install --upgrade {spec} --index-url {url}"
        if index.get("pinned"):
            return f"uv add {spec}   # [tool.uv.sources] keeps torch on the index {index['name']!r}"
        return f"uv add {spec} --index {index.get('name') or 'pytorch'}={url}"
    return f"python -m pip install --upgrade {spec} --index-url {url}"


def install_package(
    facts: dict[str, Any], installer: str, requirement: str, project: Optional[dict[str, Any]] = None
) -> str:
    """Install or upgrade one requirement (``"triton>=3.2"``) with the installer (uv: into the
    project when there is one; ``project`` defaults to ``facts["project"]``)."""
    _check_installer(installer)
    spec = f'"{requirement}"'
    if installer == "poetry":
        return f"poetry add {spec}"
    if installer == "uv":
        project = project if project is not None else facts.get("project") or {}
        return f"uv add {spec}" if project.get("pyproject") else f"uv pip install --upgrade {spec}"
    return f"python -m pip install --upgrade {spec}"


def install_flash_recipe(installer: str, release: Optional[dict[str, Any]] = None, uv_project: bool = True) -> str:
    """Install flash-recipe with ``installer`` from where it can be had (``release``: the facts of
    :func:`flash_recipe.env.release.probe_release`): the package index only where the configured
    index serves it; else the checkout flash_recipe runs from; else the git repository.
    ``uv_project``: a uv project (``uv add``) rather than a plain environment (``uv pip install``)."""
    _check_installer(installer)
    release = release or {}
    url = release.get("repository")
    if release.get("on_index") or not (release.get("checkout") or url):
        source = {"pip": "flash-recipe", "uv": "flash-recipe", "poetry": "flash-recipe"}
    elif release.get("checkout"):
        path = shlex.quote(release["checkout"])
        source = {"pip": path, "uv": path, "poetry": path}
    else:
        source = {"pip": f'"flash-recipe @ git+{url}"', "uv": f'"flash-recipe @ git+{url}"', "poetry": f'"git+{url}"'}
    uv = "uv add" if uv_project else "uv pip install"
    command = {"pip": "python -m pip install", "uv": uv, "poetry": "poetry add"}[installer]
    line = f"{command} {source[installer]}"
    if not release.get("on_index") and line.endswith(" flash-recipe"):
        line += "   # not found on the configured index; the repository is not known here"
    return line


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
    return {
        "pip": f"python -m pip install {tools}",
        "uv": f"uv pip install {tools}",
        "poetry": f"poetry run pip install {tools}",
    }[installer]


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
    return f"{run}{python} uninstall -y flash-attn" + (
        f" && {run}{python} cache remove flash_attn" if drop_cache else ""
    )
