"""The install matrix's stand-ins for the public hosts the recipes name (``recipes/harness/public_hosts``):
the tripwire proxy answers ``pypi.org``, ``download.pytorch.org`` and ``github.com`` over TLS from
loopback servers, with a certificate the tools trust only through the run's variables; everything
else stays refused and recorded.

Real servers, a real proxy, real TLS (``openssl`` makes the run's authority), and real clients:
urllib, pip and git.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from wheels import write_wheel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.harness import public_hosts, servers  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the matrix needs openssl")


def test_routes_rewrite_the_paths_the_tools_ask_for():
    pypi, torch, github = public_hosts.routes(
        index_url="http://127.0.0.1:1/simple/",
        torch_index_url="http://127.0.0.1:2/simple/",
        git_root_url="http://127.0.0.1:3/",
    )
    assert pypi.target("/simple/flash-recipe/") == "http://127.0.0.1:1/simple/flash-recipe/"
    assert pypi.target("/packages/a.whl") == "http://127.0.0.1:1/packages/a.whl"
    assert pypi.target("/pypi/torch/json") is None  # PyPI's JSON API: not served
    assert torch.target("/whl/cpu/torch/") == "http://127.0.0.1:2/simple/torch/"
    assert torch.target("/whl/cu128") == "http://127.0.0.1:2/simple/"
    assert torch.target("/packages/torch-2.13.0.whl") == "http://127.0.0.1:2/packages/torch-2.13.0.whl"
    assert torch.target("/other") is None
    repo = "/flash-recipe/flash-recipe"
    for path in (f"{repo}/info/refs?service=git-upload-pack", f"{repo}.git/info/refs?service=git-upload-pack"):
        assert github.target(path) == "http://127.0.0.1:3/flash-recipe.git/info/refs?service=git-upload-pack"
    assert github.target("/someone/else/info/refs") is None


def _opener(proxy: str, ca_file: str | None) -> urllib.request.OpenerDirector:
    context = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": proxy, "http": proxy}), urllib.request.HTTPSHandler(context=context)
    )


def test_the_proxy_answers_the_routes_and_refuses_the_rest(tmp_path):
    (tmp_path / "simple" / "flash-recipe").mkdir(parents=True)
    (tmp_path / "simple" / "flash-recipe" / "index.html").write_text("the run's index\n")
    with servers.StaticServer(tmp_path) as local, servers.Tripwire() as tripwire:
        trusted = tripwire.stand_in(
            public_hosts.routes(index_url=local.url("simple/"), torch_index_url=local.url("simple/"), git_root_url=None)
        )
        assert set(trusted) == {"PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO"}
        opener = _opener(tripwire.proxy_url, trusted["SSL_CERT_FILE"])
        with opener.open("https://pypi.org/simple/flash-recipe/", timeout=10) as response:
            assert response.read() == b"the run's index\n"
        with opener.open("https://download.pytorch.org/whl/cpu/flash-recipe/", timeout=10) as response:
            assert response.read() == b"the run's index\n"
        with pytest.raises(urllib.error.HTTPError) as info:  # a path no stand-in serves
            opener.open("https://pypi.org/pypi/torch/json", timeout=10)
        assert info.value.code == 404
        with pytest.raises(urllib.error.URLError, match="403"):  # another host
            opener.open("https://example.com/", timeout=10)
        with pytest.raises(urllib.error.URLError, match="403"):  # github.com: no git remote in this run
            opener.open("https://github.com/flash-recipe/flash-recipe", timeout=10)
        # Without the run's authority, the certificate is not trusted: nothing is taken on faith.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _opener(tripwire.proxy_url, None).open("https://pypi.org/simple/flash-recipe/", timeout=10)
        ca_file = Path(trusted["SSL_CERT_FILE"])
        assert ca_file.exists()
    assert not ca_file.exists()  # the run's authority goes with the proxy
    assert tripwire.served == [
        "GET https://pypi.org/simple/flash-recipe/",
        "GET https://download.pytorch.org/whl/cpu/flash-recipe/",
    ]
    assert tripwire.attempts == [
        "GET https://pypi.org/pypi/torch/json",
        "CONNECT example.com:443",
        "CONNECT github.com:443",
    ]


def _git(*args: str, cwd: Path, env: dict | None = None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def test_pip_and_git_reach_the_stand_ins_through_their_own_variables(tmp_path):
    """pip downloads from ``https://pypi.org/simple`` and git clones
    ``https://github.com/flash-recipe/flash-recipe``: both land on loopback servers."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "tiny-served", "1.0")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", "--initial-branch=main", cwd=repo)
    (repo / "README").write_text("served\n")
    _git("add", "README", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one", cwd=repo)
    served = tmp_path / "served"
    _git("clone", "-q", "--bare", str(repo), str(served / "flash-recipe.git"), cwd=tmp_path)
    _git("update-server-info", cwd=served / "flash-recipe.git")
    pypi_server = shutil.which("pypi-server") or str(Path(sys.executable).parent / "pypi-server")
    if not Path(pypi_server).exists():
        pytest.fail("pypi-server not installed (the tests session installs it)")
    with (
        servers.PackageIndex(Path(pypi_server), [wheels], tmp_path / "index.log") as index,
        servers.StaticServer(served) as git_root,
        servers.Tripwire() as tripwire,
    ):
        trusted = tripwire.stand_in(
            public_hosts.routes(index_url=index.url, torch_index_url=index.url, git_root_url=git_root.url())
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "GIT_"))},
            **tripwire.environment(),
            **trusted,
            "PIP_CONFIG_FILE": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": str(tmp_path),
        }
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp_path / "got", "tiny-served"]
        # No index is configured (PIP_CONFIG_FILE=/dev/null, no PIP_INDEX_URL): pip asks PyPI.
        result = subprocess.run(download, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        _git("clone", "-q", public_hosts.REPOSITORY_URL, str(tmp_path / "clone"), cwd=tmp_path, env=env)
    assert [p.name for p in (tmp_path / "got").iterdir()] == ["tiny_served-1.0-py3-none-any.whl"]
    assert (tmp_path / "clone" / "README").read_text() == "served\n"
    assert tripwire.attempts == []
    assert "GET https://pypi.org/simple/tiny-served/" in tripwire.served
    assert any(url.startswith("GET https://github.com/flash-recipe/flash-recipe/") for url in tripwire.served)
