"""The install-matrix machinery: options, caches, servers, environments, lock comparison, report.

Everything runs on loopback with the real tools (git, pypiserver); nothing needs the network.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


from recipes.harness import (  # noqa: E402
    checks,
    config,
    paths,  # noqa: E402
    prepare,
    report,
    runner,
    servers,
    workspace,
)
from recipes.harness.paths import PATHS, get  # noqa: E402

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str) -> tuple[int, str]:
    try:
        with NO_PROXY.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, url",
    [
        ("pip-config", None),
        ("cpu", "https://download.pytorch.org/whl/cpu"),
        ("cu126", "https://download.pytorch.org/whl/cu126"),
        ("cu128", "https://download.pytorch.org/whl/cu128"),
        ("cu130", "https://download.pytorch.org/whl/cu130"),
        ("http://127.0.0.1:9/simple/", "http://127.0.0.1:9/simple"),
    ],
)
def test_torch_index_shorthands(value, url):
    assert config.torch_index_url(value) == url


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="cu999"):
        config.torch_index_url("cu999")
    with pytest.raises(ValueError, match="latest"):
        config.Options(torch_version="latest")


def test_wheelhouse_key_follows_torch_choice():
    a = config.Options(torch_version="2.13.0").wheelhouse_key
    assert a == config.Options(torch_version="2.13.0").wheelhouse_key
    assert a != config.Options(torch_version="2.9.1").wheelhouse_key
    assert a != config.Options(torch_index="cpu").wheelhouse_key


def test_unknown_path_is_named():
    assert get("uv-pip").tool == "uv"
    with pytest.raises(ValueError, match="no-such-path"):
        get("no-such-path")


# --- caches ----------------------------------------------------------------------------------


def test_cached_dir_builds_once_and_rebuilds_after_interruption(tmp_path):
    calls = []

    def build(target):
        calls.append(target)
        (target / "file").write_text("x")

    target = tmp_path / "item"
    assert prepare.cached_dir(target, build) == target
    prepare.cached_dir(target, build)
    assert len(calls) == 1

    def interrupted(target):
        (target / "partial").write_text("")
        raise KeyboardInterrupt

    other = tmp_path / "other"
    with pytest.raises(KeyboardInterrupt):
        prepare.cached_dir(other, interrupted)
    assert not other.exists()  # no half-built directory is left to be mistaken for a cache
    prepare.cached_dir(other, build)
    assert (other / ".done").exists() and len(calls) == 2


def _git(*args, cwd):
    env = {**os.environ, **prepare.GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _make_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "init", cwd=repo)
    (repo / "untracked.txt").write_text("new\n")  # not committed yet: part of the snapshot
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_text("no")  # ignored: not part of it
    return repo


def test_snapshot_takes_the_working_tree_and_is_deterministic(tmp_path):
    repo = _make_repo(tmp_path)
    assert prepare.working_tree_files(repo) == [".gitignore", "pkg/a.py", "untracked.txt"]
    rev1 = prepare.snapshot(repo, tmp_path / "s1")
    rev2 = prepare.snapshot(repo, tmp_path / "s2")
    assert rev1 == rev2 and len(rev1) == 40
    assert not (tmp_path / "s1" / "ignored").exists()
    (repo / "pkg" / "a.py").write_text("A = 2\n")
    assert prepare.snapshot(repo, tmp_path / "s3") != rev1


def test_dependency_group_includes():
    pyproject = {"dependency-groups": {"test": ["pytest>=8"], "dev": [{"include-group": "test"}, "ruff"]}}
    assert prepare.dependency_group(pyproject, "dev") == ["pytest>=8", "ruff"]


LOCK = """
[[package]]
name = "numpy"
version = "2.0.2"
markers = 'python_version == "3.9"'

[[package]]
name = "numpy"
version = "2.2.6"
markers = {main = 'python_version >= "3.10" and extra == "plot"', test = 'python_version >= "3.10"'}

[[package]]
name = "colorama"
version = "0.4.6"
markers = 'sys_platform == "win32"'

[[package]]
name = "torch"
version = "2.14.1"

[[package]]
name = "nvidia-cublas"
version = "13.1.0"
markers = 'platform_system == "Linux"'

