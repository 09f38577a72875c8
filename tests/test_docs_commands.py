"""Every shell block a user can copy from README.md and docs/ is executed somewhere, and a changed
command without its executed twin fails here.

Each ```bash block is preceded by an HTML comment (invisible on GitHub) that says what runs it:

- ``<!-- runs: here -->``: this test runs the block with bash, in an empty directory, with
  ``flash-recipe`` on PATH (the console script, or ``python -m flash_recipe`` where the tests run
  from the source tree) and the tune cache in that directory;
- ``<!-- runs: ci -->``: each command (lines split at ``&&``) begins a command of ``.ci/run``;
- ``<!-- runs: recipes/<path> ... -->``: each line is a line of those recipes' ``recipe.sh``,
  which the install matrix runs verbatim (the recipes are literal: ``test_recipes_scripts.py``);
- ``<!-- runs: tests/<file> ... -->`` or ``noxfile.py``: every option of each line appears in
  those files, the tests or sessions that run the command with them;
- ``<!-- gpu-only: <reason> -->``: needs a GPU (or a machine this project has none of).

README's Python example runs here too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)^```$", re.S | re.M)


def repository() -> str:
    return re.search(r'^Repository = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            yield pytest.param(page, match, id=f"{page.relative_to(ROOT)}:{line}")


SHELL_BLOCKS = [p for p in blocks() if p.values[1].group("lang") == "bash"]


def commands(body: str) -> list[str]:
    """The command lines of a block, without comments."""
    out = []
    for line in body.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def recipe_lines(path_id: str) -> set[str]:
    """The lines of a recipe: literal, as the matrix runs them."""
    return {line.strip() for line in (ROOT / "recipes" / path_id / "recipe.sh").read_text().splitlines()}


def ci_commands() -> list[str]:
    return [part.strip() for line in commands((ROOT / ".ci" / "run").read_text()) for part in line.split("&&")]


def shim_path(tmp_path: Path) -> str:
    """PATH with ``flash-recipe``: the installed console script, else a shim that runs the module."""
    directory = Path(sys.executable).parent
    if not (directory / "flash-recipe").exists():
        directory = tmp_path / "bin"
        directory.mkdir()
        shim = directory / "flash-recipe"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m flash_recipe "$@"\n')
        shim.chmod(0o755)
    return os.pathsep.join([str(directory), str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def user_environment() -> dict[str, str]:
    """This process's environment without what the test suite sets for itself (conftest turns the
    Triton interpreter on), as a user's shell has it."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASH_RECIPE_BACKEND")}


