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
import functools
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from recipes.harness.paths import RecipePath
from recipes.harness.prepare import Build, Tools
from recipes.harness.processes import ended_with_harness

# Variables of the calling environment that would let a path see the user's configuration,
# another environment or the network.
_DROPPED_PREFIXES = ("PIP_", "UV_", "POETRY_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "PIPX_", "XDG_", "GIT_")
_DROPPED = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}


class UnsafeWorkroot(RuntimeError):
    """The work root exists but another user could steer what the harness deletes in it."""


def workroot(base: Path | None = None) -> Path:
    """The directory holding every path's workspace: ``flash-recipe-matrix-<uid>`` in ``base``
    (default the system temporary directory), created 0700 if missing.

    On a shared machine another user can create that name first; the harness then refuses it
    (``UnsafeWorkroot``) unless it is a real directory (not a symlink), owned by this user, and
    private (mode 0700, no access for group or others)."""
    base = Path(base if base is not None else tempfile.gettempdir())
    root = base / f"flash-recipe-matrix-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    else:
        return root
    raise UnsafeWorkroot(
        f"the install matrix's work root {root} {problem}: another user may have created it to steer what the "
        f"harness deletes. Check it, remove it (or `chmod 700` it if it is yours) and run again."
    )


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

    def place_project(self, build: Build, path: RecipePath) -> None:
        """The project directory: a copy of the build's checkout where ``path`` is given one,
        else empty (``prepare_given`` then makes what the path is given)."""
        if path.given == "checkout":
            shutil.copytree(build.checkout, self.project, symlinks=True)
        else:
            self.project.mkdir()

    def python_bin(self, python: str) -> Path:
        """A directory holding ``python3`` and ``python``, both ``python``: first on the path's
        PATH, so that a recipe's ``python3`` (and Poetry's choice of interpreter) is the run's."""
        directory = self.dir / "python-bin"
        directory.mkdir(exist_ok=True)
        for name in ("python3", "python"):
            (directory / name).symlink_to(python)
        return directory

    def trust(self, ca_file: str) -> None:
        """The git configuration in the path's HOME: trust the run's certificate authority (the
        ``http.sslCAInfo`` that Poetry's git client, dulwich, reads; git itself also reads
        ``GIT_SSL_CAINFO``)."""
        (self.home / ".gitconfig").write_text(f"[http]\n\tsslCAInfo = {ca_file}\n")

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


def prepare_given(
    path: RecipePath,
    project: Path,
    *,
    env: dict[str, str],
    log_file: Path,
    index_url: str,
    python_version: str,
    torch_version: str,
) -> None:
    """Make in ``project`` what ``path`` is given (``paths.GIVEN``) before the recipe's first line.

    - ``poetry-project``: ``poetry init`` for this Python minor, with the run's package index
      (``index_url``) as its primary source: Poetry has no variable for its default source, and
      its client for PyPI needs PyPI's JSON API, which the run's pypiserver does not serve;
    - ``pip-project-pinning-torch``: ``.venv`` and a requirements.txt pinning the torch under
      test, installed (from the default index: the run's, standing in for PyPI);
    - ``nothing`` and ``checkout``: nothing more (``Workspace.place_project``).
    """
    if path.given == "poetry-project":
        init = ["poetry", "init", "--no-interaction", "--name", "consumer", "--python", f"~{python_version}"]
        run_step(init, cwd=project, env=env, log_file=log_file)
        source = ["poetry", "source", "add", "--priority=primary", "index", index_url]
        run_step(source, cwd=project, env=env, log_file=log_file)
    elif path.given == "pip-project-pinning-torch":
        run_step(["python3", "-m", "venv", ".venv"], cwd=project, env=env, log_file=log_file)
        (project / "requirements.txt").write_text(f"torch=={torch_version}\n")
        install = [".venv/bin/python", "-m", "pip", "install", "-r", "requirements.txt"]
        run_step(install, cwd=project, env=env, log_file=log_file)


def path_environment(
    base: dict[str, str], *, home: Path, tools: Tools, python: str, python_bin: Path, extra: dict[str, str]
) -> dict[str, str]:
    """A clean environment: own HOME and caches, no inherited tool configuration or proxies;
    ``python_bin`` (``python3``: the run's interpreter) first on PATH, where uv and Poetry look for
    an interpreter too (never ``UV_PYTHON``: for ``uv pip`` it names the environment to install
    into, which would be the base interpreter); Poetry keeps a project's environment in ``.venv``."""
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
            "PATH": os.pathsep.join(
                [str(python_bin), str(tools.bin), str(Path(python).parent), "/usr/local/bin", "/usr/bin", "/bin"]
            ),
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
            "POETRY_VIRTUALENVS_IN_PROJECT": "true",
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

    The command runs in its own process group, which is killed on Ctrl-C or timeout, and ended
    when the step ends or the harness dies by any signal (``processes.ended_with_harness``).
    """
    with open(log_file, "a") as handle:
        handle.write(f"\n$ {' '.join(map(str, cmd))}\n")
        handle.flush()
        start = functools.partial(
            subprocess.Popen,
            [str(c) for c in cmd],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=handle,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # preexec_fn: ended_with_harness's
        )
        with ended_with_harness(start) as proc:
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


def _real_dir(path: Path) -> bool:
    """A directory itself, not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def sweep(root: Path) -> None:
    """Discard path directories left by runs that were killed (their lock is free). Only real
    directories with a regular ``.in-use`` file are candidates: a symlink is never followed."""
    for directory in root.iterdir():
        if directory.name == "trash" or not _real_dir(directory):
            continue
        try:
            fd = os.open(directory / ".in-use", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # missing, or a symlink
            continue
        with os.fdopen(fd) as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running matrix holds it
            discard(directory, root / "trash")


def _trash_dir(trash: Path) -> Path:
    """``trash`` as a private real directory: anything else by that name (a symlink planted to
    make the deletion below reach elsewhere) is removed first, without following it."""
    if trash.is_symlink() or (trash.exists() and not _real_dir(trash)):
        trash.unlink()
    with contextlib.suppress(FileExistsError):
        os.mkdir(trash, 0o700)
    return trash


def discard(directory: Path, trash: Path) -> None:
    """Remove ``directory``: moved aside at once, deleted by a background ``rm -rf``.

    Deleting a torch environment (tens of thousands of files) takes seconds to a minute on a
    busy disk; the next path need not wait for it. Whatever an interrupted run leaves in
    ``trash`` is deleted by the next call. Symlinks are removed as links, never followed
    (``rm -rf`` and ``shutil.rmtree`` both work so), and a ``directory`` that is a symlink is
    only unlinked.
    """
    if directory.is_symlink():
        directory.unlink()
        return
    if not directory.exists():
        return
    trash = _trash_dir(trash)
    target = Path(tempfile.mkdtemp(prefix=f"{directory.name}.", dir=trash))
    try:
        directory.rename(target / directory.name)
    except OSError:  # another file system: delete in place
        shutil.rmtree(directory, ignore_errors=True)
    subprocess.Popen(
        ["rm", "-rf", "--", *map(str, trash.iterdir())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
