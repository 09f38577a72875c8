"""Run one install path in a fresh, hermetic environment and check what it produced."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from recipes.harness.config import REPO_ROOT, Options
from recipes.harness.paths import RecipePath
from recipes.harness.prepare import (
    Build,
    Tools,
    Wheelhouse,
    interpreter_version,
    is_torch_coupled,
    locked_versions,
    log,
)
from recipes.harness.servers import PackageIndex, StaticServer, Tripwire, die_with_parent

# Variables of the calling environment that would let a path see the user's configuration,
# another environment or the network.
_DROPPED_PREFIXES = ("PIP_", "UV_", "POETRY_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "PIPX_", "XDG_", "GIT_")
_DROPPED = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}

# Run inside the path's environment by that environment's interpreter: what got installed, from
# where, by whom, and the hash of every Python file of the imported package.
PROBE = r"""
import hashlib, json, sys, importlib.util, importlib.metadata as md
from pathlib import Path
spec = importlib.util.find_spec("flash_recipe")
pkg = Path(spec.origin).parent
files = {p.relative_to(pkg.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in pkg.rglob("*.py")}
dist = md.distribution("flash-recipe")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({
    "executable": sys.executable,
    "package_dir": str(pkg),
    "files": files,
    "version": dist.version,
    "installer": (dist.read_text("INSTALLER") or "").strip() or None,
    "direct_url": json.loads(dist.read_text("direct_url.json") or "null"),
    "torch": version("torch"),
    "triton": version("triton"),
}))
"""


@dataclass
class Context:
    """What the paths of one run share."""

    options: Options
    tools: Tools
    build: Build
    wheelhouse: Wheelhouse
    run_dir: Path

    @property
    def python_version(self) -> str:
        return interpreter_version(self.options.python)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def wheel_file_hashes(wheel: Path) -> dict[str, str]:
    """sha256 of every Python file of the ``flash_recipe`` package inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if name.startswith("flash_recipe/") and name.endswith(".py")
        }


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


def path_environment(base: dict[str, str], *, home: Path, tools: Tools, python: str, extra: dict[str, str]) -> dict[str, str]:
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


def installer_matches(tool: str, installer: str | None) -> bool:
    """Whether a PEP 376 INSTALLER value names ``tool``: pip writes ``pip``, uv ``uv``, Poetry
    ``Poetry <version>``."""
    if not installer:
        return False
    if tool == "poetry":
        return re.fullmatch(r"(?i)poetry( \S+)?", installer) is not None
    return installer == tool


class StepFailed(Exception):
    pass


def run_step(cmd: list[str], *, cwd: Path, env: dict[str, str], log_file: Path, timeout: float = 900) -> str:
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


def tool_version(path: RecipePath, env: dict[str, str], env_python: Path, cwd: Path) -> str:
    if path.tool == "pip":
        cmd = [str(env_python), "-m", "pip", "--version"]
    else:
        cmd = [path.tool, "--version"]
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True).stdout
    match = re.search(r"(\d+\.\d+(\.\d+)?)", out)
    return match.group(1) if match else "?"


def _parse_json_object(text: str) -> dict:
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")
        if start < 0:
            raise
        return json.loads(text[start:])


def _add_poetry_index(pyproject: Path, index_url: str, python_constraint: str) -> None:
    """Make the local index the project's primary source and lock for one Python minor only."""
    text = pyproject.read_text()
    text += f'\n[[tool.poetry.source]]\nname = "index"\nurl = "{index_url}"\npriority = "primary"\n'
    if re.search(r"^\[tool\.poetry\.dependencies\]\s*$", text, re.M):
        text = re.sub(
            r"^(\[tool\.poetry\.dependencies\]\s*)$",
            lambda m: f'{m.group(1)}\npython = "{python_constraint}"',
            text,
            count=1,
            flags=re.M,
        )
    else:
        text += f'\n[tool.poetry.dependencies]\npython = "{python_constraint}"\n'
    pyproject.write_text(text)


