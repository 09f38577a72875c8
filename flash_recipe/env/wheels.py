"""Upstream flash-attn wheel names: build them for an environment, parse them, look them up.

Upstream's ``setup.py`` guesses a release asset name from the running interpreter and torch::

    flash_attn-{version}+cu{CUDA}torch{major.minor}cxx11abi{TRUE|FALSE}-cp{XY}-cp{XY}-{platform}.whl

under ``https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/``. ``CUDA`` is
read from ``torch.version.cuda`` (not from nvcc): since 2.7.0 only its major number (``cu12``);
2.6.x rounded it to the one minor it built (``cu118`` for CUDA 11, ``cu123`` for CUDA 12). ROCm
torch gets ``+rocm{major}{minor}`` (upstream publishes no ROCm wheels). The platform is
``linux_{machine}``. Which names a release really published is data in
:mod:`flash_recipe.env.published`; nothing here guesses it.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Optional

from .published import LATEST, RELEASES

BASE_URL = "https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/{filename}"

_NAME_RE = re.compile(
    r"^flash_attn-(?P<version>\d+(?:\.\d+)*(?:\.post\d+)?)"
    r"\+(?:cu(?P<cuda>\d+)|rocm(?P<rocm>\d+))torch(?P<torch>\d+\.\d+(?:\.\d+)?)"
    r"cxx11abi(?P<abi>TRUE|FALSE)"
    r"-(?P<python>cp\d+)-(?P<abi_tag>cp\d+t?|abi3|none)-(?P<platform>[A-Za-z0-9_.]+)\.whl$"
)


def release_tuple(version: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``; raises ValueError for a malformed version."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.post\d+)?$", version)
    if not match:
        raise ValueError(f"flash-attn version must look like 2.8.3 or 2.7.4.post1, got {version!r}")
    return tuple(int(part) for part in match.groups(default="0"))


def _major_minor(version: str, what: str) -> tuple[int, int]:
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if not match:
        raise ValueError(f"{what} must start with MAJOR.MINOR, got {version!r}")
    return int(match.group(1)), int(match.group(2))


def cuda_label(flash_version: str, cuda: str) -> str:
    """The ``cu..`` part upstream puts in the name of ``flash_version`` for torch built with ``cuda``.

    >>> cuda_label("2.8.3", "12.8"), cuda_label("2.6.3", "12.4"), cuda_label("2.6.3", "11.8")
    ('cu12', 'cu123', 'cu118')
    """
    release = release_tuple(flash_version)
    match = re.match(r"^(\d+)(?:\.\d+)*$", str(cuda).split("+")[0])
    if not match:
        raise ValueError(f"cuda must be a CUDA version such as 12.8 or 12, got {cuda!r}")
    major = int(match.group(1))
    if release >= (2, 7, 0):
        return f"cu{major}"
    if release >= (2, 6, 0):
        if major == 11:
            return "cu118"
        if major == 12:
            return "cu123"
        raise ValueError(f"flash-attn {flash_version} named wheels for CUDA 11 or 12 only, got CUDA {cuda}")
    raise ValueError(
        f"flash-attn version must be 2.6.0 or newer for the wheel naming recorded here, got {flash_version!r}"
    )


def wheel_filename(
    flash_version: str,
    *,
    python: str,
    torch: str,
    cxx11abi: bool,
    cuda: Optional[str] = None,
    hip: Optional[str] = None,
    platform: str = "linux_x86_64",
) -> str:
    """Build the asset name upstream's setup.py looks for.

    ``python`` is ``"3.12"``, ``torch`` a torch version (``"2.8.0+cu128"``), ``cuda`` the value of
    ``torch.version.cuda`` and ``hip`` that of ``torch.version.hip`` (give one of the two).
    """
    if not isinstance(cxx11abi, bool):
        raise TypeError(f"cxx11abi must be a bool, got {type(cxx11abi).__name__}")
    if (cuda is None) == (hip is None):
        raise ValueError(f"give exactly one of cuda or hip, got cuda={cuda!r}, hip={hip!r}")
    py_major, py_minor = _major_minor(python, "python version")
    t_major, t_minor = _major_minor(torch, "torch version")
    if cuda is not None:
        device = cuda_label(flash_version, cuda)
    else:
        release_tuple(flash_version)
        h_major, h_minor = _major_minor(hip, "HIP version")
        device = f"rocm{h_major}{h_minor}"
    tag = f"cp{py_major}{py_minor}"
    abi = "TRUE" if cxx11abi else "FALSE"
    return f"flash_attn-{flash_version}+{device}torch{t_major}.{t_minor}cxx11abi{abi}-{tag}-{tag}-{platform}.whl"


def wheel_url(flash_version: str, filename: str) -> str:
    """The release download URL of ``filename``."""
    return BASE_URL.format(version=flash_version, filename=filename)


def parse_wheel_filename(filename: str) -> dict[str, Any]:
    """Split an upstream asset name into its parts.

    Returns ``version``, ``cuda_label`` (``"cu12"``, ``"rocm63"``...), ``torch`` (``"2.8"``),
    ``cxx11abi`` (bool), ``python`` (``"3.12"``), ``python_tag`` (``"cp312"``) and ``platform``.
    Raises ValueError when the name does not follow upstream's pattern (a plain
    ``flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl`` from a local build carries no coupling).
    """
    if not isinstance(filename, str):
        raise TypeError(f"filename must be a str, got {type(filename).__name__}")
    base = filename.rsplit("/", 1)[-1].replace("%2B", "+").replace("%2b", "+")
    match = _NAME_RE.match(base)
    if not match:
        raise ValueError(
            "filename must look like flash_attn-VERSION+cuXXtorchX.Ycxx11abiTRUE|FALSE-cpXY-cpXY-PLATFORM.whl, "
            f"got {filename!r}"
        )
    parts = match.groupdict()
    tag = parts["python"]
    return {
        "version": parts["version"],
        "cuda_label": f"cu{parts['cuda']}" if parts["cuda"] else f"rocm{parts['rocm']}",
        "torch": ".".join(parts["torch"].split(".")[:2]),
        "cxx11abi": parts["abi"] == "TRUE",
        "python": f"{tag[2]}.{tag[3:]}",
        "python_tag": tag,
        "platform": parts["platform"],
    }


def published_filenames(flash_version: str) -> Optional[list[str]]:
    """Every asset name recorded for ``flash_version``: all of them for a release whose matrix is
    recorded, the confirmed ones otherwise; None for a release not recorded at all."""
    release = RELEASES.get(flash_version)
    if release is None:
        return None
    if "matrix" in release:
        axes = release["matrix"]
        return [
            wheel_filename(flash_version, python=py, torch=t, cxx11abi=abi, cuda=cu, platform=plat)
            for py, t, cu, abi, plat in itertools.product(
                axes["python"], axes["torch"], axes["cuda"], axes["cxx11abi"], axes["platform"]
            )
        ]
    return list(release["assets"])


def _distance(want: dict[str, Any], have: dict[str, Any]) -> tuple:
    """Sort key: how far a published asset is from the wanted one (platform, Python, ABI, torch)."""
    w_torch = _major_minor(want["torch"], "torch version")
    h_torch = _major_minor(have["torch"], "torch version")
    gap = abs((w_torch[0] - h_torch[0]) * 100 + (w_torch[1] - h_torch[1]))
    w_py = _major_minor(want["python"], "python version")
    h_py = _major_minor(have["python"], "python version")
    return (
        have["platform"] != want["platform"],
        abs((w_py[0] - h_py[0]) * 100 + (w_py[1] - h_py[1])),
        have["cxx11abi"] != want["cxx11abi"],
        gap,
        -(h_torch[0] * 100 + h_torch[1]),  # on a tie, the newer torch
        have["cuda_label"] != want.get("cuda_label"),
    )


def _differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    labels = {
        "python": "Python",
        "torch": "torch",
        "cxx11abi": "C++11 ABI",
        "platform": "platform",
        "cuda_label": "CUDA",
    }
    out = []
    for key, label in labels.items():
        if want.get(key) is not None and want[key] != have[key]:
            out.append(f"{label} {have[key]} instead of {want[key]}")
    return out


def resolve(
    flash_version: Optional[str],
    *,
    python: str,
    torch: Optional[str],
    cxx11abi: Optional[bool],
    cuda: Optional[str] = None,
    hip: Optional[str] = None,
    platform: str = "linux_x86_64",
) -> dict[str, Any]:
    """The upstream wheel for this environment and whether it was published.

    Returns ``version``, ``filename`` and ``url`` (None when no name can be formed, e.g. for a
    CPU-only torch), ``status`` (``"published"``, ``"not-published"``, ``"not-confirmed"`` for a
    release whose full list is not recorded, ``"unknown-release"``, ``"no-gpu-torch"`` or
    ``"no-torch"``), ``reason`` (one sentence) and ``nearest`` (the closest published asset with
    ``filename``, ``url`` and ``differs``, or None).
    """
    version = flash_version or LATEST
    release_tuple(version)
    out: dict[str, Any] = {"version": version, "filename": None, "url": None, "nearest": None}
    want: dict[str, Any] = {"python": ".".join(python.split(".")[:2]), "platform": platform}
    if torch:
        want["torch"] = ".".join(torch.split("+")[0].split(".")[:2])
    if cxx11abi is not None:
        want["cxx11abi"] = bool(cxx11abi)
    if not torch:
        out.update(
            status="no-torch",
            reason="torch is not installed: the wheel name depends on torch's version, CUDA and C++ ABI",
        )
    elif cuda is None and hip is None:
        want["cuda_label"] = "cpu"
        out.update(
            status="no-gpu-torch",
            reason=f"torch {torch} is a CPU-only build: flash-attn wheels exist only for CUDA builds of torch",
        )
    else:
        name = wheel_filename(
            version, python=python, torch=torch, cxx11abi=bool(cxx11abi), cuda=cuda, hip=hip, platform=platform
        )
        want.update(parse_wheel_filename(name))
        out.update(filename=name, url=wheel_url(version, name))
        names = published_filenames(version)
        if names is None:
            out.update(status="unknown-release", reason=f"flash-attn {version} is not in the recorded release list")
        elif name in names:
            out.update(status="published", reason="this exact wheel is a published release asset")
        elif "matrix" in RELEASES[version]:
            out.update(
                status="not-published", reason=f"flash-attn {version} never published a wheel for this combination"
            )
        else:
            out.update(
                status="not-confirmed",
                reason=(
                    f"this name is not among the recorded assets of flash-attn {version} "
                    f"(its full list is not recorded)"
                ),
            )
    names = published_filenames(version) or []
    if out.get("status") != "published" and names and "torch" in want:
        want.setdefault("cxx11abi", True)
        best = min(names, key=lambda n: _distance(want, parse_wheel_filename(n)))
        have = parse_wheel_filename(best)
        out["nearest"] = {
            "filename": best,
            "url": wheel_url(version, best),
            "differs": _differences(want, have),
            **have,
        }
    return out


def inspect_wheel_file(path: str) -> dict[str, Any]:
    """Read a wheel file's name and its ``*.dist-info/METADATA`` version (for renamed files).

    Returns ``filename``, ``name_version`` (the version part of the file name, local label
    included), ``metadata_version``, ``tags`` (from the WHEEL file) and ``name_parts`` (the
    upstream coupling parsed from the name, or None). Raises ValueError if ``path`` is not a
    readable wheel.
    """
    import os
    import zipfile

    filename = os.path.basename(path)
    if not filename.endswith(".whl"):
        raise ValueError(f"path must name a .whl file, got {path!r}")
    fields = filename[:-4].split("-")
    if len(fields) < 5:
        raise ValueError(f"path must be a wheel named NAME-VERSION-PY-ABI-PLATFORM.whl, got {filename!r}")
    try:
        with zipfile.ZipFile(path) as archive:
            meta_name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
            wheel_name = next((n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")), None)
            metadata_text = archive.read(meta_name).decode("utf-8", "replace") if meta_name else ""
            wheel_text = archive.read(wheel_name).decode("utf-8", "replace") if wheel_name else ""
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"path must be a readable wheel (zip) file, got {path!r}: {exc}") from exc
    match = re.search(r"^Version:\s*(\S+)", metadata_text, re.MULTILINE)
    try:
        parts: Optional[dict[str, Any]] = parse_wheel_filename(filename)
    except ValueError:
        parts = None
    return {
        "filename": filename,
        "name_version": fields[1],
        "metadata_version": match.group(1) if match else None,
        "tags": re.findall(r"^Tag:\s*(\S+)", wheel_text, re.MULTILINE),
        "name_parts": parts,
    }
