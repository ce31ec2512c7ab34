"""A real ``redis-server`` on a free loopback port, for tests (Debian package ``redis-server``).

``RedisServer`` starts, stops (gracefully or with SIGKILL) and restarts the server on the same
port and data dir; with ``aof=True`` every write is fsynced to the append-only file, so a
restart (even after SIGKILL) loses nothing, as a production broker would be configured.
(osfarm's tests share one through the ``redis_session`` fixture of tests/conftest.py.) Without
``redis-server`` it skips the test (``osfarm.testing.unavailable``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from osfarm.testing.ports import free_port
from osfarm.testing.unavailable import unavailable


class RedisServer:
    def __init__(self, aof: bool = False, port: int | None = None, data_dir: Path | None = None,
                 password: str | None = None):
        """``password``: clients must AUTH (it goes into :attr:`url`); without one, Redis's protected
        mode accepts clients from 127.0.0.1 and ::1 only, not from another loopback address."""
        exe = shutil.which("redis-server")
        if exe is None:
            unavailable("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.aof = aof
        self.password = password
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="osfarm-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> Self:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        args += ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'redis.log').read_text(errors='replace')[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                s.sendall(auth + b"PING\r\n")
                answer = b""
                while answer.count(b"\r\n") < (2 if auth else 1):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    answer += chunk
                return answer.endswith(b"+PONG\r\n")
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self, kill: bool = True, down_s: float = 0.0) -> None:
        """Stop (SIGKILL by default: a crash) and start again on the same port and data dir."""
        self.stop(kill=kill)
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

