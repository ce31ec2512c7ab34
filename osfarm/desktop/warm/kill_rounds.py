"""A warm reset's kill rounds: every process of the agent ends (SIGKILL, in rounds, until none is
left: double-forked daemons are still in the box's PID namespace, a process ignoring SIGTERM gets
no choice), and the ones this guest adopted are reaped at once."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

from osfarm.desktop.box.process_tree import children
from osfarm.desktop.warm.box_processes import is_agent, proc_table
from osfarm.desktop.warm.warm_reset_error import WarmResetError

KILL_ROUNDS = 50
KILL_WAIT_S = 2.0  # for the killed processes to exit, all rounds together


def _agent_pids(baseline: set[tuple[int, float]] | None = None) -> list[int]:
    """The agent's processes (not the guest's uid) that are not in ``baseline`` ((pid, start))."""
    guest_uid = os.getuid()
    return [pid for pid, (uid, _, start) in proc_table(cmdline=False).items()
            if is_agent(uid, guest_uid) and (baseline is None or (pid, start) not in baseline)]


def reap_agent_zombies() -> int:
    """Collect the killed agent processes this guest adopted (it is the box's child subreaper)
    now, not a second later: a zombie keeps its name (``prctl(PR_SET_NAME)``: 15 bytes the agent
    chose) in ``/proc`` for the next episode's agent to read. Returns how many."""
    guest_uid, reaped = os.getuid(), 0
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = {k: v.split() for k, _, v in (ln.partition(":") for ln in f)}
            if status["State"][0] not in ("Z", "X") or not is_agent(int(status["Uid"][0]), guest_uid):
                continue
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped += 1
        except (OSError, KeyError, IndexError, ValueError, ChildProcessError):
            continue
    return reaped


def kill_agent_processes(baseline: set[tuple[int, float]]) -> int:
    """SIGKILL every agent process that is not in ``baseline``, in rounds until none is left (a
    process that forks meanwhile is caught in the next round). Returns how many were killed.

    Each round waits for its victims to have exited (their pidfds turn readable), not a fixed
    time; a pidfd also makes sure the signal goes to the process seen, not to one that got its
    pid since."""
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    for _ in range(KILL_ROUNDS):
        victims = _agent_pids(baseline)
        if not victims:
            return len(killed)
        poller = select.poll()
        fds = []
        try:
            for pid in victims:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # gone already (or pidfds unsupported: a plain kill, then a short wait)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                    fds.append(-1)
                    continue
                fds.append(fd)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.add(pid)
                poller.register(fd, select.POLLIN)
            waiting = {fd for fd in fds if fd >= 0}
            if -1 in fds:
                time.sleep(0.005)
            while waiting and time.monotonic() < deadline:
                for fd, _ in poller.poll(max(1, int(min(0.25, deadline - time.monotonic()) * 1000))):
                    poller.unregister(fd)
                    waiting.discard(fd)
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        if time.monotonic() >= deadline:
            break
    left = _agent_pids(baseline)
    if not left:
        return len(killed)
    raise WarmResetError(f"agent processes survived {KILL_ROUNDS} kill rounds: {left[:10]}")
