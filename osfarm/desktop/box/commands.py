"""Running commands in the desktop for the guest's routes: to completion with their output
(``/execute``, ``/run_python``, ``/run_bash_script``), or detached (``/setup/launch``).

Blocking calls, meant for worker threads. Commands get this process's environment, which the
session launcher made the desktop's (DISPLAY, D-Bus, accessibility switches).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import IO

from osfarm.desktop.box.agent_world import AgentWorld

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


def as_agent(command: Command, shell: bool, cwd: str | None, agent: AgentWorld | None
             ) -> tuple[list[str] | str, bool, str | None, dict[str, str] | None]:
    """(argv, shell, cwd, env) for Popen: ``command`` itself, or, with an agent world, the
    same command run as the agent's user in its namespaces (``nsenter`` opens ``cwd``)."""
    if agent is None:
        return command, shell, cwd, None
    argv: list[str]
    if not shell:
        argv = [command] if isinstance(command, str) else list(command)
    elif isinstance(command, str):
        argv = ["/bin/sh", "-c", command]
    else:  # as Popen(shell=True) runs a list: the script, then its $0, $1, ...
        argv = ["/bin/sh", "-c", *command]
    return agent.command(argv, cwd), False, None, agent.env(dict(os.environ))


def run_command(command: Command, shell: bool, timeout: float, cwd: str | None,
                merge_stderr: bool = False, agent: AgentWorld | None = None) -> RunResult:
    """Run a command to completion (blocking) with the desktop's environment (as the agent's
    user when ``agent`` is given).

    Unlike ``subprocess.run`` this returns once the command itself exits even when a background
    child it started keeps the output pipes open (``app &``): readers get a short grace period,
    then the partial output is returned. On timeout the whole process group is killed.
    Raises FileNotFoundError / PermissionError when the program cannot be started.
    """
    if agent is not None:
        check_program(command, shell, agent)
    argv, shell, cwd, env = as_agent(command, shell, cwd, agent)
    proc = subprocess.Popen(
        argv, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True, env=env,
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


def spawn_detached(command: Command, shell: bool, cwd: str | None,
                   agent: AgentWorld | None = None) -> subprocess.Popen[bytes]:
    """Start an app and return at once; it stays a descendant of the session (subreaper)."""
    if agent is not None:
        check_program(command, shell, agent)
    argv, shell, cwd, env = as_agent(command, shell, cwd, agent)
    return subprocess.Popen(argv, shell=shell, cwd=cwd, stdin=subprocess.DEVNULL, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def check_program(command: Command, shell: bool, agent: AgentWorld) -> None:
    """Raise FileNotFoundError / PermissionError, as Popen would, when the program of a command
    run as the agent is missing: ``nsenter`` would only say so in an exit status. Looked up on
    the agent's PATH as this process sees the box (the same system dirs); a program the guest
    cannot see (in the agent's home) is left for the agent's side to find."""
    if shell:
        return
    prog = command if isinstance(command, str) else command[0]
    if "/" in prog:
        if os.path.isdir(prog):
            raise PermissionError(13, "Permission denied", prog)
        return
    path = agent.env(dict(os.environ))["PATH"]
    if shutil.which(prog, path=path) is None and not any(
            os.path.lexists(os.path.join(d, prog)) for d in path.split(":") if d):
        raise FileNotFoundError(2, "No such file or directory", prog)
