"""What every path shares, built once and cached: tools, the project's build, the wheelhouse.

Each cached item lives in a directory named after what determines its content and is complete
only when its ``.done`` marker exists; it is built under a file lock, so reruns reuse it and
concurrent runs neither clash nor build it twice. These steps may use the network (through pip's
own configuration); path runs never do.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from recipes.harness.config import REPO_ROOT, TOOLS, Options, slug

# Packages whose build must match the torch build under test: they follow the wheelhouse's
# torch, not poetry.lock.
TORCH_COUPLED_PREFIXES = ("torch", "triton", "nvidia-", "cuda-")


def log(message: str) -> None:
    print(f"[install-matrix] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None, quiet: bool = True) -> str:
    """Run ``cmd``; on failure raise with its output."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}")
    if not quiet:
        print(proc.stdout, end="")
    return proc.stdout


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_dir(target: Path, build) -> Path:
    """Return ``target``, building it with ``build(target)`` first if it is not complete.

    An incomplete directory (a run interrupted while building it) is removed and built again.
    """
    if (target / ".done").exists():
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / ".done").exists():
            return target
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        try:
            build(target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        (target / ".done").write_text("")
    return target


# --- tools ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def bin(self) -> Path:
        """A directory holding only the tools' commands, for the front of a path run's PATH."""
        return self.root / "bin"

    def exe(self, name: str) -> Path:
        return self.root / "venv" / "bin" / name


def tools_env(options: Options) -> Tools:
    """A virtualenv with Poetry, uv, pypiserver and build, installed with pip's configuration."""
    pins = [f"{name}=={version}" for name, version in TOOLS.items()]
    target = options.cache_dir / "tools" / slug(" ".join(pins) + options.python)

    def build(tmp: Path) -> None:
        log(f"installing tools: {', '.join(pins)}")
        run([options.python, "-m", "venv", tmp / "venv"])
        run([tmp / "venv" / "bin" / "python", "-m", "pip", "install", "--quiet", *pins])
        (tmp / "bin").mkdir()
        for name in ("poetry", "uv", "uvx"):
            (tmp / "bin" / name).symlink_to(tmp / "venv" / "bin" / name)

    return Tools(cached_dir(target, build))


# --- the project -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Build:
    root: Path
    version: str
    rev: str

    @property
    def sdist(self) -> Path:
        return next((self.root / "dist").glob("*.tar.gz"))

    @property
    def wheel(self) -> Path:
        return next((self.root / "dist").glob("*.whl"))

    @property
    def checkout(self) -> Path:
        """The snapshot of the working tree the build was made from (a git repository)."""
        return self.root / "checkout"

    @property
    def git_root(self) -> Path:
        """The directory served over HTTP: it holds the bare repository ``flash-recipe.git``."""
        return self.root / "git"


GIT_ENV = {
    "GIT_AUTHOR_NAME": "install-matrix",
    "GIT_AUTHOR_EMAIL": "install-matrix@localhost",
    "GIT_COMMITTER_NAME": "install-matrix",
    "GIT_COMMITTER_EMAIL": "install-matrix@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}


def working_tree_files(repo: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the working tree (what a commit would hold)."""
    out = run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    return sorted({name for name in out.split("\0") if name and (repo / name).is_file()})


def snapshot(repo: Path, dest: Path, source: str = "worktree") -> str:
    """Copy the working tree (or the git revision ``source``) to ``dest`` and commit it there;
    return the commit id.

    The commit's author, committer and dates are fixed, so the same tree gives the same commit.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if source == "worktree":
        for name in working_tree_files(repo):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, target)
    else:
        archive = subprocess.run(
            ["git", "-C", repo, "archive", "--format=tar", source], capture_output=True, check=False
        )
        if archive.returncode != 0:
            raise RuntimeError(f"git archive {source} failed: {archive.stderr.decode(errors='replace')}")
        subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    env = {**os.environ, **GIT_ENV}
    run(["git", "init", "--quiet", "--initial-branch=main", dest], env=env)
    run(["git", "-C", dest, "add", "--all"], env=env)
    run(["git", "-C", dest, "commit", "--quiet", "--no-verify", "--message", "install-matrix snapshot"], env=env)
    return run(["git", "-C", dest, "rev-parse", "HEAD"], env=env).strip()


def project_build(options: Options, tools: Tools, repo: Path = REPO_ROOT, rev: str | None = None) -> Build:
    """Snapshot the working tree, build its sdist and wheel, and make the bare repository.

    With ``rev``, reuse that earlier build instead (all paths of one run test the same build,
    even if the working tree changes meanwhile).
    """
    builds = options.cache_dir / "builds"
    if rev is not None and (builds / rev / ".done").exists():
        return _build_at(builds / rev, rev)
    builds.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".snapshot.", dir=builds))
    try:
        rev = snapshot(repo, scratch, options.source)

        def build(target: Path) -> None:
            log(f"building sdist and wheel of {rev[:12]}")
            shutil.copytree(scratch, target / "checkout", symlinks=True)
            run([tools.python, "-m", "build", "--outdir", target / "dist", target / "checkout"])
            (target / "git").mkdir()
            env = {**os.environ, **GIT_ENV}
            bare = target / "git" / "flash-recipe.git"
            run(["git", "clone", "--quiet", "--bare", target / "checkout", bare], env=env)
            run(["git", "-C", bare, "update-server-info"], env=env)
            # The build leaves nothing behind in the checkout, so it stays the tree of `rev`.
            run(["git", "-C", target / "checkout", "clean", "-fdxq"], env=env)

        root = cached_dir(builds / rev, build)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _build_at(root, rev)


