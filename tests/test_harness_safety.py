"""The install matrix on a shared machine: a private work root that another user cannot steer,
an index that refuses anonymous uploads, and no step process that outlives the harness.

Real processes and a real pypiserver throughout. The "other user" of the first tests is played
by this user pre-creating the work root as that user would leave it (another owner needs root
to fake; that row is skipped without it).
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from wheels import write_wheel

from recipes.harness import servers, workspace

ROOT = Path(__file__).resolve().parents[1]
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _victim(tmp_path: Path) -> Path:
    """A folder of the user's own that an attacker would like the harness to empty."""
    victim = tmp_path / "precious"
    victim.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (victim / name).write_text(name)
    return victim


def _plant(root: Path, victim: Path) -> None:
    """What the attacker leaves in the work root: ``trash`` pointing at the victim, a stale path
    directory (free ``.in-use``), and a stale "directory" that is itself a symlink to the victim."""
    (root / "trash").symlink_to(victim, target_is_directory=True)
    (root / "run-old-uv-pip-x").mkdir()
    (root / "run-old-uv-pip-x" / ".in-use").write_text("")
    (victim / ".in-use").write_text("")
    (root / "run-linked-pip-y").symlink_to(victim, target_is_directory=True)


def _intact(victim: Path) -> list:
    return sorted(p.name for p in victim.iterdir())


def test_the_work_root_is_per_user_and_private(tmp_path):
    root = workspace.workroot(tmp_path)
    assert root.name == f"flash-recipe-matrix-{os.getuid()}"
    st = os.lstat(root)
    assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o700
    assert workspace.workroot(tmp_path) == root  # ours: accepted again


@pytest.mark.parametrize("made_by", ["symlink", "group-writable", "other-owner"])
def test_a_work_root_made_by_someone_else_is_refused_and_nothing_outside_is_touched(tmp_path, made_by):
    victim = _victim(tmp_path)
    root = tmp_path / f"flash-recipe-matrix-{os.getuid()}"
    if made_by == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        _plant(elsewhere, victim)
        root.symlink_to(elsewhere, target_is_directory=True)
    else:
        root.mkdir()
        _plant(root, victim)
        os.chmod(root, 0o777 if made_by == "group-writable" else 0o700)
        if made_by == "other-owner":
            if os.getuid() != 0:
                pytest.skip("making a directory owned by another user needs root")
            os.chown(root, 65534, 65534)
    with pytest.raises(workspace.UnsafeWorkroot, match=str(root)):
        workspace.workroot(tmp_path)
    assert _intact(victim) == [".in-use", "a.txt", "b.txt", "c.txt"]


