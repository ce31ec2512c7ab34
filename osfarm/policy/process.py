"""``osfarm policy serve`` as a subprocess on a free loopback port (the trainer's own servers).

Each child gets PR_SET_PDEATHSIG, so a parent killed with SIGKILL takes its servers with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from osfarm.errors import InfraError
from osfarm.policy.client import PolicyNotHealthy, PolicyServer, wait_healthy


class PolicyStartError(InfraError, RuntimeError):
    """The server exited or never became healthy (the message has its log's tail)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Child setup: SIGKILL when the parent dies, however it dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class PolicyProcess:
    """One ``osfarm policy serve`` subprocess on a free loopback port."""

    def __init__(self, model: Path, version: int, name: str, log_path: Path, delay_ms: float = 0.0,
                 threads: int | None = None, delay_sigma: float = 0.0, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.options: list[str] = ["--log-level", "warning"]
        if delay_ms:
            self.options += ["--delay-ms", str(delay_ms), "--delay-sigma", str(delay_sigma)]
        if threads:
            self.options += ["--threads", str(threads)]
        self.options += list(extra_args)
        # env: additions to ours, e.g. the device a trainer's device map gives it (CUDA_VISIBLE_DEVICES)
        self.env = {**os.environ, **env} if env else None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.restarts = 0
        self._spawn(model, version)

    def _spawn(self, model: Path, version: int) -> None:
        cmd = [sys.executable, "-c", "from osfarm.cli import app; app()", "policy", "serve", "--model", str(model),
               "--port", str(self.port), "--served-model-name", self.name, "--version", str(version), *self.options]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only, no locks

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self, model: Path, version: int) -> None:
        """Start it again on the same port (its URL stays what its users know), serving ``model``
        as ``version``; the log goes on in the same file."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()
        self.restarts += 1
        self._spawn(model, version)

    async def wait_ready(self, timeout_s: float) -> None:
        server = PolicyServer(url=self.url, health_timeout_s=timeout_s)
        async with httpx.AsyncClient() as client:
            task = asyncio.ensure_future(wait_healthy(client, server, timeout_s))
            try:
                while not task.done():
                    if self.proc.poll() is not None:
                        tail = self.log_path.read_text(errors="replace")[-800:]
                        raise PolicyStartError(f"policy server exited with {self.proc.returncode}:\n{tail}")
                    await asyncio.sleep(0.2)
            finally:
                if not task.done():  # stopped waiting (exited, or cancelled): the poll ends before its client
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            try:
                task.result()
            except PolicyNotHealthy as e:
                raise PolicyStartError(f"policy server did not start: {e} (log: {self.log_path})") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
