"""Loopback servers for a path run: package indexes, the git remote, and the network tripwire.

- ``PackageIndex``: a real pypiserver on a free loopback port, serving some directories, with
  the fallback to PyPI switched off.
- ``StaticServer``: a threaded static HTTP server; serving a bare repository after
  ``git update-server-info`` makes it a git remote (git's "dumb" HTTP protocol).
- ``Tripwire``: an HTTP proxy that every path run is pointed at (``http_proxy`` and friends),
  with loopback exempt (``no_proxy``): it refuses every request and records it, so a tool that
  reaches for the network fails loudly and the path is marked failed.

Ports: the static server and the tripwire bind port 0 (the kernel picks a free one, atomically).
pypiserver takes a port number, so ``PackageIndex`` picks a free one and retries on a clash;
two matrices running at once therefore never share a port.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"


def die_with_parent() -> None:
    """For ``preexec_fn``: on Linux, the child gets SIGTERM when the harness dies, even by SIGKILL
    (nox kills a session's command half a second after Ctrl-C)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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


class PackageIndex:
    """pypiserver serving ``directories`` at ``self.url`` (the simple index, ending in /simple/)."""

    def __init__(self, pypi_server: Path, directories: Sequence[Path], log_file: Path, name: str = "index"):
        self.pypi_server = pypi_server
        self.directories = [Path(d) for d in directories]
        self.log_file = log_file
        self.name = name
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/simple/"

    def start(self, attempts: int = 5, timeout: float = 30.0) -> PackageIndex:
        for _ in range(attempts):
            self.port = free_port()
            log = open(self.log_file, "ab")  # noqa: SIM115 (the server writes to it until stop() closes it)
            self.process = subprocess.Popen(
                [
                    str(self.pypi_server), "run", "--port", str(self.port), "--host", LOOPBACK,
                    "--authenticate", ".", "--passwords", ".", "--disable-fallback",
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
            self.stop()
        raise RuntimeError(f"pypiserver ({self.name}) did not start; see {self.log_file}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> PackageIndex:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
    """An HTTP(S) proxy that refuses everything and remembers what was asked for."""

    MESSAGE = "flash-recipe install matrix: network access is blocked during path runs"

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[str] = []
        self._lock = threading.Lock()

    def _make_handler(self):
        tripwire = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _refuse(self) -> None:
                with tripwire._lock:
                    tripwire.attempts.append(f"{self.command} {self.path}")
                body = f"{Tripwire.MESSAGE}: {self.command} {self.path}\n".encode()
                self.send_response(403, Tripwire.MESSAGE)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_CONNECT = do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = do_OPTIONS = _refuse

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