def _build_at(root: Path, rev: str) -> Build:
    with open(root / "checkout" / "pyproject.toml", "rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    return Build(root, version, rev)


# --- the wheelhouse --------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheelhouse:
    root: Path

    @property
    def torch_dir(self) -> Path:
        """Only torch: what the dedicated torch index serves."""
        return self.root / "torch"

    @property
    def deps_dir(self) -> Path:
        """Everything else the paths need (torch's dependencies, triton, build backend, dev tools)."""
        return self.root / "deps"

    def size_mb(self) -> float:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file()) / 2**20


def dependency_group(pyproject: dict, name: str) -> list[str]:
    """The requirements of PEP 735 dependency group ``name``, with ``include-group`` expanded."""
    groups = pyproject.get("dependency-groups", {})
    out: list[str] = []
    for item in groups[name]:
        if isinstance(item, dict):
            out.extend(dependency_group(pyproject, item["include-group"]))
        else:
            out.append(item)
    return out


def is_torch_coupled(name: str) -> bool:
    name = canonicalize_name(name)
    return name == "torch" or name == "triton" or name.startswith(TORCH_COUPLED_PREFIXES[2:])


# Platforms a lock is resolved for; a locked package is needed when its markers hold on any.
_PLATFORMS = (
    {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64"},
    {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "aarch64"},
    {"sys_platform": "darwin", "platform_system": "Darwin", "os_name": "posix", "platform_machine": "arm64"},
    {"sys_platform": "win32", "platform_system": "Windows", "os_name": "nt", "platform_machine": "AMD64"},
)


def locked_versions(lock_text: str, python_version: str, extras: Sequence[str] = ()) -> dict[str, set[str]]:
    """Package name -> locked versions, for every package of a poetry.lock the given Python may need.

    That is every package whose markers hold for that Python on some platform, with no extra or
    one of ``extras``, since Poetry resolves a lock for all of them.
    """
    lock = tomllib.loads(lock_text)
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    envs = [{**env, **platform, "extra": extra} for platform in _PLATFORMS for extra in ("", *extras)]
    versions: dict[str, set[str]] = {}
    for package in lock.get("package", []):
        markers = package.get("markers")
        if isinstance(markers, dict):  # per-group markers
            markers = " or ".join(f"({m})" for m in markers.values())
        if markers and not any(Marker(markers).evaluate(e) for e in envs):
            continue
        versions.setdefault(canonicalize_name(package["name"]), set()).add(package["version"])
    return versions


def locked_pins(lock_text: str, python_version: str, extras: Sequence[str] = ()) -> list[str]:
    """``name==version`` for the packages ``locked_versions`` gives, except those coupled to the
    torch build: they follow the torch under test."""
    return sorted(
        f"{name}=={version}"
        for name, versions in locked_versions(lock_text, python_version, extras).items()
        if not is_torch_coupled(name)
        for version in versions
    )


# Platforms whose wheels a lock may pin without a file for this machine (triton-windows is for
# Windows only): Poetry and uv resolve for every platform, so the index must hold one.
FOREIGN_PLATFORMS = ("win_amd64", "macosx_11_0_arm64", "manylinux2014_aarch64")


def locked_hashes(lock_text: str) -> dict[tuple[str, str], list[str]]:
    """``(name, version) -> ["sha256:...", ...]``: the hashes poetry.lock records for each file
    of each locked package."""
    hashes: dict[tuple[str, str], list[str]] = {}
    for package in tomllib.loads(lock_text).get("package", []):
        key = (canonicalize_name(package["name"]), package["version"])
        hashes.setdefault(key, []).extend(f["hash"] for f in package.get("files", []) if "hash" in f)
    return hashes


def hashed_requirements(pins: Sequence[str], hashes: dict[tuple[str, str], list[str]]) -> str:
    """A requirements file of ``pins`` (``name==version``) for pip's ``--require-hashes`` mode:
    each line carries every hash poetry.lock records for that version (the export of the lock)."""
    lines = []
    for pin in pins:
        name, version = pin.split("==")
        found = hashes.get((canonicalize_name(name), version))
        if not found:
            raise RuntimeError(f"poetry.lock records no file hashes for {pin}")
        lines.append(" ".join([pin, *(f"--hash={h}" for h in found)]))
    return "".join(line + "\n" for line in lines)


def mismatched_locked_files(directory: Path, lock_text: str) -> list[str]:
    """The files in ``directory`` that poetry.lock names but whose sha256 differs from the lock's."""
    expected = {}
    for package in tomllib.loads(lock_text).get("package", []):
        for f in package.get("files", []):
            if f.get("hash", "").startswith("sha256:"):
                expected[f["file"]] = f["hash"][len("sha256:") :]
    bad = []
    for path in sorted(directory.iterdir()):
        if path.name in expected and hashlib.sha256(path.read_bytes()).hexdigest() != expected[path.name]:
            bad.append(path.name)
    return bad


def download_foreign(pip: list, dest: Path, requirements: Path, python_version: str) -> bool:
    """Download the wheel of the one pin in the hashed ``requirements`` file for another platform
    (the first of ``FOREIGN_PLATFORMS`` it has) for this Python into ``dest``; False if none has one."""
    for platform in FOREIGN_PLATFORMS:
        try:
            run([*pip, "download", "--quiet", "--no-deps", "--require-hashes", "--dest", dest, "--only-binary=:all:",
                 "--platform", platform, "--python-version", python_version, "-r", requirements])  # fmt: skip
        except RuntimeError:
            continue
        log(f"  {requirements.read_text().split()[0]}: the {platform} wheel (no file for this machine)")
        return True
    return False


def interpreter_version(python: str) -> str:
    return run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).strip()


