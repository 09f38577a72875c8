"""The checks of one path: what its recipe installed, and whether that is the build under test.

Each check returns what it found, a list of :class:`Check` and the facts the report shows (torch
and triton versions, verify's backends and fingerprint); the runner puts them into the path's row.
The functions that judge (``check_*``) take facts already gathered and run nothing; the ones that
gather (``probe_install``, ``run_verify``, ``tool_version``) run a command in the path's
environment; ``hermetic_lock`` does both for poetry.lock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from packaging.utils import canonicalize_name

from recipes.harness import public_hosts
from recipes.harness.config import Options
from recipes.harness.paths import RecipePath
from recipes.harness.prepare import Build, is_torch_coupled, locked_versions, log
from recipes.harness.processes import ended_with_harness
from recipes.harness.workspace import run_step


def record_digest(lines: list[str]) -> str:
    """sha256 over the sorted ``path,hash`` rows of a RECORD that come from the wheel, and their
    count: an installer adds INSTALLER, REQUESTED, direct_url.json, bytecode and console scripts.
    Computed alike on an installed RECORD (inside :data:`PROBE`) and on a wheel's own."""
    import hashlib

    added = ("/INSTALLER", "/REQUESTED", "/direct_url.json", "/RECORD", "/uv_cache.json", "/uv_build.json")
    rows = sorted(
        ",".join(line.split(",")[:2])
        for line in lines
        if line and "__pycache__/" not in line and not line.split(",")[0].endswith(added) and not line.startswith("../")
    )
    return hashlib.sha256("\n".join(rows).encode()).hexdigest() + ":" + str(len(rows))


# Run inside the path's environment by that environment's interpreter: what got installed, from
# where, by whom, the hash of every Python file of the imported package, and the RECORD digest of
# the torch installed beside it.
PROBE = r"""
import hashlib, json, sys, importlib.util, importlib.metadata as md
from pathlib import Path
spec = importlib.util.find_spec("flash_recipe")
pkg = Path(spec.origin).parent
files = {p.relative_to(pkg.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in pkg.rglob("*.py")}
dist = md.distribution("flash-recipe")
{RECORD_DIGEST}
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
    "torch_record": record_digest((md.distribution("torch").read_text("RECORD") or "").splitlines())
    if version("torch") else None,
}))
""".replace("{RECORD_DIGEST}", inspect.getsource(record_digest))


@dataclass
class Check:
    """One line of a path's checklist: what was checked, whether it held, and what was seen."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class Installed:
    """What the probe found installed in the path's environment, and the checks on it."""

    torch: str | None
    triton: str | None
    checks: list[Check]


@dataclass
class VerifyRun:
    """The outcome of ``flash-recipe verify --json`` in the path's environment."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


@dataclass
class Verified:
    """What verify reported (nothing when it printed no JSON), and the checks on it."""

    checks: list[Check]
    fingerprint: str | None = None
    backends: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str | None:
        """The backend the report names: triton when verified, else the first one verified."""
        if "triton" in self.backends:
            return "triton"
        return self.backends[0] if self.backends else None


# --- helpers ---------------------------------------------------------------------------------


def parse_json_object(text: str) -> dict:
    """The JSON object in ``text``, skipping anything printed before its first ``{``."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")
        if start < 0:
            raise
        return json.loads(text[start:])


def wheel_file_hashes(wheel: Path) -> dict[str, str]:
    """sha256 of every Python file of the ``flash_recipe`` package inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if name.startswith("flash_recipe/") and name.endswith(".py")
        }


def wheel_record_digest(wheel: Path) -> str:
    """:data:`RECORD_DIGEST` of the RECORD inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(name for name in archive.namelist() if name.endswith(".dist-info/RECORD"))
        return record_digest(archive.read(record).decode().splitlines())


def installer_matches(tool: str, installer: str | None) -> bool:
    """Whether a PEP 376 INSTALLER value names ``tool``: pip writes ``pip``, uv ``uv``, Poetry
    ``Poetry <version>``."""
    if not installer:
        return False
    if tool == "poetry":
        return re.fullmatch(r"(?i)poetry( \S+)?", installer) is not None
    return installer == tool


def triton_interpret(options: Options) -> str:
    """``1`` when verify runs the Triton kernels through the interpreter (no GPU visible)."""
    if options.triton_interpret != "auto":
        return options.triton_interpret
    return "0" if shutil.which("nvidia-smi") or Path("/dev/kfd").exists() else "1"


