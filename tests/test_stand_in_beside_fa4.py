"""The flash-attn stand-in beside flash-attn-4, which installs ``flash_attn/cute`` and no
``flash_attn/__init__.py``: with ``install_as_flash_attn()`` active, ``import flash_attn.cute``
still gives flash-attn-4's package (transformers' ``flash_attention_4`` imports it), while
``flash_attn`` and its FA2 modules are the stand-in's.

``fa4_site`` lays out a folder as the flash-attn-4 4.0.0b36 wheel installs it (the same top-level
names and dist-info files; its ``__init__`` imports a submodule of itself by the absolute name, as
the real ``flash_attn.cute.mask`` does). Where the real package is installed
(``FLASH_RECIPE_REQUIRE_FA4=1``), the same checks run against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK = """
import importlib.metadata as md, json, sys, warnings
import flash_recipe
with warnings.catch_warnings(record=True) as caught:  # no "flash-attn is installed but fails to import"
    warnings.simplefilter("always")
    installed = flash_recipe.install_as_flash_attn()
import flash_attn, flash_attn.cute
from flash_attn import flash_attn_func
from flash_attn.flash_attn_interface import flash_attn_varlen_func
try:
    import flash_attn.not_a_module
    refused = None
except ModuleNotFoundError as exc:
    refused = str(exc)
print(json.dumps({
    "installed": installed,
    "warnings": [str(w.message) for w in caught],
    "flash_attn": flash_attn.__name__,
    "cute": flash_attn.cute.__file__,
    "cute_func": flash_attn.cute.flash_attn_func.__module__,
    "fa2_func": flash_attn_func.__module__,
    "varlen": flash_attn_varlen_func.__module__,
    "refused": refused,
    "distributions": sorted(md.packages_distributions()["flash_attn"]),
}))
"""


@pytest.fixture
def fa4_site(tmp_path):
    """A folder holding what the flash-attn-4 wheel installs, in its layout."""
    site = tmp_path / "site"
    cute = site / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text(
        "import flash_attn.cute.utils as utils\nfrom .interface import flash_attn_func\n__version__ = '4.0.0b36'\n"
    )
    (cute / "utils.py").write_text("ONE = 1\n")
    (cute / "interface.py").write_text("def flash_attn_func(*args, **kwargs):\n    return 'fa4'\n")
    info = site / "flash_attn_4-4.0.0b36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: flash-attn-4\nVersion: 4.0.0b36\n")
    (info / "top_level.txt").write_text("flash_attn\n")
    files = ["flash_attn/cute/__init__.py", "flash_attn/cute/utils.py", "flash_attn/cute/interface.py"]
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files))
    return site


def _check(site=None) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_beside(answer: dict, cute_root: str) -> None:
    assert answer["installed"] and answer["warnings"] == [] and answer["flash_attn"] == "flash_recipe.flash_attn"
    assert answer["cute"].startswith(cute_root) and answer["cute_func"] == "flash_attn.cute.interface"
    assert answer["fa2_func"].startswith("flash_recipe.") and answer["varlen"].startswith("flash_recipe.")
    assert "does not provide the module flash_attn.not_a_module" in answer["refused"]
    assert {"flash-attn", "flash-attn-4"} <= set(answer["distributions"])  # transformers' FA4 check reads this


def test_flash_attn_cute_of_flash_attn_4_stays_importable_beside_the_stand_in(fa4_site):
    _assert_beside(_check(fa4_site), str(fa4_site))


def test_without_flash_attn_4_flash_attn_cute_is_refused_by_name():
    if os.environ.get("FLASH_RECIPE_REQUIRE_FA4") == "1":
        pytest.skip("flash-attn-4 is installed here")
    code = "import flash_recipe; flash_recipe.install_as_flash_attn(); import flash_attn.cute"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "does not provide the module flash_attn.cute" in proc.stderr


@pytest.mark.skipif(os.environ.get("FLASH_RECIPE_REQUIRE_FA4") != "1", reason="flash-attn-4 is not installed here")
def test_the_real_flash_attn_4_beside_the_stand_in():
    import importlib.util

    spec = importlib.util.find_spec("flash_attn.cute")
    assert spec is not None and spec.origin is not None
    answer = _check()
    _assert_beside(answer, os.path.dirname(os.path.dirname(spec.origin)))
    assert answer["cute_func"] == "flash_attn.cute.interface"
