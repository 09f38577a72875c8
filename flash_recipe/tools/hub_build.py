"""``flash-recipe hub-build``: the package as a Hugging Face Hub kernel, ready for ``kernels``.

Writes a Hub kernel repository (docs/hub-kernel.md)::

    OUT/README.md                       the model card, with the usage lines
    OUT/build/torch-cuda/               one noarch variant per backend (cuda, rocm, cpu):
        __init__.py, api.py, ops/, ...  the package's files flattened at the variant's root
        _ops.py                         the op namespace: the package's import name (the build's id)
        _hub.py                         the version the copy was built from
        metadata.json                   name, id, version, license, python-depends, backend

``kernels`` imports a variant's ``__init__.py`` under the id ``_flash_recipe_<backend>_<uid>`` (uid:
the git revision of the checkout that tracks the package, 7 hex digits, with ``_dirty`` when the
package's files differ from it; otherwise, the first 7 hex digits of a hash of the files). Every import inside the
package is relative, so the copy never reaches for a pip-installed flash_recipe; its ops are
``<id>::attn_fwd`` and ``<id>::attn_bwd``, beside the wheel's ``flash_recipe::`` ones.

What stays out of the Hub copy (``LEFT_OUT``): the command line and its tools, the doctor and the
install recipes (they read the pip distribution and the environment's installs), and
the integrations (transformers' ``recipe_attention`` and torch's SDPA registry register
process-wide names: the pip package is their route). The stand-ins stay in:
``install_as_flash_attn()``, ``install_as_flash_attn_3()`` and ``install_as_sageattention()`` of a
Hub copy make ``import flash_attn``, ``import flash_attn_interface`` and ``import sageattention``
give that copy, their metadata held in memory as from the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from .. import __version__

PACKAGE = Path(__file__).resolve().parents[1]
NAME = "flash-recipe"
PYTHON_NAME = "flash_recipe"
BACKENDS = ("cuda", "rocm", "cpu")
LICENSE = "BSD-3-Clause"
# Relative to the package: whole folders, then single files, that the Hub copy leaves out.
LEFT_OUT = ("tools", "env", "integrations", "__main__.py")
# Kept from what LEFT_OUT drops: the version floors the dispatcher reads (dispatch.capabilities).
KEPT = ("env/__init__.py", "env/versions.py")
USAGE = """\
from kernels import get_kernel

flash = get_kernel("{repo}", version={version})
out = flash.flash_attn_func(q, k, v, causal=True)  # q, k, v: (batch, seqlen, heads, head_dim)

# transformers: attention through its flash-attention forward
model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="{repo}")
"""


def package_files(package: Path = PACKAGE) -> list[Path]:
    """The files of ``package`` the Hub copy holds, relative to it, sorted: sources and ``py.typed``,
    without ``LEFT_OUT`` (``KEPT`` excepted) and without bytecode."""
    files = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
            continue
        left_out = rel.parts[0] in LEFT_OUT or rel.as_posix() in LEFT_OUT
        if left_out and rel.as_posix() not in KEPT:
            continue
        files.append(rel)
    return files


def _git(package: Path, *args: str) -> Optional[str]:
    try:
        result = subprocess.run(
            ["git", "-C", str(package), *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def source_uid(package: Path = PACKAGE) -> str:
    """The build's uid: the git revision of the checkout that tracks ``package`` (7 hex digits),
    ``_dirty`` added when the package's files differ from it; otherwise (no git, or a package that
    only lies inside a checkout, as an environment's site-packages may) 7 hex digits of a hash of
    the files."""
    revision = _git(package, "rev-parse", "--short=7", "HEAD") if _git(package, "ls-files", "--", ".") else None
    if revision:
        dirty = _git(package, "status", "--porcelain", "--untracked-files=all", "--", ".")
        return revision[:7] + ("_dirty" if dirty else "")
    digest = hashlib.sha256()
    for rel in package_files(package):
        digest.update(rel.as_posix().encode() + b"\0" + (package / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:7]


def kernel_id(backend: str, uid: str) -> str:
    """The module name ``kernels`` imports the variant under: ``_flash_recipe_<backend>_<uid>``."""
    return f"_{PYTHON_NAME}_{backend}_{uid}"


def metadata(backend: str, uid: str, version: int) -> dict:
    """The variant's ``metadata.json``."""
    return {
        "name": NAME,
        "id": kernel_id(backend, uid),
        "version": version,
        "license": LICENSE,
        "python-depends": [],
        "backend": {"type": backend},
    }


def model_card(repo: str, version: int, uid: str) -> str:
    """The repository's README.md: what it is, and how to use it."""
    return (
        f"---\nlicense: bsd-3-clause\ntags:\n- kernels\n- attention\n---\n\n# {NAME}\n\n"
        f"FlashAttention-2 in Triton, forward and backward, behind flash-attn 2's API (`flash_attn_func`, "
        f"`flash_attn_varlen_func`, `flash_attn_with_kvcache`, ...) and torch SDPA's "
        f"(`scaled_dot_product_attention`), with 8-bit attention for inference (`sageattn`). One pure "
        f"Python package for every torch/CUDA/ROCm pair: Triton compiles the kernels on first use "
        f"(NVIDIA sm80 or newer, AMD gfx9).\n\n"
        f"Built by `flash-recipe hub-build` from flash-recipe {__version__} (source {uid}).\n\n"
        f"## Usage\n\n```python\n{USAGE.format(repo=repo, version=version)}```\n\n"
        f"The pip package (`pip install flash-recipe`) adds the `flash-recipe` command line (doctor, "
        f"verify, bench) and the transformers and SDPA integrations.\n"
    )


def build(out: Path, backends: tuple = BACKENDS, version: int = 1, repo: str = "<org>/flash-recipe") -> list[Path]:
    """Write the Hub repository ``out`` (module docstring); returns the variant folders. ``out/build``
    is replaced; nothing else in ``out`` but README.md is touched."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"version must be a positive integer (the Hub's v<N> branch), got {version!r}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"backends must be some of {', '.join(BACKENDS)}, got {', '.join(unknown) or 'none'}")
    uid = source_uid()
    files = package_files()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "build", ignore_errors=True)
    variants = []
    for backend in backends:
        variant = out / "build" / f"torch-{backend}"
        for rel in files:
            (variant / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PACKAGE / rel, variant / rel)
        (variant / "_hub.py").write_text(
            f'"""Written by flash-recipe hub-build: the release this Hub copy was built from."""\n\n'
            f"__version__ = {__version__!r}\nSOURCE = {uid!r}\n"
        )
        (variant / "metadata.json").write_text(json.dumps(metadata(backend, uid, version), indent=2) + "\n")
        variants.append(variant)
    (out / "README.md").write_text(model_card(repo, version, uid))
    return variants


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("hub"), help="the repository folder to write (default: hub)")
    parser.add_argument(
        "--backend", action="append", choices=BACKENDS, help="a variant to build (repeatable; default: all)"
    )
    parser.add_argument("--version", type=int, default=1, help="the kernel's major version, its v<N> branch")
    parser.add_argument("--repo", default="<org>/flash-recipe", help="the Hub repository named in the model card")


def run(args: argparse.Namespace) -> int:
    variants = build(args.out, tuple(args.backend or BACKENDS), args.version, args.repo)
    for variant in variants:
        document = json.loads((variant / "metadata.json").read_text())
        print(f"{variant}: {document['id']}")
    print(
        f"publish: hf upload {args.repo} {args.out} --repo-type kernel --revision v{args.version}  "
        f"(or the Hub's web UI, on the branch v{args.version})"
    )
    return 0