def wheelhouse(options: Options, tools: Tools, build: Build) -> Wheelhouse:
    """Download torch, and then everything the paths install, with pip's own configuration."""
    repo = build.checkout
    with open(repo / "pyproject.toml", "rb") as handle:
        pyproject = tomllib.load(handle)
    lock_path = repo / "poetry.lock"
    lock_text = lock_path.read_text() if lock_path.exists() else ""
    python_version = interpreter_version(options.python)
    extras = sorted(pyproject["project"].get("optional-dependencies", {}))
    pins = locked_pins(lock_text, python_version, extras) if lock_text else []
    groups = sorted({r for g in pyproject.get("dependency-groups", {}) for r in dependency_group(pyproject, g)})
    requirement_names = [Requirement(r).name for r in pyproject["project"]["dependencies"]]
    fingerprint = json.dumps(
        [options.torch_version, options.torch_index, options.python, pins, groups, requirement_names, "hashed"]
    )
    # One directory per torch choice; inside it, one wheelhouse per dependency set. A new
    # dependency set (pyproject.toml or poetry.lock changed) replaces the older ones.
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    target = options.cache_dir / "wheelhouse" / options.wheelhouse_key / digest
    pip = [tools.python, "-m", "pip"]

    def build_wheelhouse(tmp: Path) -> None:
        torch_dir, deps_dir = tmp / "torch", tmp / "deps"
        index = options.torch_index_url
        log(f"filling the wheelhouse: torch=={options.torch_version} from {index or 'pip configuration'}")
        torch_args = ["--index-url", index] if index else []
        run(
            [
                *pip,
                "download",
                "--quiet",
                "--no-deps",
                "--dest",
                torch_dir,
                *torch_args,
                f"torch=={options.torch_version}",
            ]
        )
        torch_wheels = list(torch_dir.glob("torch-*.whl"))
        if len(torch_wheels) != 1:
            raise RuntimeError(f"expected one torch wheel, got {[w.name for w in torch_wheels]}")
        exact = torch_wheels[0].name.split("-")[1]
        if pins:
            # First, and checked against the lock's hashes: what a later resolution needs of
            # these is then already in deps_dir, and pip keeps the file it finds there.
            log(f"filling the wheelhouse: {len(pins)} packages pinned by poetry.lock, with their hashes")
            hashes = locked_hashes(lock_text)
            hashed = tmp / "lock-hashed.txt"
            hashed.write_text(hashed_requirements(pins, hashes))
            hashed_download = [*pip, "download", "--quiet", "--no-deps", "--require-hashes", "--dest", deps_dir]
            try:
                run([*hashed_download, "-r", hashed])
            except RuntimeError:
                one = tmp / "lock-hashed-one.txt"
                for pin in pins:  # one by one: a pin with no file for this machine
                    one.write_text(hashed_requirements([pin], hashes))
                    try:
                        run([*hashed_download, "-r", one])
                    except RuntimeError:
                        if not download_foreign(pip, deps_dir, one, python_version):
                            log(f"  no distribution of {pin} for this interpreter; skipped")
        constraints = tmp / "lock-constraints.txt"
        constraints.write_text("".join(f"{pin}\n" for pin in pins))
        log("filling the wheelhouse: dependencies, build backend, dependency groups")
        run(
            [
                *pip, "download", "--quiet", "--dest", deps_dir, "--find-links", torch_dir,
                "--constraint", constraints, build.wheel, f"torch=={exact}",
                *pyproject["build-system"]["requires"], *groups,
            ]
        )  # fmt: skip
        if lock_text:
            bad = mismatched_locked_files(deps_dir, lock_text)
            if bad:
                raise RuntimeError(f"files in the wheelhouse differ from poetry.lock's hashes: {', '.join(bad)}")
        for leftover in [*deps_dir.glob("torch-*"), *deps_dir.glob("flash_recipe-*")]:
            leftover.unlink()

    root = cached_dir(target, build_wheelhouse)
    with file_lock(target.parent / ".prune.lock"):
        for older in target.parent.iterdir():
            if older.is_dir() and older != root and (older / ".done").exists():
                log(f"removing the outdated wheelhouse {older}")
                shutil.rmtree(older, ignore_errors=True)
    return Wheelhouse(root)