# --- gathering -------------------------------------------------------------------------------


def tool_version(path: RecipePath, env: dict[str, str], env_python: Path, cwd: Path) -> str:
    """The version of the tool that ran ``path``'s recipe, as it reports it; ``?`` if it does not."""
    cmd = [str(env_python), "-m", "pip", "--version"] if path.tool == "pip" else [path.tool, "--version"]
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True).stdout
    match = re.search(r"(\d+\.\d+(\.\d+)?)", out)
    return match.group(1) if match else "?"


def probe_install(env_python: Path, *, env: dict[str, str], cwd: Path, log_file: Path) -> dict:
    """Run :data:`PROBE` with the environment's interpreter (isolated mode) and return its report."""
    out = run_step([env_python, "-I", "-c", PROBE], cwd=cwd, env=env, log_file=log_file)
    return parse_json_object(out)


def run_verify(env_dir: Path, *, env: dict[str, str], cwd: Path, log_file: Path, interpret: str) -> VerifyRun:
    """Run the environment's ``flash-recipe verify --json``, logging its output to ``log_file``."""
    verify_env = dict(env)
    if interpret == "1":
        verify_env["TRITON_INTERPRET"] = "1"
    started = time.monotonic()
    cmd = [env_dir / "bin" / "flash-recipe", "verify", "--json"]
    start = functools.partial(
        subprocess.Popen,
        [str(c) for c in cmd],
        cwd=cwd,
        env=verify_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # preexec_fn: ended_with_harness's
    )
    with ended_with_harness(start) as proc:  # its children end with it, and with the harness
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    seconds = round(time.monotonic() - started, 1)
    with open(log_file, "a") as handle:
        handle.write(f"\n$ {' '.join(map(str, cmd))}  (TRITON_INTERPRET={interpret})\n{stdout}\n{stderr}\n")
    return VerifyRun(proc.returncode, stdout, stderr, seconds)


# --- judging ---------------------------------------------------------------------------------


def check_environment(env_dir: Path) -> Check:
    """The recipe left its environment in the project's ``.venv``."""
    return Check("environment in .venv", (env_dir / "bin" / "python").exists(), str(env_dir))


def check_install(
    probe: dict,
    path: RecipePath,
    *,
    build: Build,
    torch_version: str,
    torch_wheel: Path | None = None,
) -> Installed:
    """The probe's report against what ``path`` must have installed: the build under test (version
    and files), by the path's tool, from the path's source, editable or not, next to the torch
    under test. ``torch_wheel``: the one torch wheel the run serves; the installed torch must be it,
    row for row of its RECORD (the torch the consumer pinned, untouched by adding flash-recipe).
    A ``git`` path installs from the repository's public URL (``public_hosts.REPOSITORY_URL``,
    which the run's git server answers) at the commit under test."""
    checks = [
        Check("flash-recipe version", probe["version"] == build.version, probe["version"]),
        Check(
            "files are the build under test",
            probe["files"] == wheel_file_hashes(build.wheel),
            probe["package_dir"],
        ),
        Check(
            f"INSTALLER names {path.tool}",
            installer_matches(path.tool, probe["installer"]),
            str(probe["installer"]),
        ),
        Check(
            f"torch {torch_version}",
            bool(probe["torch"]) and probe["torch"].split("+")[0] == torch_version,
            str(probe["torch"]),
        ),
    ]
    if torch_wheel is not None:
        want = wheel_record_digest(torch_wheel)
        checks.append(
            Check(
                f"torch is {torch_wheel.name}, untouched (RECORD)",
                probe.get("torch_record") == want,
                f"{probe.get('torch_record')} (wheel: {want})",
            )
        )
    direct = probe["direct_url"] or {}
    editable = bool(direct.get("dir_info", {}).get("editable", False))
    checks.append(Check("editable" if path.editable else "not editable", editable == path.editable, str(direct or "")))
    url = direct.get("url")
    if path.source == "index":
        ok, detail = not direct, "from the index"
    elif path.source == "git":
        commit = direct.get("vcs_info", {}).get("commit_id")
        ok = url is not None and url.removesuffix(".git") == public_hosts.REPOSITORY_URL and commit == build.rev
        detail = f"{url} @ {commit}"
    else:
        ok, detail = bool(url) and url.startswith("file://"), str(url)
    checks.append(Check(f"source: {path.source}", ok, detail))
    return Installed(torch=probe["torch"], triton=probe["triton"], checks=checks)


