"""Loopback servers for a path run: package indexes, the git remote, and the network tripwire.

- ``PackageIndex``: a real pypiserver on a free loopback port, serving some directories, with
  the fallback to PyPI switched off. Listing and downloading are open; uploading and removing
  need a password drawn at random for each server (``self.credentials``) that nothing else is
  told, so another local user cannot add a package to the served, cached wheelhouse.
- ``StaticServer``: a threaded static HTTP server; serving a bare repository after
  ``git update-server-info`` makes it a git remote (git's "dumb" HTTP protocol).
- ``Tripwire``: an HTTP proxy that every path run is pointed at (``http_proxy`` and friends),
  with loopback exempt (``no_proxy``): it refuses every request and records it, so a tool that
  reaches for the network fails loudly and the path is marked failed; only the public hosts the
  recipes name are answered, by the run's own servers (``public_hosts``).

Ports: the static server and the tripwire bind port 0 (the kernel picks a free one, atomically).
pypiserver takes a port number, so ``PackageIndex`` picks a free one and retries on a clash;
two matrices running at once therefore never share a port.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from recipes.harness import public_hosts
from recipes.harness.processes import die_with_parent

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> int:
    # The harness's own checks must not go through a proxy the user's environment sets.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        return response.status


def htpasswd_line(user: str, password: str) -> str:
    """An htpasswd entry in the ``{SHA}`` scheme, which pypiserver's htpasswd reader (passlib) checks."""
    digest = base64.b64encode(hashlib.sha1(password.encode()).digest()).decode()
    return f"{user}:{{SHA}}{digest}\n"


class PackageIndex:
    """pypiserver serving ``directories`` at ``self.url`` (the simple index, ending in /simple/).

    Uploads and removals need ``self.credentials`` (a user and a random password made for this
    server); the htpasswd file that holds it lives in a private temporary directory while the
    server runs."""

    def __init__(self, pypi_server: Path, directories: Sequence[Path], log_file: Path, name: str = "index"):
        self.pypi_server = pypi_server
        self.directories = [Path(d) for d in directories]
        self.log_file = log_file
        self.name = name
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.credentials = ("flash-recipe-matrix", secrets.token_urlsafe(32))
        self._secrets: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/simple/"

    def _password_file(self) -> Path:
        if self._secrets is None:
            self._secrets = tempfile.TemporaryDirectory(prefix="flash-recipe-index-")  # mode 0700
        path = Path(self._secrets.name) / "htpasswd"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(htpasswd_line(*self.credentials))
        return path

    def start(self, attempts: int = 5, timeout: float = 30.0) -> PackageIndex:
        passwords = self._password_file()
        for _ in range(attempts):
            self.port = free_port()
            log = open(self.log_file, "ab")  # noqa: SIM115 (the server writes to it until stop() closes it)
            self.process = subprocess.Popen(
                [
                    str(self.pypi_server), "run", "--port", str(self.port), "--host", LOOPBACK,
                    "--authenticate", "update", "--passwords", str(passwords), "--disable-fallback",
                    "--hash-algo", "sha256",
                    *map(str, self.directories),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C goes to the harness, which stops the server
                preexec_fn=die_with_parent,
            )  # fmt: skip
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break  # exited: most likely the port was taken meanwhile; try another
                try:
                    if _get(f"http://{LOOPBACK}:{self.port}/health") == 200:
                        return self
                except (urllib.error.URLError, OSError):
                    time.sleep(0.1)
            process, self.process = self.process, None
            if process.poll() is None:
                end_group(process)
        self.stop()
        raise RuntimeError(f"pypiserver ({self.name}) did not start; see {self.log_file}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            end_group(process)
        if self._secrets is not None:
            self._secrets.cleanup()
            self._secrets = None

    def __enter__(self) -> PackageIndex:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def end_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """End ``process``'s process group (it was started with ``start_new_session``): SIGTERM, then
    SIGKILL after ``grace`` seconds."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


class _ThreadedServer:
    """A ``ThreadingHTTPServer`` on a kernel-chosen loopback port, served from a daemon thread."""

    handler: type

    def __init__(self) -> None:
        self.server: http.server.ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def _make_handler(self):
        return self.handler

    @property
    def port(self) -> int:
        assert self.server is not None, "server not started"  # internal invariant
        return self.server.server_address[1]

    def start(self):
        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), self._make_handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StaticServer(_ThreadedServer):
    """Serves the files under ``root`` read-only over HTTP."""

    handler = _QuietHandler

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)

    def _make_handler(self):
        return functools.partial(_QuietHandler, directory=str(self.root))

    def url(self, path: str = "") -> str:
        return f"http://{LOOPBACK}:{self.port}/{path}"


class Tripwire(_ThreadedServer):
    """An HTTP(S) proxy that refuses everything and remembers what was asked for, except the
    public hosts of ``stand_in()``'s routes, which it answers from the run's loopback servers
    (``public_hosts``)."""

    MESSAGE = "flash-recipe install matrix: network access is blocked during path runs"

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[str] = []
        self.served: list[str] = []  # requests answered for a public host by a stand-in
        self._lock = threading.Lock()
        self._routes: dict[str, public_hosts.Route] = {}
        self._authority: public_hosts.RunAuthority | None = None

    def stand_in(self, routes: list[public_hosts.Route]) -> dict[str, str]:
        """Answer ``routes``' hosts (port 443) from here on; returns the variables by which the
        tools trust the certificate the proxy shows for them."""
        self._authority = public_hosts.RunAuthority([route.host for route in routes])
        self._routes = {route.host: route for route in routes}
        return self._authority.ca_environment()

    def record(self, method: str, url: str) -> None:
        with self._lock:
            self.attempts.append(f"{method} {url}")

    def record_served(self, method: str, url: str) -> None:
        with self._lock:
            self.served.append(f"{method} {url}")

    def stop(self) -> None:
        super().stop()
        authority, self._authority = self._authority, None
        if authority is not None:
            authority.close()

    def _make_handler(self):
        tripwire = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_CONNECT(self) -> None:
                host, _, port = self.path.rpartition(":")
                route = tripwire._routes.get(host)
                if route is None or port != "443" or tripwire._authority is None:
                    self._refuse()
                    return
                self.send_response(200, "Connection established")
                self.end_headers()
                self.wfile.flush()
                self.close_connection = True
                public_hosts.serve_tunnel(
                    self.connection, route, tripwire._authority.context, tripwire.record, tripwire.record_served
                )

            def _refuse(self) -> None:
                tripwire.record(self.command, self.path)
                body = f"{Tripwire.MESSAGE}: {self.command} {self.path}\n".encode()
                self.send_response(403, Tripwire.MESSAGE)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = do_OPTIONS = _refuse

            def log_message(self, format, *args):  # noqa: A002
                pass

        return Handler

    @property
    def proxy_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def environment(self) -> dict[str, str]:
        """Variables that send every tool's outside traffic to the tripwire."""
        proxy = self.proxy_url
        no_proxy = f"{LOOPBACK},localhost"
        env = {}
        for name in ("http_proxy", "https_proxy", "all_proxy"):
            env[name] = env[name.upper()] = proxy
        env["no_proxy"] = env["NO_PROXY"] = no_proxy
        return env