def run_here(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    work.mkdir()
    env = user_environment()
    env.update(
        PATH=shim_path(tmp_path),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        FLASH_RECIPE_TUNE_CACHE=str(tmp_path / "tune"),
    )
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("page, match", SHELL_BLOCKS)
def test_every_shell_block_is_run_somewhere(page, match, tmp_path):
    marker = match.group("marker") or ""
    body = match.group("body")
    kind, _, rest = marker.partition(":")
    targets = rest.split()
    if kind == "gpu-only":
        assert len(rest.strip()) > 10, f"{page.name}: say why the block needs a GPU"
    elif kind == "runs" and targets == ["here"]:
        proc = run_here(body, tmp_path)
        assert proc.returncode == 0, f"{body}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    elif kind == "runs" and targets == ["ci"]:
        ci = ci_commands()
        for line in commands(body):
            for command in line.split("&&"):
                assert any(c.startswith(command.strip()) for c in ci), f"{command.strip()!r} is not in .ci/run"
    elif kind == "runs" and all(t.startswith("recipes/") for t in targets):
        allowed = set().union(*(recipe_lines(t.split("/", 1)[1]) for t in targets))
        for line in commands(body):
            assert line in allowed, (
                f"{line!r} is no line of {', '.join(targets)}/recipe.sh; they have {sorted(allowed)}"
            )
    elif kind == "runs" and targets:
        text = "".join((ROOT / t).read_text() for t in targets)
        for line in commands(body):
            words = [w for w in shlex.split(line) if "=" not in w.split("-", 1)[0]]
            for word in words[1:]:
                if word.startswith("-") and word not in ("-m", "-s", "--"):
                    assert word.split("=")[0] in text, f"{word} of {line!r} is not in {targets}"
    else:
        raise AssertionError(f"{page.name}: a ```bash block without a runs:/gpu-only: marker:\n{body}")


def test_readme_example_runs(tmp_path):
    (example,) = [
        m.group("body")
        for p in blocks()
        for m in [p.values[1]]
        if p.values[0].name == "README.md" and m.group("lang") == "python"
    ]
    env = dict(user_environment(), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch.Size([2, 1024, 8, 64])" in proc.stdout


def test_readme_is_short_and_starts_with_the_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160
    assert next(i for i, line in enumerate(lines) if line == "## Quick start") < 40
    develop = "\n".join(lines)
    for command in ("python -m pip install nox && nox -s install_matrix", "python -m pip install nox && nox -s tests"):
        assert command in develop


def test_the_repository_url_is_written_once():
    url = repository()
    for page in PAGES:
        for found in re.findall(r"https://github\.com/flash-recipe/[\w.-]+", page.read_text()):
            assert found == url, f"{page.name}: {found} is not [project.urls] Repository {url}"


def test_every_doctor_finding_is_documented():
    from flash_recipe.env.rules import RULES

    text = (ROOT / "docs" / "doctor.md").read_text()
    missing = [name for name, _ in RULES if f"| `{name}` |" not in text]
    assert missing == []


def test_gpu_figures_name_their_device_date_versions_and_command():
    """The GPU section of the performance page gives, for its figures, the GPU, the date, the
    torch and Triton releases and the commands that printed them."""
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text[text.index("## Measured on a GPU") : text.index("## Benchmarks")]
    for needed in (
        "H100",
        "2026-11-25",
        "torch 2.11.0+cu130",
        "Triton 3.6.0",
        "python -m devtools.campaign",
        "python -m flash_recipe.tools.bench_decode",
    ):
        assert needed in section, needed
    assert not any(re.search(r"No GPU figure exists yet", page.read_text()) for page in PAGES)


def python_modules(line: str) -> list[str]:
    """The modules a command line runs with ``python -m MODULE`` (after any ``VAR=value``)."""
    words = line.rstrip("\\").split()
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-m" and "python" in words[max(i - 1, 0)]]


def module_exists(module: str) -> bool:
    """A module of the checkout (a file or a package with ``__main__``), else an installed one.
    Looked up on ``sys.path`` alone: ``importlib.util.find_spec("pip")`` would also ask setuptools'
    distutils finder, which then stops shimming distutils, and a later first ``import setuptools``
    in this process (torch.compile's CPU path makes one) fails its own assertion."""
    import importlib.machinery

    path = ROOT / Path(*module.split("."))
    if (ROOT / module.split(".")[0]).is_dir():
        return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
    return importlib.machinery.PathFinder.find_spec(module.split(".")[0]) is not None


def test_every_python_module_a_block_runs_exists():
    """Each ``python -m MODULE`` of every shell block, the GPU-only ones included, names a module of
    the checkout (``devtools``, ``flash_recipe``) or an installed one: a moved tool leaves no stale
    command behind."""
    missing = [
        f"{param.id}: {module}"
        for param in SHELL_BLOCKS
        for line in commands(param.values[1].group("body"))
        for module in python_modules(line)
        if not module_exists(module)
    ]
    assert not missing, missing


def test_the_module_check_reads_the_module_after_the_environment():
    assert python_modules("TRITON_INTERPRET=0 python -m devtools.compile_check --preset ci") == [
        "devtools.compile_check"
    ]
    assert python_modules("python3 -m pip install nox && nox -s tests") == ["pip"]
    assert module_exists("devtools.campaign") and module_exists("flash_recipe.tools.host_cost")
    assert not module_exists("flash_recipe.campaign") and not module_exists("devtools.nothing_here")


def test_the_documented_campaign_commands_plan_without_a_gpu(tmp_path):
    """The GPU-only campaign commands of the docs, each with ``--dry-run`` added, make a plan here:
    the command a GPU machine is given is the one that runs."""
    lines = [
        line
        for param in SHELL_BLOCKS
        if (param.values[1].group("marker") or "").startswith("gpu-only")
        for line in commands(param.values[1].group("body"))
        if python_modules(line) == ["devtools.campaign"]
    ]
    assert len(lines) >= 3, lines
    env = dict(user_environment(), PYTHONPATH=str(ROOT))
    for line in lines:
        argv = [sys.executable if w.startswith("python") else w for w in shlex.split(line)] + ["--dry-run"]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "warmup" in proc.stdout, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
