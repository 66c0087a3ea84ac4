"""A witness between a worker and dockerd: a Unix socket that passes every byte through to the
real daemon and records the request line of each API call, so that a test can say what the
worker asked Docker to do (a pull is `POST /v1.NN/images/create`, whether or not it succeeds).

    with DockerWitness(directory) as witness:
        engine.env["DOCKER_HOST"] = witness.url
        ...
        assert witness.calls("/images/create") == []
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

_REQUEST_LINE = re.compile(rb"(?:GET|HEAD|POST|PUT|DELETE) (/\S*) HTTP/1\.[01]\r\n")
_UPSTREAM = "/var/run/docker.sock"


class DockerWitness:
    """Listens at `<directory>/docker.sock` and forwards to dockerd's socket."""

    def __init__(self, directory: Path, upstream: str = _UPSTREAM) -> None:
        self.path = directory / "docker.sock"
        self.upstream = upstream
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._paths: list[str] = []
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def calls(self, fragment: str = "") -> list[str]:
        """The request paths seen so far that contain `fragment`."""
        with self._lock:
            return [path for path in self._paths if fragment in path]

    def wait(self, fragment: str, timeout: float) -> list[str]:
        """The calls containing `fragment`, once there is one (an AssertionError if none came
        within `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while not (found := self.calls(fragment)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no call with {fragment!r} within {timeout:g} s (saw {self.calls()[-5:]})"
                )
            time.sleep(0.1)
        return found

    def __enter__(self) -> DockerWitness:
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self.upstream)
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        tail = b""  # a request line may be split between two reads
        try:
            while chunk := source.recv(65536):
                if record:
                    seen = tail + chunk
                    with self._lock:
                        self._paths += [
                            m.group(1).decode(errors="replace")
                            for m in _REQUEST_LINE.finditer(seen)
                        ]
                    tail = seen[seen.rfind(b"\n") + 1 :][-4096:]
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