[[package]]
name = "Typing_Extensions"
version = "4.16.0"
markers = 'python_version < "3.11"'

[[package]]
name = "tqdm"
version = "4.70.1"
markers = 'extra == "transformers"'
"""


def test_locked_versions_cover_every_platform_but_only_this_python():
    versions = prepare.locked_versions(LOCK, "3.11", ["transformers"])
    assert versions == {
        "numpy": {"2.2.6"},
        "colorama": {"0.4.6"},  # Windows only, yet Poetry resolves it: the wheelhouse needs it
        "torch": {"2.14.1"},
        "nvidia-cublas": {"13.1.0"},
        "tqdm": {"4.70.1"},
    }
    assert "tqdm" not in prepare.locked_versions(LOCK, "3.11", [])
    assert prepare.locked_versions(LOCK, "3.9", [])["numpy"] == {"2.0.2"}


def test_locked_pins_leave_the_torch_build_to_the_wheelhouse():
    assert prepare.locked_pins(LOCK, "3.11", []) == ["colorama==0.4.6", "numpy==2.2.6"]


# --- lock comparison (poetry-lock-dev) ----------------------------------------------------------


def test_compare_locks_allows_only_torch_coupled_differences():
    hermetic = LOCK.replace('version = "2.14.1"', 'version = "2.13.0+cpu"').replace(
        'name = "nvidia-cublas"\nversion = "13.1.0"', 'name = "triton"\nversion = "3.9.0"'
    )
    problems, notes = checks.compare_locks(LOCK, hermetic, "3.11", [])
    assert problems == []
    assert any("torch" in n and "2.13.0+cpu" in n for n in notes)

    drifted = LOCK.replace('version = "2.2.6"', 'version = "2.3.0"')
    problems, _ = checks.compare_locks(LOCK, drifted, "3.11", [])
    assert problems == ["numpy: poetry.lock ['2.2.6'], local index ['2.3.0']"]

    extra = LOCK + '\n[[package]]\nname = "requests"\nversion = "2.0"\n'
    problems, _ = checks.compare_locks(LOCK, extra, "3.11", [])
    assert problems == ["requests ['2.0'] not in poetry.lock"]

    # A package the torch build under test needs (and the locked torch did not) is allowed.
    for_torch = hermetic.replace(
        'name = "torch"\nversion = "2.13.0+cpu"',
        'name = "torch"\nversion = "2.13.0+cpu"\n\n[package.dependencies]\nrequests = "*"',
    )
    problems, notes = checks.compare_locks(LOCK, for_torch + extra.removeprefix(LOCK), "3.11", [])
    assert problems == [] and "requests ['2.0'] not in poetry.lock (needed by the torch build under test)" in notes


def test_add_poetry_index_sets_primary_source_and_python(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nversion = "1"\n\n[tool.poetry]\npackages = []\n')
    checks.add_poetry_index(pyproject, "http://127.0.0.1:1/simple/", "~3.11")
    import tomllib

    data = tomllib.loads(pyproject.read_text())
    assert data["tool"]["poetry"]["source"] == [
        {"name": "index", "url": "http://127.0.0.1:1/simple/", "priority": "primary"}
    ]
    assert data["tool"]["poetry"]["dependencies"] == {"python": "~3.11"}

    pyproject.write_text('[project]\nname = "x"\n\n[tool.poetry.dependencies]\ntorch = { source = "t" }\n')
    checks.add_poetry_index(pyproject, "http://127.0.0.1:1/simple/", "~3.11")
    deps = tomllib.loads(pyproject.read_text())["tool"]["poetry"]["dependencies"]
    assert deps == {"python": "~3.11", "torch": {"source": "t"}}


# --- environments ----------------------------------------------------------------------------


def test_path_environment_is_clean(tmp_path):
    base = {
        "PATH": "/somewhere/bin",
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_INDEX_URL": "https://example.invalid/simple",
        "UV_INDEX_URL": "https://example.invalid/simple",
        "POETRY_VIRTUALENVS_CREATE": "false",
        "VIRTUAL_ENV": "/some/venv",
        "PYTHONPATH": "/src",
        "https_proxy": "http://corp:3128",
        "HTTPS_PROXY": "http://corp:3128",
        "LANG": "C.UTF-8",
    }
    tools = prepare.Tools(tmp_path / "tools")
    env = workspace.path_environment(
        base,
        home=tmp_path / "home",
        tools=tools,
        python="/usr/bin/python3",
        python_bin=tmp_path / "python-bin",
        extra={"X": "1"},
    )
    for name in (
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "UV_INDEX_URL",
        "POETRY_VIRTUALENVS_CREATE",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "https_proxy",
        "HTTPS_PROXY",
    ):
        assert name not in env, name
    assert env["LANG"] == "C.UTF-8" and env["X"] == "1"
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert env["HOME"] == str(tmp_path / "home")
    for name in ("PIP_CACHE_DIR", "UV_CACHE_DIR", "POETRY_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[name].startswith(str(tmp_path / "home")), name
    assert env["PATH"].split(os.pathsep)[:3] == [str(tmp_path / "python-bin"), str(tools.bin), "/usr/bin"]
    assert "UV_PYTHON" not in env and env["POETRY_VIRTUALENVS_IN_PROJECT"] == "true"


def test_pip_sees_no_configuration_in_a_path_environment(tmp_path):
    tools = prepare.Tools(tmp_path / "tools")
    env = workspace.path_environment(
        {**os.environ, "PIP_FIND_LINKS": "/opt/wheels"},
        home=tmp_path / "home",
        tools=tools,
        python=sys.executable,
        python_bin=tmp_path / "python-bin",
        extra={},
    )
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True, check=True
    )
    # Only the variables the harness sets itself: no configuration file, no inherited PIP_*.
    keys = {line.split("=")[0] for line in out.stdout.split()}
    assert keys == {":env:.cache-dir", ":env:.config-file", ":env:.disable-pip-version-check", ":env:.no-input"}


def test_dir_size_counts_hard_links_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1_000_000)
    os.link(tmp_path / "a", tmp_path / "b")
    assert 0.9 < workspace.dir_size_mb(tmp_path) < 1.1


# --- servers ---------------------------------------------------------------------------------


def _pypi_server() -> Path:
    found = shutil.which("pypi-server") or (Path(sys.executable).parent / "pypi-server")
    if not Path(found).exists():
        pytest.fail("pypi-server not installed (the tests session installs it)")
    return Path(found)


def test_package_index_serves_and_stops(tmp_path):
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"not really a wheel")
    index = servers.PackageIndex(_pypi_server(), [packages], tmp_path / "index.log")
    with index:
        status, body = fetch(index.url)
        assert status == 200 and "demo-pkg" in body
        status, body = fetch(index.url + "demo-pkg/")
        assert status == 200 and "demo_pkg-1.0-py3-none-any.whl#sha256=" in body
        status, _ = fetch(index.url + "torch/")
        assert status == 404  # no fallback redirect to PyPI
        port = index.port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_package_index_retries_when_its_port_is_taken(tmp_path, monkeypatch):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real_free_port = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real_free_port())
    (tmp_path / "p").mkdir()
    try:
        with servers.PackageIndex(_pypi_server(), [tmp_path / "p"], tmp_path / "log") as index:
            assert index.port != taken
            assert fetch(index.url)[0] == 200
    finally:
        busy.close()


def test_two_indexes_at_once_get_different_ports(tmp_path):
    (tmp_path / "p").mkdir()
    with (
        servers.PackageIndex(_pypi_server(), [tmp_path / "p"], tmp_path / "a.log") as a,
        servers.PackageIndex(_pypi_server(), [tmp_path / "p"], tmp_path / "b.log") as b,
    ):
        assert a.port != b.port
        assert fetch(a.url)[0] == fetch(b.url)[0] == 200


def test_git_remote_over_http(tmp_path):
    repo = _make_repo(tmp_path)
    bare = tmp_path / "served" / "repo.git"
    _git("clone", "-q", "--bare", str(repo), str(bare), cwd=tmp_path)
    _git("update-server-info", cwd=bare)
    rev = _git("rev-parse", "HEAD", cwd=repo).strip()
    with servers.StaticServer(tmp_path / "served") as server:
        env = {**os.environ, **prepare.GIT_ENV, "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"}
        subprocess.run(["git", "clone", "-q", server.url("repo.git"), str(tmp_path / "clone")], env=env, check=True)
    assert _git("rev-parse", "HEAD", cwd=tmp_path / "clone").strip() == rev


def test_tripwire_refuses_and_records(tmp_path):
    with servers.Tripwire() as tripwire:
        env = tripwire.environment()
        assert env["https_proxy"] == env["HTTP_PROXY"] == tripwire.proxy_url
        assert "127.0.0.1" in env["no_proxy"]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": tripwire.proxy_url}))
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open("http://pypi.org/simple/torch/", timeout=5)
        assert info.value.code == 403
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/', timeout=5)",
            ],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        assert result.returncode != 0 and "403" in result.stderr
    assert tripwire.attempts == ["GET http://pypi.org/simple/torch/", "CONNECT pypi.org:443"]


# --- report ----------------------------------------------------------------------------------


def _row(path, fingerprint="ab" * 32, passed=True, **extra):
    return {
        "path": path,
        "tool": get(path).tool,
        "tool_version": "1.0",
        "install_s": 10.0,
        "verify_s": 5.0,
        "env_mb": 900.0,
        "torch": "2.13.0+cpu",
        "triton": "3.9.0",
        "backend": "triton",
        "passed": passed,
        "fingerprint": fingerprint,
        "checks": [],
        "error": None,
        **extra,
    }


def test_report_passes_when_all_agree(tmp_path):
    rows = [_row("uv-pip"), _row("pip-git")]
    summary = report.summarize(rows, {"torch_version": "2.13.0"})
    assert summary["passed"] and summary["problems"] == []
    md_path, json_path = report.write(summary, tmp_path)
    text = md_path.read_text()
    assert "| path | tool | install s | verify s | env MB | torch | triton | backend | verify | fingerprint |" in text
    assert "| uv-pip | uv 1.0 | 10.0 | 5.0 | 900.0 | 2.13.0+cpu | 3.9.0 | triton | pass | abababababab |" in text
    assert json.loads(json_path.read_text())["paths"][1]["path"] == "pip-git"
    lines = report.table(rows).splitlines()
    header = ["path", "tool", "install", "s", "verify", "s", "env", "MB", "torch", "triton", "backend", "verify"]
    assert lines[0].split() == [*header, "fingerprint"]
    assert len(lines) == 4


def test_report_fails_on_differing_fingerprints_or_failed_checks():
    rows = [_row("uv-pip"), _row("pip-git", fingerprint="cd" * 32)]
    summary = report.summarize(rows, {})
    assert not summary["passed"]
    assert summary["problems"] == ["fingerprints differ across paths: abababababab: uv-pip; cdcdcdcdcdcd: pip-git"]

    failed = _row("uv-pip", passed=False, checks=[{"name": "INSTALLER is uv", "ok": False, "detail": "pip"}])
    summary = report.summarize([failed], {})
    assert summary["problems"] == ["uv-pip: INSTALLER is uv: pip"]
    assert not report.summarize([], {})["passed"]


@pytest.mark.parametrize(
    "tool, installer, ok",
    [
        ("pip", "pip", True),
        ("uv", "uv", True),
        ("poetry", "Poetry 2.5.1", True),
        ("poetry", "poetry", True),
        ("pip", "uv", False),
        ("uv", "pip", False),
        ("poetry", "pip", False),
        ("poetry", "Poetry-ish 1", False),
        ("pip", None, False),
    ],
)
def test_installer_matches(tool, installer, ok):
    assert checks.installer_matches(tool, installer) is ok


def test_every_path_expects_its_installer_and_a_regular_install():
    for path in PATHS:
        assert path.tool in ("pip", "uv", "poetry")
        assert path.editable == (path.id == "poetry-lock-dev")


def test_report_command_reads_a_run(tmp_path, capsys):
    from recipes.harness.__main__ import main

    run = tmp_path / "runs" / "r1"
    (run / "results").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"torch_version": "2.13.0", "rev": "0" * 40}))
    for path in ("uv-pip", "pip-git"):
        (run / "results" / f"{path}.json").write_text(json.dumps(_row(path)))
    args = ["report", "--run-id", "r1", "--cache-dir", str(tmp_path), "--report-dir", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "install matrix: pass (2 paths)" in out
    # rows come in the matrix's path order, whatever order the sessions ran in
    assert out.index("pip-git") < out.index("uv-pip")
    assert (tmp_path / "out" / "install-matrix.md").exists()

    (run / "results" / "uv-pip.json").write_text(json.dumps(_row("uv-pip", fingerprint="ef" * 32)))
    assert main(args) == 1
    assert main(["report", "--run-id", "missing", "--cache-dir", str(tmp_path)]) == 1


def test_discard_moves_aside_and_deletes(tmp_path):
    work = tmp_path / "work" / "uv-pip"
    (work / "env" / "lib").mkdir(parents=True)
    (work / "env" / "lib" / "f").write_text("x")
    trash = tmp_path / "trash"
    workspace.discard(work, trash)
    assert not work.exists()
    import time

    deadline = time.monotonic() + 10
    while any(trash.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(trash.iterdir()) == []


def test_snapshot_of_a_revision_ignores_the_working_tree(tmp_path):
    repo = _make_repo(tmp_path)
    (repo / "pkg" / "a.py").write_text("A = 'edited, not committed'\n")
    prepare.snapshot(repo, tmp_path / "head", "HEAD")
    assert (tmp_path / "head" / "pkg" / "a.py").read_text() == "A = 1\n"
    assert not (tmp_path / "head" / "untracked.txt").exists()
    with pytest.raises(RuntimeError, match="no-such-rev"):
        prepare.snapshot(repo, tmp_path / "bad", "no-such-rev")


def test_stale_path_directories_are_swept(tmp_path):
    import fcntl

    stale, live = tmp_path / "run-a", tmp_path / "run-b"
    for d in (stale, live):
        d.mkdir()
        (d / ".in-use").write_text("")
    holder = open(live / ".in-use")  # noqa: SIM115 (held: the lock a live run keeps)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        workspace.sweep(tmp_path)
        assert not stale.exists() and live.exists()
    finally:
        holder.close()


# --- checks: each returns what it found ----------------------------------------------------------


def _build(tmp_path: Path) -> prepare.Build:
    """A Build whose dist/ holds a small wheel of two flash_recipe files and an sdist."""
    build = prepare.Build(tmp_path / "build", "0.1.0", "a" * 40)
    dist = build.root / "dist"
    dist.mkdir(parents=True)
    with zipfile.ZipFile(dist / "flash_recipe-0.1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("flash_recipe/__init__.py", "X = 1\n")
        archive.writestr("flash_recipe/env/doctor.py", "Y = 2\n")
        archive.writestr("flash_recipe-0.1.0.dist-info/METADATA", "Name: flash-recipe\n")
    (dist / "flash_recipe-0.1.0.tar.gz").write_bytes(b"")
    return build


def _probe(build: prepare.Build, **changes) -> dict:
    """What PROBE reports for a correct uv install of ``build`` from the index, with ``changes``."""
    probe = {
        "executable": "/env/bin/python",
        "package_dir": "/env/lib/site-packages/flash_recipe",
        "files": checks.wheel_file_hashes(build.wheel),
        "version": build.version,
        "installer": "uv",
        "direct_url": None,
        "torch": "2.13.0+cpu",
        "triton": "3.9.0",
    }
    return {**probe, **changes}


def test_wheel_file_hashes_cover_only_the_package(tmp_path):
    hashes = checks.wheel_file_hashes(_build(tmp_path).wheel)
    assert sorted(hashes) == ["flash_recipe/__init__.py", "flash_recipe/env/doctor.py"]


def test_check_install_returns_the_versions_and_its_checks(tmp_path):
    build = _build(tmp_path)
    installed = checks.check_install(_probe(build), get("uv-pip"), build=build, torch_version="2.13.0")
    assert (installed.torch, installed.triton) == ("2.13.0+cpu", "3.9.0")
    assert [(c.name, c.ok) for c in installed.checks] == [
        ("flash-recipe version", True),
        ("files are the build under test", True),
        ("INSTALLER names uv", True),
        ("torch 2.13.0", True),
        ("not editable", True),
        ("source: index", True),
    ]


def test_check_install_names_what_differs(tmp_path):
    build = _build(tmp_path)
    direct = {"url": "file:///src", "dir_info": {"editable": True}}
    probe = _probe(build, version="0.0.9", files={}, installer="pip", torch=None, triton=None, direct_url=direct)
    installed = checks.check_install(probe, get("uv-pip"), build=build, torch_version="2.13.0")
    assert (installed.torch, installed.triton) == (None, None)
    assert {c.name: c.detail for c in installed.checks if not c.ok} == {
        "flash-recipe version": "0.0.9",
        "files are the build under test": "/env/lib/site-packages/flash_recipe",
        "INSTALLER names uv": "pip",
        "torch 2.13.0": "None",
        "not editable": str(direct),
        "source: index": "from the index",
    }


def test_check_install_git_and_file_sources(tmp_path):
    build = _build(tmp_path)
    url = "https://github.com/flash-recipe/flash-recipe"
    direct = {"url": url, "vcs_info": {"vcs": "git", "commit_id": build.rev}}
    probe = _probe(build, installer="pip", direct_url=direct)
    installed = checks.check_install(probe, get("pip-git"), build=build, torch_version="2.13.0")
    assert all(c.ok for c in installed.checks)
    assert installed.checks[-1] == checks.Check("source: git", True, f"{url} @ {build.rev}")
    dot_git = {**direct, "url": url + ".git"}  # Poetry may record the URL with its .git
    probe = _probe(build, installer="Poetry 2.5.1", direct_url=dot_git)
    assert checks.check_install(probe, get("poetry-git"), build=build, torch_version="2.13.0").checks[-1].ok
    for wrong in ({**direct, "vcs_info": {"commit_id": "b" * 40}}, {**direct, "url": "http://127.0.0.1:1/x.git"}):
        probe = _probe(build, installer="pip", direct_url=wrong)
        installed = checks.check_install(probe, get("pip-git"), build=build, torch_version="2.13.0")
        assert [c.name for c in installed.checks if not c.ok] == ["source: git"]

    probe = _probe(build, installer="Poetry 2.5.1", direct_url={"url": "file:///tmp/checkout", "dir_info": {}})
    installed = checks.check_install(probe, get("poetry-path"), build=build, torch_version="2.13.0")
    assert installed.checks[-1] == checks.Check("source: file", True, "file:///tmp/checkout")


def _torch_wheel(tmp_path, rows: list[str]):
    """A stand-in torch wheel whose RECORD holds ``rows`` (the check reads nothing else)."""
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("torch-2.13.0+cpu.dist-info/RECORD", "\n".join(rows) + "\n")
    return wheel


def test_the_installed_torch_must_be_the_served_wheel_untouched(tmp_path):
    """The probe's digest of the installed torch's RECORD must equal the served wheel's: rows an
    installer adds (INSTALLER, REQUESTED, bytecode, console scripts, RECORD's own) do not count, a
    file with another hash or a missing file does."""
    shipped = [
        "torch/__init__.py,sha256=aaa,10",
        "torch/_C.so,sha256=bbb,20",
        "torch-2.13.0+cpu.dist-info/METADATA,sha256=ccc,30",
        "torch-2.13.0+cpu.dist-info/RECORD,,",
    ]
    installed = [
        *reversed(shipped),
        "torch/__pycache__/__init__.cpython-311.pyc,,",
        "torch-2.13.0+cpu.dist-info/INSTALLER,sha256=ddd,4",
        "torch-2.13.0+cpu.dist-info/REQUESTED,sha256=eee,0",
        "../../../bin/torchrun,sha256=fff,200",
    ]
    wheel, build = _torch_wheel(tmp_path, shipped), _build(tmp_path)

    def run(rows):
        probe = _probe(build, torch_record=checks.record_digest(rows))
        result = checks.check_install(
            probe, get("torch-index-pip"), build=build, torch_version="2.13.0", torch_wheel=wheel
        )
        return {c.name: c.ok for c in result.checks if c.name.startswith("torch is")}

    assert run(installed) == {f"torch is {wheel.name}, untouched (RECORD)": True}
    assert list(run([r.replace("sha256=bbb", "sha256=zzz") for r in installed]).values()) == [False]
    assert list(run([r for r in installed if not r.startswith("torch/_C.so")]).values()) == [False]
    assert "torch_record" in checks.PROBE and "def record_digest" in checks.PROBE


VERIFY_REPORT = {
    "passed": True,
    "backends": ["sdpa", "triton"],
    "fingerprint": "ab" * 32,
    "install": {"installer": "uv", "version": "0.1.0", "editable": False},
}


def test_check_verify_returns_backends_fingerprint_and_checks():
    run = checks.VerifyRun(0, "a warning first\n" + json.dumps(VERIFY_REPORT), "", 12.3)
    verified = checks.check_verify(run, get("uv-pip"), "0.1.0")
    assert verified.fingerprint == "ab" * 32
    assert verified.backends == ["sdpa", "triton"] and verified.backend == "triton"
    assert [(c.name, c.ok) for c in verified.checks] == [
        ("verify passed", True),
        ("triton among verified backends", True),
        ("verify sees this install", True),
        ("fingerprint", True),
    ]
    # poetry-lock-dev: Poetry's INSTALLER and an editable install
    dev = {**VERIFY_REPORT, "install": {"installer": "Poetry 2.5.1", "version": "0.1.0", "editable": True}}
    verified = checks.check_verify(checks.VerifyRun(0, json.dumps(dev), "", 1.0), get("poetry-lock-dev"), "0.1.0")
    assert all(c.ok for c in verified.checks)


def test_check_verify_failures():
    report_ = {**VERIFY_REPORT, "passed": False, "backends": ["sdpa"], "fingerprint": None}
    verified = checks.check_verify(checks.VerifyRun(1, json.dumps(report_), "", 1.0), get("uv-pip"), "0.2.0")
    assert verified.backend == "sdpa" and verified.fingerprint is None
    assert {c.name: c.detail for c in verified.checks if not c.ok} == {
        "verify passed": "exit 1",
        "triton among verified backends": "sdpa",
        "verify sees this install": json.dumps(VERIFY_REPORT["install"], sort_keys=True),
        "fingerprint": "None",
    }

    crashed = checks.VerifyRun(2, "", "Traceback\n  File x\nImportError: no torch\n", 0.5)
    verified = checks.check_verify(crashed, get("uv-pip"), "0.1.0")
    assert (verified.fingerprint, verified.backends, verified.backend) == (None, [], None)
    detail = "exit 2, no JSON: Traceback |   File x | ImportError: no torch"
    assert verified.checks == [checks.Check("flash-recipe verify --json", False, detail)]


def test_run_verify_logs_and_times_the_command(tmp_path):
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "flash-recipe"
    script.write_text(
        "#!/bin/sh\n"
        """printf '{"interpret": "%s", "args": "%s"}\\n' "${TRITON_INTERPRET:-unset}" "$*"\n"""
        "echo warn >&2\n"
        "exit 3\n"
    )
    script.chmod(0o755)
    log_file = tmp_path / "path.log"
    env = {"PATH": "/usr/bin:/bin"}
    run = checks.run_verify(tmp_path / "env", env=env, cwd=tmp_path, log_file=log_file, interpret="1")
    assert run.returncode == 3 and run.stderr == "warn\n" and run.seconds >= 0
    assert json.loads(run.stdout) == {"interpret": "1", "args": "verify --json"}
    assert "verify --json  (TRITON_INTERPRET=1)" in log_file.read_text()
    run = checks.run_verify(tmp_path / "env", env=env, cwd=tmp_path, log_file=log_file, interpret="0")
    assert json.loads(run.stdout)["interpret"] == "unset"


def test_probe_install_reports_this_interpreter(tmp_path):
    from importlib.metadata import version

    probe = checks.probe_install(Path(sys.executable), env=dict(os.environ), cwd=tmp_path, log_file=tmp_path / "log")
    assert probe["version"] == version("flash-recipe")
    assert probe["files"] and all(name.startswith("flash_recipe/") for name in probe["files"])
    assert "$ " in (tmp_path / "log").read_text()


def test_environment_network_and_lock_checks(tmp_path):
    env_dir = tmp_path / ".venv"
    assert checks.check_environment(env_dir) == checks.Check("environment in .venv", False, str(env_dir))
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("")
    assert checks.check_environment(env_dir).ok

    assert checks.check_network([]) == checks.Check("no network access", True, "")
    refused = checks.check_network([f"CONNECT host{i}:443" for i in range(7)])
    assert not refused.ok and refused.detail.split("; ") == [f"CONNECT host{i}:443" for i in range(5)]

    name = "local-index lock keeps poetry.lock's versions"
    assert checks.check_lock_comparison([], []) == checks.Check(name, True, "identical")
    assert checks.check_lock_comparison([], ["torch: a", "triton: b"]) == checks.Check(
        name, True, "torch build under test: torch: a; triton: b"
    )
    assert checks.check_lock_comparison(["numpy: x"], ["torch: a"]) == checks.Check(name, False, "numpy: x")


# --- workspace and row -------------------------------------------------------------------------


def test_workspace_places_the_project_and_is_removed(tmp_path):
    build = _build(tmp_path)
    (build.checkout / "pkg").mkdir(parents=True)
    (build.checkout / "pkg" / "a.py").write_text("A = 1\n")
    root = tmp_path / "work"
    root.mkdir()

    plain = workspace.Workspace(root, "run", "uv-pip")
    assert plain.dir.parent == root and plain.dir.name.startswith("run-uv-pip-")
    assert plain.home.is_dir() and plain.neutral.is_dir()
    plain.place_project(build, get("uv-pip"))
    assert list(plain.project.iterdir()) == []
    python_bin = plain.python_bin(sys.executable)
    version = subprocess.run([python_bin / "python3", "-c", "import sys; print(sys.version)"], capture_output=True)
    assert version.stdout.decode().strip() == sys.version
    plain.trust("/run/ca.pem")
    assert "sslCAInfo = /run/ca.pem" in (plain.home / ".gitconfig").read_text()
    workspace.sweep(root)  # held while the path runs: not swept
    assert plain.dir.exists() and plain.size_mb() >= 0
    plain.release(keep=False)
    assert not plain.dir.exists()

    dev = workspace.Workspace(root, "run", "poetry-lock-dev")
    dev.place_project(build, get("poetry-lock-dev"))
    assert (dev.project / "pkg" / "a.py").exists()
    dev.release(keep=True)
    assert dev.dir.exists()


def test_a_package_added_to_the_base_interpreter_fails_the_path(tmp_path):
    """What an installer pointed at the base interpreter (``uv pip`` with ``UV_PYTHON``) leaves
    behind is caught: here the base interpreter is a fresh virtualenv's, so nothing real changes."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "base"], check=True)
    python = str(tmp_path / "base" / "bin" / "python")
    before = checks.interpreter_packages(python)
    assert checks.check_interpreter_untouched(before, checks.interpreter_packages(python)).ok
    (site,) = (tmp_path / "base" / "lib").glob("python3.*/site-packages")
    (site / "flash_recipe-0.1.0.dist-info").mkdir()
    check = checks.check_interpreter_untouched(before, checks.interpreter_packages(python))
    assert check == checks.Check("base interpreter untouched", False, "flash_recipe-0.1.0.dist-info")
    before = checks.interpreter_packages(python)
    os.utime(site / "flash_recipe-0.1.0.dist-info", (1, 1))  # reinstalled in place
    assert not checks.check_interpreter_untouched(before, checks.interpreter_packages(python)).ok


def test_every_path_is_given_a_known_start():
    assert {p.given for p in PATHS} == set(paths.GIVEN)
    with pytest.raises(ValueError, match="given must be one of nothing, poetry-project"):
        paths.RecipePath("x", "pip", "x", given="a venv")


def test_new_row_holds_every_field_unset(tmp_path):
    row = runner.new_row(get("uv-pip"), tmp_path / "uv-pip.log", None)
    assert list(row) == [
        "path",
        "tool",
        "tool_version",
        "summary",
        "install_s",
        "verify_s",
        "env_mb",
        "torch",
        "triton",
        "backends",
        "backend",
        "passed",
        "fingerprint",
        "checks",
        "error",
        "log",
        "workdir",
        "workdir_mb",
    ]
    assert (row["path"], row["tool"], row["log"]) == ("uv-pip", "uv", str(tmp_path / "uv-pip.log"))
    assert row["passed"] is False and row["backends"] == [] and row["checks"] == [] and row["workdir"] is None
    assert runner.new_row(get("uv-pip"), tmp_path / "uv-pip.log", tmp_path)["workdir"] == str(tmp_path)
