"""One path's workspace: its directory, its clean environment, and the commands run in it.

Every path runs in its own directory under the system temporary directory (outside the checkout:
uv and Poetry look for a project in the parent directories), with its own HOME and caches, a copy
of the project snapshot where its recipe expects one, and an environment that carries none of the
calling user's tool configuration. The directory is locked while the path runs and removed
afterwards unless it is to be kept; directories left by killed runs are swept by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from recipes.harness.config import Options
from recipes.harness.paths import RecipePath
from recipes.harness.prepare import Build, Tools
from recipes.harness.servers import die_with_parent

# Variables of the calling environment that would let a path see the user's configuration,
# another environment or the network.
_DROPPED_PREFIXES = ("PIP_", "UV_", "POETRY_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "PIPX_", "XDG_", "GIT_")
_DROPPED = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}


def workroot() -> Path:
    """The directory holding every path's workspace (created if missing)."""
    root = Path(tempfile.gettempdir()) / "flash-recipe-matrix"
    root.mkdir(exist_ok=True)
    return root


class Workspace:
    """A fresh, locked directory for one path: ``home``, ``project`` and ``neutral`` (a working
    directory outside the project, so that imports there see only the installed environment)."""

    def __init__(self, root: Path, run_name: str, path_id: str) -> None:
        sweep(root)
        self.trash = root / "trash"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{run_name}-{path_id}-", dir=root))
        # Held while the path runs; the kernel drops it when this process dies, however it dies.
        self._in_use: IO[str] | None = open(self.dir / ".in-use", "w")  # noqa: SIM115 (held: the lock)
        fcntl.flock(self._in_use, fcntl.LOCK_EX)
        self.home = self.dir / "home"
        self.project = self.dir / "project"
        self.neutral = self.dir / "neutral"
        for directory in (self.home, self.neutral):
            directory.mkdir(parents=True)

    def place_project(self, build: Build, path: RecipePath) -> Path | None:
        """Copy the build's checkout where ``path``'s recipe expects it.

        A ``checkout`` project is the copy itself; otherwise the project directory starts empty
        and the copy lies beside it. Returns the copy to name in ``CHECKOUT``, or None.
        """
        if path.project == "checkout":
            shutil.copytree(build.checkout, self.project, symlinks=True)
            return None
        self.project.mkdir()
        checkout = self.dir / "checkout"
        shutil.copytree(build.checkout, checkout, symlinks=True)
        return checkout

    def size_mb(self) -> float:
        """Disk used by the workspace: environment, project and tool caches."""
        return dir_size_mb(self.dir)

    def release(self, keep: bool) -> None:
        """Remove the workspace (unless ``keep``) and drop its lock."""
        if not keep:
            discard(self.dir, self.trash)
        if self._in_use is not None:
            self._in_use.close()
            self._in_use = None


def recipe_variables(
    options: Options,
    python_version: str,
    build: Build,
    *,
    index_url: str,
    torch_index_url: str,
    git_url: str | None = None,
    checkout: Path | None = None,
) -> dict[str, str]:
    """The variables a recipe may use (``recipes/README.md`` lists them)."""
    variables = {
        "PYTHON": options.python,
        "PYTHON_VERSION": python_version,
        "INDEX_URL": index_url,
        "TORCH_INDEX_URL": torch_index_url,
        "TORCH_VERSION": options.torch_version,
        "FLASH_RECIPE_VERSION": build.version,
        "SDIST": str(build.sdist),
    }
    if git_url is not None:
        variables.update({"GIT_URL": git_url, "GIT_REV": build.rev})
    if checkout is not None:
        variables["CHECKOUT"] = str(checkout)
    return variables


def path_environment(
    base: dict[str, str], *, home: Path, tools: Tools, python: str, extra: dict[str, str]
) -> dict[str, str]:
    """A clean environment: own HOME and caches, no inherited tool configuration or proxies."""
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith(_DROPPED_PREFIXES) and k not in _DROPPED and k.lower() not in _DROPPED
    }
    cache = home / ".cache"
    env.update(
        {
            "HOME": str(home),
            "XDG_CACHE_HOME": str(cache),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "PATH": os.pathsep.join([str(tools.bin), str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            "PIP_CONFIG_FILE": os.devnull,  # pip reads no configuration file at all
            "PIP_CACHE_DIR": str(cache / "pip"),
            "PIP_NO_INPUT": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "UV_CACHE_DIR": str(cache / "uv"),
            "UV_PYTHON_DOWNLOADS": "never",
            "UV_NO_PROGRESS": "1",
            "POETRY_CACHE_DIR": str(cache / "poetry"),
            "POETRY_CONFIG_DIR": str(home / ".config" / "poetry"),
            "POETRY_DATA_DIR": str(home / ".local" / "share" / "poetry"),
            "POETRY_NO_INTERACTION": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
        }
    )
    env.update(extra)
    return env


class StepFailed(Exception):
    """A command of a path exited with a non-zero status."""


def run_step(cmd: list, *, cwd: Path, env: dict[str, str], log_file: Path, timeout: float = 900) -> str:
    """Run ``cmd``, appending its output to ``log_file``; raise StepFailed on a non-zero exit.

    The command runs in its own process group, which is killed on Ctrl-C or timeout.
    """
    with open(log_file, "a") as handle:
        handle.write(f"\n$ {' '.join(map(str, cmd))}\n")
        handle.flush()
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=handle,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except BaseException:  # KeyboardInterrupt, timeout: take the whole group down
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        handle.write(out)
    if proc.returncode != 0:
        raise StepFailed(f"exit {proc.returncode}: {' '.join(map(str, cmd))}")
    return out


def dir_size_mb(root: Path) -> float:
    """Disk used under ``root``, counting each hard-linked file once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return round(total / 2**20, 1)


def sweep(root: Path) -> None:
    """Discard path directories left by runs that were killed (their lock is free)."""
    for directory in root.iterdir():
        if directory.name == "trash" or not (directory / ".in-use").exists():
            continue
        with open(directory / ".in-use") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running matrix holds it
        discard(directory, root / "trash")


def discard(directory: Path, trash: Path) -> None:
    """Remove ``directory``: moved aside at once, deleted by a background ``rm -rf``.

    Deleting a torch environment (tens of thousands of files) takes seconds to a minute on a
    busy disk; the next path need not wait for it. Whatever an interrupted run leaves in
    ``trash`` is deleted by the next call.
    """
    if not directory.exists():
        return
    trash.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f"{directory.name}.", dir=trash))
    try:
        directory.rename(target / directory.name)
    except OSError:  # another file system: delete in place
        shutil.rmtree(directory, ignore_errors=True)
    subprocess.Popen(
        ["rm", "-rf", *map(str, trash.iterdir())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
