"""The box's processes as the guest sees them in ``/proc``, and which of them are the agent's.

The fingerprint lists them by command line (:mod:`osfarm.desktop.warm.fingerprint`); a warm reset
kills the agent's (:mod:`osfarm.desktop.warm.kill_rounds`).
"""

from __future__ import annotations

import os


def proc_table(cmdline: bool = True) -> dict[int, tuple[int, str, float]]:
    """pid -> (uid, command line, start ticks) of every process this guest can see (the box's);
    without ``cmdline``, "" for each command line. Zombies are left out, but not a process whose
    main thread exited while its other threads run (its stat says Z: it would escape the kill)."""
    out: dict[int, tuple[int, str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/status") as f:
                status = {k: v.split() for k, _, v in (ln.partition(":") for ln in f)}
            uid = int(status["Uid"][0])
            cmd = ""
            if cmdline:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat", "rb") as f:
                head, _, tail = f.read().rpartition(b")")
                fields = tail.split()
            if fields[0] == b"Z":
                # a zombie, unless only its main thread exited (pthread_exit) and others run on:
                # then it is a live process with no command line, named by its comm
                if int(status.get("Threads", ["1"])[0]) <= 1:
                    continue
                cmd = cmd or "[" + head.partition(b"(")[2].decode(errors="replace") + "]" if cmdline else ""
            out[pid] = (uid, cmd, float(fields[19]))
        except (OSError, StopIteration, IndexError, ValueError, KeyError):
            continue
    return out


def is_agent(uid: int, guest_uid: int) -> bool:
    """A process of the agent: neither the guest's nor the box's root (a Docker box's init, tini,
    is PID 1 as root; the agent's root is mapped to a non-zero uid, AgentWorldSpec.outside_base)."""
    return uid not in (guest_uid, 0)
