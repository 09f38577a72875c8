"""The stand-in's distribution metadata: ``importlib.metadata`` answers for flash-attn in the process
that called ``install_as_flash_attn()``, and nowhere else (nothing is written to disk)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHECK = """
import importlib.metadata as md, json, sys
import flash_recipe
from flash_recipe.alias import is_stand_in
before = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] == "flash-attn"]
assert flash_recipe.install_as_flash_attn()
dist = md.distribution("flash_attn")
print(json.dumps({
    "before": before,
    "versions": [md.version(n) for n in ("flash_attn", "flash-attn", "Flash_Attn")],
    "name": dist.metadata["Name"],
    "stand_in": is_stand_in(dist),
    "listed": [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] == "flash-attn"],
    "requires": dist.requires,
    "other": md.version("torch") != "",
}))
"""


def test_metadata_answers_in_this_process_only():
    answer = json.loads(
        subprocess.run([sys.executable, "-c", CHECK], check=True, capture_output=True, text=True).stdout
    )
    assert answer == {
        "before": [],
        "versions": ["2.8.3"] * 3,
        "name": "flash-attn",
        "stand_in": True,
        "listed": ["flash-attn"],
        "requires": None,
        "other": True,
    }


def test_pip_sees_no_flash_attn():
    """The same environment, asked by pip after a process installed the stand-in: no flash-attn."""
    subprocess.run([sys.executable, "-c", "import flash_recipe; flash_recipe.install_as_flash_attn()"], check=True)
    listing = subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
    if listing.returncode != 0 and "No module named pip" in listing.stderr:
        pytest.skip("this environment has no pip")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listing.stdout)}
    assert "torch" in names and "flash-attn" not in names


def test_a_real_distribution_is_not_the_stand_in():
    import importlib.metadata as md

    from flash_recipe.alias import is_stand_in

    assert not is_stand_in(md.distribution("torch"))


def test_the_doctor_tells_the_stand_in_from_an_install():
    """In a process that installed the stand-in, ``importlib.metadata`` answers for flash-attn,
    but the doctor's distribution probe reports no installed flash-attn, and says it is the stand-in."""
    from flash_recipe import alias
    from flash_recipe.env import distinfo

    assert distinfo.STAND_IN_INSTALLER == alias.INSTALLER
    code = (
        "import importlib.metadata, json, flash_recipe\n"
        "flash_recipe.install_as_flash_attn()\n"
        "from flash_recipe.env.distinfo import distribution_info\n"
        "print(json.dumps([importlib.metadata.version('flash-attn'), distribution_info('flash-attn')]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    version, info = json.loads(done.stdout.strip().splitlines()[-1])
    assert version and info == {"installed": False, "name": "flash-attn", "stand_in": True}