def torch_closure(lock_text: str) -> set[str]:
    """The torch-coupled packages of a poetry.lock and everything they depend on."""
    packages = tomllib.loads(lock_text).get("package", [])
    deps = {}
    for package in packages:
        name = canonicalize_name(package["name"])
        deps.setdefault(name, set()).update(canonicalize_name(d) for d in package.get("dependencies", {}))
    todo = [name for name in deps if is_torch_coupled(name)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(deps.get(name, ()))
    return seen


def compare_locks(committed: str, hermetic: str, python_version: str, extras) -> tuple[list[str], list[str]]:
    """(problems, notes) of a lock re-resolved against the local index vs the committed one.

    Every package both hold must keep its locked version, except the torch-coupled ones (torch,
    triton, CUDA libraries), which follow the torch under test; the re-resolved lock may need a
    package the committed one lacks only as a dependency of the torch build under test.
    """
    old = locked_versions(committed, python_version, extras)
    new = locked_versions(hermetic, python_version, extras)
    for_torch = torch_closure(hermetic)
    problems, notes = [], []
    for name in sorted(new):
        if name not in old:
            text = f"{name} {sorted(new[name])} not in poetry.lock"
            if name in for_torch:
                notes.append(text + " (needed by the torch build under test)")
            else:
                problems.append(text)
        elif new[name] != old[name]:
            text = f"{name}: poetry.lock {sorted(old[name])}, local index {sorted(new[name])}"
            (notes if is_torch_coupled(name) else problems).append(text)
    return problems, notes


def sweep(workroot: Path) -> None:
    """Discard path directories left by runs that were killed (their lock is free)."""
    for directory in workroot.iterdir():
        if directory.name == "trash" or not (directory / ".in-use").exists():
            continue
        with open(directory / ".in-use") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running matrix holds it
        discard(directory, workroot / "trash")


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


def run_path(ctx: Context, path: RecipePath) -> dict:
    """Run ``path`` and return its result row (see ``report``)."""
    options, build = ctx.options, ctx.build
    logs = ctx.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / f"{path.id}.log"
    log_file.write_text("")
    # Outside the checkout: uv and Poetry look for a project in the parent directories.
    workroot = Path(tempfile.gettempdir()) / "flash-recipe-matrix"
    workroot.mkdir(exist_ok=True)
    sweep(workroot)
    workdir = Path(tempfile.mkdtemp(prefix=f"{ctx.run_dir.name}-{path.id}-", dir=workroot))
    # Held while the path runs; the kernel drops it when this process dies, however it dies.
    in_use = open(workdir / ".in-use", "w")
    fcntl.flock(in_use, fcntl.LOCK_EX)
    home, project, neutral = workdir / "home", workdir / "project", workdir / "neutral"
    for d in (home, neutral):
        d.mkdir(parents=True)
    row: dict = {
        "path": path.id,
        "tool": path.tool,
        "tool_version": None,
        "summary": path.summary,
        "install_s": None,
        "verify_s": None,
        "env_mb": None,
        "torch": None,
        "triton": None,
        "backends": [],
        "backend": None,
        "passed": False,
        "fingerprint": None,
        "checks": [],
        "error": None,
        "log": str(log_file),
        "workdir": str(workdir) if options.keep else None,
        "workdir_mb": None,
    }
    checks: list[Check] = []
    tripwire = Tripwire()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(tripwire)
            main_dirs = [ctx.wheelhouse.deps_dir, build.root / "dist"]
            if not path.torch_from_torch_index:
                main_dirs.append(ctx.wheelhouse.torch_dir)
            server = ctx.tools.exe("pypi-server")
            index = stack.enter_context(PackageIndex(server, main_dirs, logs / f"{path.id}.index.log", "index"))
            torch_index = stack.enter_context(
                PackageIndex(server, [ctx.wheelhouse.torch_dir], logs / f"{path.id}.torch-index.log", "torch-index")
            )
            recipe_env = {
                "PYTHON": options.python,
                "PYTHON_VERSION": ctx.python_version,
                "INDEX_URL": index.url,
                "TORCH_INDEX_URL": torch_index.url,
                "TORCH_VERSION": options.torch_version,
                "FLASH_RECIPE_VERSION": build.version,
                "SDIST": str(build.sdist),
            }
            if path.needs_git:
                git = stack.enter_context(StaticServer(build.git_root))
                recipe_env.update({"GIT_URL": git.url("flash-recipe.git"), "GIT_REV": build.rev})
            if path.project == "checkout":
                shutil.copytree(build.checkout, project, symlinks=True)
            else:
                project.mkdir()
                checkout = workdir / "checkout"
                shutil.copytree(build.checkout, checkout, symlinks=True)
                recipe_env["CHECKOUT"] = str(checkout)
            env = path_environment(
                dict(os.environ),
                home=home,
                tools=ctx.tools,
                python=options.python,
                extra={**tripwire.environment(), **recipe_env},
            )

            started = time.monotonic()
            if path.relock:
                checks.extend(_hermetic_lock(ctx, project, env, log_file, index.url))
            log(f"{path.id}: running recipe.sh")
            # The recipe as the build under test has it (the working tree may have moved on).
            script = build.checkout / path.script.relative_to(REPO_ROOT)
            run_step(["bash", script], cwd=project, env=env, log_file=log_file)
            row["install_s"] = round(time.monotonic() - started, 1)
            log(f"{path.id}: installed in {row['install_s']} s")

            env_dir = project / ".venv"
            env_python = env_dir / "bin" / "python"
            row["tool_version"] = tool_version(path, env, env_python, project)
            checks.append(Check("environment in .venv", env_python.exists(), str(env_dir)))
            checks.extend(_check_installed(ctx, path, env, env_python, neutral, log_file, row, recipe_env))
            checks.extend(_verify(ctx, path, env, env_dir, neutral, log_file, row))
            row["env_mb"] = dir_size_mb(env_dir)
    except StepFailed as exc:
        row["error"] = str(exc)
    except Exception as exc:  # one path's failure must not stop the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            row["workdir_mb"] = dir_size_mb(workdir)  # environment, project and tool caches
        if not options.keep:
            discard(workdir, workroot / "trash")
        in_use.close()
    # Also when the recipe failed: a refused download is the likeliest reason.
    checks.append(Check("no network access", not tripwire.attempts, "; ".join(tripwire.attempts[:5])))
    row["checks"] = [c.__dict__ for c in checks]
    row["passed"] = row["error"] is None and bool(checks) and all(c.ok for c in checks)
    return row


def _hermetic_lock(ctx: Context, project: Path, env: dict, log_file: Path, index_url: str) -> list[Check]:
    """Re-resolve poetry.lock against the local index (see recipes/poetry-lock-dev/README.md)."""
    checks = []
    run_step(["poetry", "check", "--lock"], cwd=project, env=env, log_file=log_file)
    checks.append(Check("poetry.lock in sync with pyproject.toml", True, "poetry check --lock"))
    committed = (project / "poetry.lock").read_text()
    _add_poetry_index(project / "pyproject.toml", index_url, f"~{ctx.python_version}")
    log("poetry-lock-dev: re-resolving poetry.lock against the local index")
    # Locking needs no environment; without this Poetry would make one now, and the recipe
    # would then find and reuse it instead of creating the project's own .venv.
    lock_env = {**env, "POETRY_VIRTUALENVS_CREATE": "false"}
    run_step(["poetry", "lock", "--regenerate"], cwd=project, env=lock_env, log_file=log_file)
    extras = sorted(tomllib.loads((project / "pyproject.toml").read_text())["project"].get("optional-dependencies", {}))
    problems, notes = compare_locks(committed, (project / "poetry.lock").read_text(), ctx.python_version, extras)
    checks.append(
        Check(
            "local-index lock keeps poetry.lock's versions",
            not problems,
            "; ".join(problems) or ("torch build under test: " + "; ".join(notes) if notes else "identical"),
        )
    )
    return checks


def _check_installed(ctx, path: RecipePath, env, env_python: Path, cwd: Path, log_file, row, recipe_env) -> list[Check]:
    out = run_step([env_python, "-I", "-c", PROBE], cwd=cwd, env=env, log_file=log_file)
    probe = _parse_json_object(out)
    row["torch"], row["triton"] = probe["torch"], probe["triton"]
    checks = [
        Check("flash-recipe version", probe["version"] == ctx.build.version, probe["version"]),
        Check(
            "files are the build under test",
            probe["files"] == wheel_file_hashes(ctx.build.wheel),
            probe["package_dir"],
        ),
        Check(f"INSTALLER names {path.tool}", installer_matches(path.tool, probe["installer"]), str(probe["installer"])),
        Check(
            f"torch {ctx.options.torch_version}",
            bool(probe["torch"]) and probe["torch"].split("+")[0] == ctx.options.torch_version,
            str(probe["torch"]),
        ),
    ]
    direct = probe["direct_url"] or {}
    editable = bool(direct.get("dir_info", {}).get("editable", False))
    checks.append(Check("editable" if path.editable else "not editable", editable == path.editable, str(direct or "")))
    url = direct.get("url")
    if path.source == "index":
        ok, detail = not direct, "from the index"
    elif path.source == "git":
        commit = direct.get("vcs_info", {}).get("commit_id")
        ok = url == recipe_env["GIT_URL"] and commit == ctx.build.rev
        detail = f"{url} @ {commit}"
    else:
        ok, detail = bool(url) and url.startswith("file://"), str(url)
    checks.append(Check(f"source: {path.source}", ok, detail))
    return checks


def triton_interpret(options: Options) -> str:
    """``1`` when verify runs the Triton kernels through the interpreter (no GPU visible)."""
    if options.triton_interpret != "auto":
        return options.triton_interpret
    return "0" if shutil.which("nvidia-smi") or Path("/dev/kfd").exists() else "1"


def _verify(ctx, path: RecipePath, env, env_dir: Path, cwd: Path, log_file, row) -> list[Check]:
    verify_env = dict(env)
    interpret = triton_interpret(ctx.options)
    if interpret == "1":
        verify_env["TRITON_INTERPRET"] = "1"
    started = time.monotonic()
    cmd = [env_dir / "bin" / "flash-recipe", "verify", "--json"]
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=verify_env, capture_output=True, text=True, timeout=900)
    row["verify_s"] = round(time.monotonic() - started, 1)
    with open(log_file, "a") as handle:
        handle.write(f"\n$ {' '.join(map(str, cmd))}  (TRITON_INTERPRET={interpret})\n{proc.stdout}\n{proc.stderr}\n")
    try:
        result = _parse_json_object(proc.stdout)
    except ValueError:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return [Check("flash-recipe verify --json", False, f"exit {proc.returncode}, no JSON: {' | '.join(tail)}")]
    backends = list(result.get("backends") or [])
    install = result.get("install") or {}
    row.update(fingerprint=result.get("fingerprint"), backends=backends)
    row["backend"] = "triton" if "triton" in backends else (backends[0] if backends else None)
    return [
        Check("verify passed", proc.returncode == 0 and result.get("passed") is True, f"exit {proc.returncode}"),
        Check("triton among verified backends", "triton" in backends, ", ".join(backends)),
        Check(
            "verify sees this install",
            installer_matches(path.tool, install.get("installer"))
            and install.get("version") == ctx.build.version
            and bool(install.get("editable")) == path.editable,
            json.dumps(install, sort_keys=True),
        ),
        Check("fingerprint", bool(result.get("fingerprint")), str(result.get("fingerprint"))),
    ]
