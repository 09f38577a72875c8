"""The public hosts the recipes name, answered by the run's loopback servers.

A recipe shows exactly what a user types: ``https://github.com/flash-recipe/flash-recipe``,
``https://download.pytorch.org/whl/cpu``, and pip's and uv's default index (PyPI). In a path run
every tool's traffic goes through the tripwire proxy (``servers.Tripwire``). For the hosts below
the proxy answers a ``CONNECT`` itself: it speaks TLS with a certificate for that host, signed by
a certificate authority made for this run only (``RunAuthority``), and forwards each request to
the loopback server that stands in for the host, path rewritten (``Route``). The tools trust the
run's authority through their own variables (``ca_environment``); nothing in the recipe changes.
Any other host is refused and recorded, as before.

Routes, and the loopback server behind each:

- ``pypi.org``: ``/simple/...`` and ``/packages/...``, the run's main index (pypiserver); pip and
  uv use the simple API only. (Poetry's PyPI client needs PyPI's JSON API, which pypiserver does
  not serve: Poetry's projects are given the main index as their source by the harness.)
- ``download.pytorch.org``: ``/whl/<build>/...`` (``cpu``, ``cu128``, ...), the run's torch index,
  whichever torch build it holds; ``/packages/...``, its files, where pypiserver links them.
- ``github.com``: ``/flash-recipe/flash-recipe[.git]/...``, the bare repository of the build under
  test over git's "dumb" HTTP protocol.
"""

from __future__ import annotations

import http.client
import http.server
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

REPOSITORY = "flash-recipe/flash-recipe"
# pyproject.toml's [project.urls] Repository (tests/test_recipes_scripts.py holds them equal).
REPOSITORY_URL = f"https://github.com/{REPOSITORY}"
# Request and response headers that belong to one connection, not to the message.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}


@dataclass(frozen=True)
class Route:
    """Requests for ``host`` go to the loopback server at ``base`` (``http://127.0.0.1:PORT``),
    their path rewritten by ``rewrite`` (None: the path is refused)."""

    host: str
    base: str
    rewrite: Callable[[str], str | None]

    def target(self, path: str) -> str | None:
        local = self.rewrite(path)
        return None if local is None else self.base.rstrip("/") + local


def _pypi(path: str) -> str | None:
    return path if re.match(r"^/(simple|packages)/", path) else None


def _pytorch(path: str) -> str | None:
    if path.startswith("/packages/"):  # where pypiserver's pages link their files
        return path
    match = re.match(r"^/whl/[a-z0-9.]+(/.*)?$", path)
    if match is None:
        return None
    return "/simple" + (match.group(1) or "/")


def _github(path: str) -> str | None:
    match = re.match(rf"^/{re.escape(REPOSITORY)}(?:\.git)?(/.*)?$", path)
    if match is None:
        return None
    return "/flash-recipe.git" + (match.group(1) or "/")


def routes(*, index_url: str, torch_index_url: str, git_root_url: str | None) -> list[Route]:
    """The public hosts of the recipes, each answered by the run's server for it (URLs of the form
    ``http://127.0.0.1:PORT/...``; ``git_root_url`` None: no git remote in this run)."""

    def base(url: str) -> str:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"

    found = [
        Route("pypi.org", base(index_url), _pypi),
        Route("download.pytorch.org", base(torch_index_url), _pytorch),
    ]
    if git_root_url is not None:
        found.append(Route("github.com", base(git_root_url), _github))
    return found


class RunAuthority:
    """A certificate authority made for one run (``openssl``, in a private temporary directory)
    and one server certificate it signs for ``hosts``; both expire after two days."""

    def __init__(self, hosts: list[str]) -> None:
        if shutil.which("openssl") is None:
            raise RuntimeError("the install matrix needs the openssl command to stand in for the recipes' hosts")
        self._dir = tempfile.TemporaryDirectory(prefix="flash-recipe-ca-")  # mode 0700
        root = Path(self._dir.name)
        self.ca_file = root / "ca.pem"
        self._cert, self._key = root / "server.pem", root / "server.key"
        ca_key, csr, ext = root / "ca.key", root / "server.csr", root / "server.ext"
        curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl(
            ["req", "-x509", *curve, "-keyout", ca_key, "-out", self.ca_file, "-days", "2"],
            ["-subj", "/CN=flash-recipe install matrix (one run)"],
            ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        )
        self._openssl(["req", "-new", *curve, "-keyout", self._key, "-out", csr, "-subj", f"/CN={hosts[0]}"])
        ext.write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(f"DNS:{h}" for h in hosts) + "\n"
        )
        self._openssl(
            ["x509", "-req", "-in", csr, "-CA", self.ca_file, "-CAkey", ca_key, "-CAcreateserial"],
            ["-out", self._cert, "-days", "2", "-extfile", ext],
        )
        ca_key.unlink()  # nothing more is signed
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self._cert, self._key)

    @staticmethod
    def _openssl(*parts: list) -> None:
        command = ["openssl", *(str(p) for part in parts for p in part)]
        subprocess.run(command, check=True, capture_output=True, stdin=subprocess.DEVNULL)

    def ca_environment(self) -> dict[str, str]:
        """The variables by which pip, uv, Poetry (requests) and git trust the run's authority."""
        ca = str(self.ca_file)
        return {"PIP_CERT": ca, "SSL_CERT_FILE": ca, "REQUESTS_CA_BUNDLE": ca, "GIT_SSL_CAINFO": ca}

    def close(self) -> None:
        self._dir.cleanup()


def serve_tunnel(
    connection: socket.socket, route: Route, context: ssl.SSLContext, refuse: Callable, served: Callable
) -> None:
    """Answer a ``CONNECT`` tunnel to ``route.host``: TLS with the run's certificate, then each
    HTTP request forwarded to the route's loopback server (``served(method, url)``), or refused
    (``refuse(method, url)``) for a path the route does not serve. Returns when the client closes
    the connection."""
    try:
        tls = context.wrap_socket(connection, server_side=True)
    except (ssl.SSLError, OSError):
        return  # the client gave up (or distrusts the certificate: its own error says so)
    handler = _forwarder(route, refuse, served)
    try:
        handler(tls, ("tunnel", 0), None)
    except (ssl.SSLError, OSError):
        pass
    finally:
        tls.close()


def _forwarder(route: Route, refuse: Callable, served: Callable) -> Callable:
    class Forward(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a tool fetches many pages through one tunnel

        def _forward(self) -> None:
            target = route.target(self.path.split("#", 1)[0])
            if target is None:
                refuse(self.command, f"https://{route.host}{self.path}")
                body = b"flash-recipe install matrix: no stand-in serves this path\n"
                self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            served(self.command, f"https://{route.host}{self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            parts = urlsplit(target)
            upstream = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "host"}
            headers["Host"] = parts.netloc
            upstream.request(self.command, parts.path + (f"?{parts.query}" if parts.query else ""), body, headers)
            response = upstream.getresponse()
            size = response.getheader("Content-Length")
            data = None if size is not None else response.read()  # streamed below when sized
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            self.send_header("Content-Length", size if data is None else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                if data is None:
                    shutil.copyfileobj(response, self.wfile, 1 << 20)
                else:
                    self.wfile.write(data)
            upstream.close()

        do_GET = do_POST = do_HEAD = _forward

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            pass

    return Forward