def test_in_a_private_root_planted_symlinks_are_never_followed(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "base").mkdir()
    root = workspace.workroot(tmp_path / "base")
    _plant(root, victim)
    ws = workspace.Workspace(root, "run", "uv-pip")  # sweeps the stale directories first
    ws.release(keep=False)
    deadline = time.monotonic() + 20
    while any((root / "trash").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the background rm -rf
    assert _intact(victim) == [".in-use", "a.txt", "b.txt", "c.txt"]
    assert not (root / "trash").is_symlink() and not list((root / "trash").iterdir())
    assert not (root / "run-old-uv-pip-x").exists() and not ws.dir.exists()


# --- the index ---------------------------------------------------------------------------------


def _pypi_server() -> Path:
    found = __import__("shutil").which("pypi-server") or (Path(sys.executable).parent / "pypi-server")
    if not Path(found).exists():
        pytest.fail("pypi-server not installed (the tests session installs it)")
    return Path(found)


def _post(url: str, fields: dict, credentials=None) -> int:
    boundary = "flash-recipe-boundary"
    body = b""
    for name, value in fields.items():
        if isinstance(value, tuple):  # a file: (filename, bytes)
            head = f'Content-Disposition: form-data; name="{name}"; filename="{value[0]}"\r\n'
            head += "Content-Type: application/octet-stream\r\n\r\n"
            body += f"--{boundary}\r\n{head}".encode() + value[1] + b"\r\n"
        else:
            body += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    body += f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Content-Type", f"multipart/form-data; boundary={boundary}")
    if credentials is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(credentials).encode()).decode())
    try:
        with NO_PROXY.open(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_index_refuses_anonymous_uploads_and_removals(tmp_path):
    served = tmp_path / "wheelhouse"
    served.mkdir()
    (served / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"the cached wheel")
    evil = ("numpy-99.0.0-py3-none-any.whl", b"not numpy")
    with servers.PackageIndex(_pypi_server(), [served], tmp_path / "index.log") as index:
        root_url = index.url[: -len("simple/")]
        assert _post(root_url, {":action": "file_upload", "name": "numpy", "version": "99.0.0", "content": evil}) in (
            401,
            403,
        )
        assert _post(root_url, {":action": "remove_pkg", "name": "demo_pkg", "version": "1.0"}) in (401, 403)
        assert sorted(p.name for p in served.iterdir()) == ["demo_pkg-1.0-py3-none-any.whl"]
        # The run's own password works, so the refusals above are the server's checks, not a broken upload.
        wrong = (index.credentials[0], "guess")
        assert _post(root_url, {":action": "file_upload", "content": evil}, wrong) in (401, 403)
        assert _post(root_url, {":action": "file_upload", "content": evil}, index.credentials) == 200
        assert (served / evil[0]).exists()


# --- processes ---------------------------------------------------------------------------------

# The harness as a terminal starts it: Python turns SIGINT into KeyboardInterrupt only where the
# process did not inherit SIGINT ignored, as every command of a background job does (a CI runner's).
_STAND_IN = """
import signal
import sys
from pathlib import Path
from recipes.harness import checks, workspace
signal.signal(signal.SIGINT, signal.default_int_handler)
tmp = Path(sys.argv[2])
if sys.argv[1] == "step":
    workspace.run_step(["bash", str(tmp / "spawn.sh")], cwd=tmp, env={"PATH": "/usr/bin:/bin"}, log_file=tmp / "log")
else:
    checks.run_verify(tmp / "env", env={"PATH": "/usr/bin:/bin"}, cwd=tmp, log_file=tmp / "log", interpret="1")
"""

# A step whose grandchild would outlive it: bash starts a sleep and waits for it.
_SPAWN = "sleep 300 &\necho $! > {pidfile}\nwait\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie waiting for its reaper has ended
        return handle.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the harness runs steps on Linux")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("what", ["step", "verify"])
def test_a_steps_children_end_when_the_harness_ends_by_any_signal(tmp_path, what, sig):
    pidfile = tmp_path / "grandchild.pid"
    (tmp_path / "spawn.sh").write_text(_SPAWN.format(pidfile=pidfile))
    (tmp_path / "env" / "bin").mkdir(parents=True)
    verify = tmp_path / "env" / "bin" / "flash-recipe"
    verify.write_text(f"#!/bin/bash\nexec bash {tmp_path / 'spawn.sh'}\n")
    verify.chmod(0o755)
    harness = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_STAND_IN), what, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        assert harness.poll() is None, harness.stderr.read().decode()
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    assert _alive(grandchild)
    harness.send_signal(sig)
    harness.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), f"the step's grandchild {grandchild} outlived the harness ({sig.name})"


# --- the wheelhouse: hashed from poetry.lock -----------------------------------------------------


def _lock(name: str, version: str, wheel: str, digest: str) -> str:
    return textwrap.dedent(f"""
        [[package]]
        name = "{name}"
        version = "{version}"
        files = [
            {{file = "{wheel}", hash = "sha256:{digest}"}},
        ]
        """)


def test_the_lock_exports_a_hashed_requirements_file_that_pip_enforces(tmp_path):
    import hashlib

    from recipes.harness import prepare

    wheel = "demo_pkg-1.0-py3-none-any.whl"
    served = tmp_path / "served"
    served.mkdir()
    write_wheel(served, "demo-pkg", "1.0")
    good = hashlib.sha256((served / wheel).read_bytes()).hexdigest()
    lock = _lock("demo-pkg", "1.0", wheel, good)
    hashes = prepare.locked_hashes(lock)
    assert prepare.hashed_requirements(["demo_pkg==1.0"], hashes) == f"demo_pkg==1.0 --hash=sha256:{good}\n"
    with pytest.raises(RuntimeError, match="no file hashes for other==2.0"):
        prepare.hashed_requirements(["other==2.0"], hashes)

    def download(lock_text: str) -> subprocess.CompletedProcess:
        requirements = tmp_path / "hashed.txt"
        requirements.write_text(prepare.hashed_requirements(["demo_pkg==1.0"], prepare.locked_hashes(lock_text)))
        dest = tmp_path / f"dest-{time.monotonic_ns()}"
        with servers.PackageIndex(_pypi_server(), [served], tmp_path / "index.log") as index:
            return subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--dest", str(dest),
                 "--index-url", index.url, "--no-cache-dir", "--disable-pip-version-check", "-r", str(requirements)],
                capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull, "no_proxy": "*"},
            )  # fmt: skip

    assert download(lock).returncode == 0
    tampered = download(_lock("demo-pkg", "1.0", wheel, "0" * 64))
    assert tampered.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in tampered.stderr
    assert prepare.mismatched_locked_files(served, lock) == []
    assert prepare.mismatched_locked_files(served, _lock("demo-pkg", "1.0", wheel, "0" * 64)) == [wheel]
