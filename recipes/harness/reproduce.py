"""Reproduce two upstream flash-attn install failures for real, and check the doctor's diagnosis.

Development tooling, not part of the wheel: the optional nox session ``reproduce_upstream``
imports it from the checkout (not run by default: it downloads the upstream source archive from
PyPI and installs torch). In the session's fresh environment:

1. With torch installed in the environment, ``pip install flash-attn`` from source *with* build
   isolation still fails with ``No module named 'torch'`` (the isolated build environment does
   not see it); ``flash-recipe doctor --log`` on that output must name the
   ``build-isolation-no-torch`` finding.
2. A ``--no-build-isolation`` build under
   ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE`` succeeds but leaves the hollow package;
   ``flash-recipe doctor`` must report ``hollow-package`` as an error with a fix, and exit 1.

``FLASH_ATTENTION_FORCE_BUILD=TRUE`` accompanies step 2 so that setup.py does not first try to
download a prebuilt wheel (and, on a CPU-only torch, does not trip over ``torch.version.cuda``
being None).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

DEFAULT_VERSION = "2.8.3"


def _doctor_json(session: Any, *extra: str) -> dict[str, Any]:
    output = session.run(
        "python",
        "-m",
        "flash_recipe",
        "doctor",
        "--json",
        "--installer",
        "pip",
        *extra,
        silent=True,
        success_codes=[0, 1],
    )
    # the report is the JSON object starting at the first line that is exactly "{"; anything
    # before it is a warning some library printed on stderr
    lines = (output or "").splitlines()
    start = lines.index("{") if "{" in lines else 0
    return json.loads("\n".join(lines[start:]))


def _finding(report: dict[str, Any], rule: str) -> dict[str, Any]:
    for finding in report["findings"]:
        if finding["rule"] == rule:
            return finding
    return {}


def reproduce_upstream(session: Any, posargs: Sequence[str] = (), install_project: bool = True) -> None:
    """Run both reproductions in ``session`` (a nox session using a pip-capable venv backend).

    ``posargs``: an optional torch requirement (default ``torch``; give e.g. ``torch==2.8.0`` or
    a local CPU build to avoid a large download) followed by an optional flash-attn version.
    With ``install_project=False`` the caller makes ``flash_recipe`` importable itself (for
    example through PYTHONPATH).
    """
    torch_requirement = posargs[0] if len(posargs) > 0 else "torch"
    version = posargs[1] if len(posargs) > 1 else DEFAULT_VERSION
    # a current pip: old ones build a setup.py-only sdist without isolation when setuptools is present
    session.install("--upgrade", "pip")
    if install_project:
        session.install("--no-deps", ".")
    session.install(torch_requirement, "einops", "packaging", "wheel", "setuptools", "psutil", "ninja")
    tmp = session.create_tmp()

    # 1. build isolation: the isolated build environment has no torch
    session.log(f"1/2: pip install flash-attn=={version} from source with build isolation (expected to fail)")
    output = session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--use-pep517",
        "--no-deps",
        "--no-binary",
        "flash-attn",
        f"flash-attn=={version}",
        silent=True,
        success_codes=[1, 2],
    )
    if "No module named 'torch'" not in (output or ""):
        session.error("the isolated build did not fail with \"No module named 'torch'\":\n" + (output or "")[-2000:])
    log_path = os.path.join(tmp, "isolated-build.log")
    with open(log_path, "w", encoding="utf-8") as handle:
        handle.write(output)
    report = _doctor_json(session, "--log", log_path)
    found = _finding(report, "build-isolation-no-torch")
    if not found or found["severity"] != "error":
        session.error(f"doctor did not diagnose the isolated build: {report['findings']}")
    session.log(f"doctor: {found['title']} -> recipes/{found['recipe']}: {found['command']}")

    # 2. the hollow package
    session.log(f"2/2: FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE build of flash-attn=={version} against {torch_requirement}")
    session.run(
        # --no-cache-dir: pip would otherwise keep the hollow wheel and reuse it for later installs
        "python",
        "-m",
        "pip",
        "install",
        "--no-cache-dir",
        "--no-deps",
        "--no-build-isolation",
        "--no-binary",
        "flash-attn",
        f"flash-attn=={version}",
        env={"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"},
    )
    report = _doctor_json(session)
    found = _finding(report, "hollow-package")
    if not found or found["severity"] != "error" or report["healthy"]:
        session.error(f"doctor did not diagnose the hollow package: {report['findings']}")
    session.log(f"doctor: {found['title']}; saw: {found['evidence']}")
    session.log(f"fix (recipes/{found['recipe']}): {found['command']}")