def check_verify(run: VerifyRun, path: RecipePath, version: str) -> Verified:
    """Verify's JSON report: it passed, triton among its backends, it saw this very install (tool,
    version, editable or not), and it gave a fingerprint."""
    try:
        result = parse_json_object(run.stdout)
    except ValueError:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        detail = f"exit {run.returncode}, no JSON: {' | '.join(tail)}"
        return Verified([Check("flash-recipe verify --json", False, detail)])
    backends = list(result.get("backends") or [])
    install = result.get("install") or {}
    checks = [
        Check("verify passed", run.returncode == 0 and result.get("passed") is True, f"exit {run.returncode}"),
        Check("triton among verified backends", "triton" in backends, ", ".join(backends)),
        Check(
            "verify sees this install",
            installer_matches(path.tool, install.get("installer"))
            and install.get("version") == version
            and bool(install.get("editable")) == path.editable,
            json.dumps(install, sort_keys=True),
        ),
        Check("fingerprint", bool(result.get("fingerprint")), str(result.get("fingerprint"))),
    ]
    return Verified(checks, fingerprint=result.get("fingerprint"), backends=backends)


def check_network(attempts: list[str]) -> Check:
    """No command of the path tried to reach beyond loopback (the tripwire's record)."""
    return Check("no network access", not attempts, "; ".join(attempts[:5]))


def interpreter_packages(python: str) -> dict[str, float]:
    """The distributions installed in ``python``'s own site-packages (not a virtualenv's): each
    ``*.dist-info`` directory and its modification time."""
    code = "import json, sysconfig; print(json.dumps([sysconfig.get_path(n) for n in ('purelib', 'platlib')]))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    return {
        str(info): info.stat().st_mtime
        for directory in set(json.loads(out))
        if Path(directory).is_dir()
        for info in Path(directory).glob("*.dist-info")
    }


def check_interpreter_untouched(before: dict[str, float], after: dict[str, float]) -> Check:
    """The interpreter the environments are built from has the same distributions as before the
    path ran: a recipe installs into its own environment only."""
    changed = sorted(set(before) ^ set(after) | {p for p in set(before) & set(after) if before[p] != after[p]})
    return Check("base interpreter untouched", not changed, "; ".join(Path(p).name for p in changed[:5]))


# --- poetry.lock (poetry-lock-dev) -------------------------------------------------------------


def add_poetry_index(pyproject: Path, index_url: str, python_constraint: str) -> None:
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


def check_lock_comparison(problems: list[str], notes: list[str]) -> Check:
    """The re-resolved lock kept poetry.lock's versions; the detail names what differs."""
    detail = "; ".join(problems) or ("torch build under test: " + "; ".join(notes) if notes else "identical")
    return Check("local-index lock keeps poetry.lock's versions", not problems, detail)


def hermetic_lock(project: Path, *, env: dict, log_file: Path, index_url: str, python_version: str) -> list[Check]:
    """Re-resolve poetry.lock against the local index (see recipes/poetry-lock-dev/README.md).

    Leaves the re-resolved lock (and the project's pyproject.toml naming the local index) in
    ``project`` for the recipe; raises StepFailed when Poetry fails.
    """
    run_step(["poetry", "check", "--lock"], cwd=project, env=env, log_file=log_file)
    in_sync = Check("poetry.lock in sync with pyproject.toml", True, "poetry check --lock")
    committed = (project / "poetry.lock").read_text()
    add_poetry_index(project / "pyproject.toml", index_url, f"~{python_version}")
    log("poetry-lock-dev: re-resolving poetry.lock against the local index")
    # Locking needs no environment; without this Poetry would make one now, and the recipe
    # would then find and reuse it instead of creating the project's own .venv.
    lock_env = {**env, "POETRY_VIRTUALENVS_CREATE": "false"}
    run_step(["poetry", "lock", "--regenerate"], cwd=project, env=lock_env, log_file=log_file)
    extras = sorted(tomllib.loads((project / "pyproject.toml").read_text())["project"].get("optional-dependencies", {}))
    problems, notes = compare_locks(committed, (project / "poetry.lock").read_text(), python_version, extras)
    return [in_sync, check_lock_comparison(problems, notes)]
