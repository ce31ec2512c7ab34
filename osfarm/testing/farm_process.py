"""A farm in its own process, for tests and benches that kill it: ``osfarm serve`` on a fixed
loopback port and state dir (so a restart comes back where clients look), or the same farm over
``osfarm.testing.memory_provider`` boxes (``provider="memory"``: thousands of leases without
desktops). Started through ``running_farm(process=True, ...)`` (osfarm.testing.farms), or made
here and started by a test that needs the handle before the farm is up.

``kill()`` is a crash (SIGKILL to the farm only: sandbox boxes die with it by design, docker
containers and libvirt VMs stay), ``restart()`` a crash and a new farm on the same port and state
dir; ``rss_bytes()``/``open_fds()`` read the farm process from /proc.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from osfarm.testing.ports import free_port


class FarmProcess:
    def __init__(self, state_dir: Path, provider: str = "sandbox", pool_min: int = 1, pool_max: int = 2,
                 port: int | None = None, token: str | None = None, width: int = 1024, height: int = 768,
                 env: dict[str, str] | None = None, log_name: str = "farm.log"):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.provider, self.pool_min, self.pool_max = provider, pool_min, pool_max
        self.port = port or free_port()
        self.token = token or secrets.token_urlsafe(16)
        self.width, self.height = width, height
        self.extra_env = env or {}
        self.log_path = self.state_dir / log_name
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _argv(self) -> list[str]:
        if self.provider == "memory":
            # --token=: a token may start with "-", which argparse takes for an option after a bare --token
            return [sys.executable, "-m", "osfarm.testing.memory_farm", "--port", str(self.port),
                    f"--token={self.token}", "--state-dir", str(self.state_dir), "--pool-min", str(self.pool_min),
                    "--pool-max", str(self.pool_max)]
        return [sys.executable, "-m", "osfarm.cli", "serve", "--provider", self.provider, "--port", str(self.port),
                "--token", self.token, "--state-dir", str(self.state_dir), "--pool-size", str(self.pool_min),
                "--pool-max", str(self.pool_max), "--width", str(self.width), "--height", str(self.height),
                "--log-level", "info"]

    def start(self, timeout: float = 180.0, warm: bool = True, ready: int | None = None) -> FarmProcess:
        """Start the farm and wait until it answers and (``warm``) ``ready`` desktops (default one)
        are ready."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OSFARM_HEALTH_INTERVAL_S": "1", **self.extra_env}
        with self.log_path.open("ab") as log:
            log.write(f"\n---- start {self.starts + 1} ----\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self._argv(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.starts += 1
        self.wait_up(timeout, warm, ready)
        return self

    def wait_up(self, timeout: float = 180.0, warm: bool = True, ready: int | None = None) -> None:
        want = min(self.pool_min, 1) if ready is None else ready
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the farm exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/pool", headers=self.headers, timeout=3)
                if r.status_code == 200 and (not warm or r.json()["counts"].get("ready", 0) >= want):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the farm did not come up within {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the farm gets no chance to stop anything."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def restart(self, down_s: float = 0.0, timeout: float = 180.0, warm: bool = True) -> None:
        self.kill()
        time.sleep(down_s)
        self.start(timeout, warm)

    def stop(self, timeout: float = 90.0) -> None:
        """SIGTERM: the farm ends every lease and stops every desktop."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def __enter__(self) -> FarmProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
