"""Start a real `osfarm serve` process on a free loopback port for a benchmark run."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def farm_process(pool_min: int = 1, pool_max: int = 2, width: int = 1920, height: int = 1080,
                 timeout: float = 120.0) -> Iterator[tuple[str, str]]:
    """Yield (url, token) of a farm whose pool_min desktops are ready; stop it afterwards."""
    port, token = free_port(), secrets.token_urlsafe(16)
    state = tempfile.mkdtemp(prefix="ofb", dir="/tmp")
    env = dict(os.environ, OSFARM_STATE_DIR=state, OSFARM_WIDTH=str(width), OSFARM_HEIGHT=str(height))
    log = open(Path(state) / "farm.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "osfarm.cli", "serve", "--port", str(port), "--token", token,
         "--pool-size", str(pool_min), "--pool-max", str(pool_max)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {token}"}
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"osfarm serve exited {proc.returncode}; see {log.name}")
            try:
                st = httpx.get(f"{url}/v1/pool", headers=headers, timeout=2).json()
                if st.get("counts", {}).get("ready", 0) >= pool_min:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"farm not ready after {timeout}s; see {log.name}")
            time.sleep(0.1)
        yield url, token
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def median_ms(samples: list[float]) -> float:
    s = sorted(samples)
    n = len(s)
    mid = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return mid * 1000.0


def p90_ms(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(0.9 * len(s)))] * 1000.0
