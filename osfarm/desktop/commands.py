"""Running commands in the desktop for the guest's routes: to completion with their output
(``/execute``, ``/run_python``, ``/run_bash_script``), or detached (``/setup/launch``).

Blocking calls, meant for worker threads. Commands get this process's environment, which the
session launcher made the desktop's (DISPLAY, D-Bus, accessibility switches).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import IO

# A program and its arguments, or one shell command line (with shell=True).
Command = list[str] | str
# What Popen raises when the program cannot be started (missing, not executable, bad cwd).
CANNOT_START = (FileNotFoundError, PermissionError, NotADirectoryError)


@dataclass
class RunResult:
    stdout: str
    stderr: str
    returncode: int  # -1 when timed out
    timed_out: bool


def run_command(command: Command, shell: bool, timeout: float, cwd: str | None,
                merge_stderr: bool = False) -> RunResult:
    """Run a command to completion (blocking) with the desktop's environment.

    Unlike ``subprocess.run`` this returns once the command itself exits even when a background
    child it started keeps the output pipes open (``app &``): readers get a short grace period,
    then the partial output is returned. On timeout the whole process group is killed.
    Raises FileNotFoundError / PermissionError when the program cannot be started.
    """
    proc = subprocess.Popen(
        command, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True,
    )
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def reader(stream: IO[bytes], key: str) -> None:
        # The reader owns its stream and closes it at EOF: closing it from the waiting thread
        # would block on the buffer lock while a background child keeps the pipe open.
        try:
            while True:
                data = stream.read1(65536)  # type: ignore[attr-defined]  # a BufferedReader
                if not data:
                    break
                chunks[key].append(data)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    threads = [threading.Thread(target=reader, args=(proc.stdout, "out"), daemon=True)]
    if not merge_stderr:
        threads.append(threading.Thread(target=reader, args=(proc.stderr, "err"), daemon=True))
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
    proc.stdout = proc.stderr = None  # owned by the readers now
    for t in threads:
        t.join(0.5)

    def text(key: str) -> str:
        return b"".join(chunks[key]).decode("utf-8", errors="replace")

    return RunResult(text("out"), text("err"), -1 if timed_out else proc.returncode, timed_out)


def spawn_detached(command: Command, shell: bool, cwd: str | None) -> subprocess.Popen[bytes]:
    """Start an app and return at once; it stays a descendant of the session (subreaper)."""
    return subprocess.Popen(command, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
