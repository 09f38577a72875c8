"""A minimal valid pure-Python wheel, written directly (nothing to build), for the harness tests
that serve one: ``write_wheel(directory, "demo-pkg", "1.0")`` writes
``demo_pkg-1.0-py3-none-any.whl`` with an empty ``demo_pkg`` package, METADATA, WHEEL and RECORD.
"""

from __future__ import annotations

import zipfile
from pathlib import Path


def write_wheel(directory: Path, name: str, version: str) -> Path:
    """The wheel of ``name`` ``version`` in ``directory``; returns its path."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = Path(directory) / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel
