"""The supported torch and Triton lower bounds: flash_recipe.env.versions and pyproject.toml agree.

The tests run against the installed package from outside the checkout, so pyproject.toml is found
through the checkout root (as tests/conftest.py finds it), and the bounds through the installed
``flash_recipe.env.versions``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flash_recipe.env import versions

ROOT = Path(__file__).resolve().parents[1]


def _dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            tomllib = None
    if tomllib is not None:
        return list(tomllib.loads(text)["project"]["dependencies"])
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    return re.findall(r"""^\s*["']([^"']+)["']""", block.group(1), re.MULTILINE)


def _lower_bound(name: str) -> tuple[int, ...]:
    """The ``>=`` version of ``name`` in [project] dependencies, as a tuple of ints."""
    bounds = []
    for requirement in _dependencies():
        match = re.match(rf"^\s*{name}\s*(\[[^\]]*\])?\s*(?P<spec>[^;]*)", requirement, re.IGNORECASE)
        if not match:
            continue
        found = re.search(r">=\s*([\d.]+)", match.group("spec"))
        if found:
            bounds.append(tuple(int(part) for part in found.group(1).split(".")))
    assert bounds, f"pyproject.toml [project] dependencies state no {name}>= bound"
    assert len(set(bounds)) == 1, f"pyproject.toml states different {name} lower bounds: {bounds}"
    return bounds[0]


def _trimmed(release: tuple[int, ...]) -> tuple[int, ...]:
    """2.6.0 and 2.6 are the same bound."""
    while len(release) > 2 and release[-1] == 0:
        release = release[:-1]
    return release


@pytest.mark.parametrize("name, bound", [("torch", "TORCH_MIN"), ("triton", "TRITON_MIN")])
def test_pyproject_lower_bounds_equal_versions(name, bound):
    declared = _trimmed(_lower_bound(name))
    wanted = _trimmed(tuple(getattr(versions, bound)))
    assert declared == wanted, (
        f"pyproject.toml says {name}>={'.'.join(map(str, declared))}, flash_recipe.env.versions.{bound} "
        f"is {'.'.join(map(str, wanted))}"
    )


def test_triton_bound_follows_from_the_torch_bound():
    """Each torch wheel pins one Triton: the oldest supported torch must pin a supported Triton."""
    pinned = versions.TRITON_OF_TORCH.get(tuple(versions.TORCH_MIN))
    assert pinned is not None and pinned >= tuple(versions.TRITON_MIN)


def test_torch_compat_pairs_every_supported_torch_with_its_pinned_triton():
    """``nox -s torch_compat`` has one session per torch minor release from TORCH_MIN to the newest
    it names, each with the Triton that release's wheel pins (``versions.TRITON_OF_TORCH``)."""
    import ast
    import re

    text = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    pairs = ast.literal_eval(re.search(r"^TORCH_PAIRS = (\{.*?^\})", text, re.M | re.S).group(1))
    minors = [tuple(int(p) for p in key.split(".")) for key in pairs]
    assert minors[0] == versions.TORCH_MIN
    assert minors == [(2, minor) for minor in range(versions.TORCH_MIN[1], minors[-1][1] + 1)]
    for key, (torch_release, triton_release) in pairs.items():
        minor = tuple(int(p) for p in key.split("."))
        assert torch_release.startswith(key + "."), (key, torch_release)
        assert tuple(int(p) for p in triton_release.split(".")[:2]) == versions.TRITON_OF_TORCH[minor], key
