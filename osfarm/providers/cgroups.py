"""Per-desktop resource limits with cgroups: memory, processes (tasks) and CPU weight.

Both layouts the kernel offers are handled, since a farm runs where it is put:

* **cgroup v2** (one unified hierarchy, ``/sys/fs/cgroup/cgroup.controllers`` exists):
  ``memory.max`` with ``memory.oom.group`` (a desktop that runs out is killed whole),
  ``memory.swap.max=0``, ``pids.max``, ``cpu.weight``; hits are read from ``memory.events``
  (``oom_kill``) and ``pids.events`` (``max``).
* **cgroup v1** (a hierarchy per controller, e.g. our CI machines): ``memory.limit_in_bytes``
  (and the swap limit when there is one), ``pids.max``, ``cpu.shares``; hits from
  ``memory.oom_control`` (``oom_kill``) and ``pids.events``. v1 has no group kill: the kernel kills
  one process and the farm's health check replaces the desktop.

Desktop cgroups are made under the farm's own cgroup of each controller (so a farm that is itself
limited keeps its desktops within its limit), named ``osfarm-slot-<k>`` after the box's uid slot:
slots are unique on the machine, and a slot's stale cgroup (a farm that died) is emptied and
made afresh by whoever takes the slot next.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from osfarm.providers.base import ProviderError

CGROUP_FS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
V1_OPTIONAL = ("cpuacct",)  # CPU-seconds per desktop (its own hierarchy, or co-mounted with cpu)


def parse_size(text: str) -> int:
    """'3g', '512m', '1.5G', '1048576' -> bytes."""
    t = text.strip().lower().rstrip("b").rstrip("i")
    mult = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "kmgt" else t
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512m, 3g)") from None
    if value <= 0:
        raise ValueError(f"size must be above 0: {text!r}")
    return int(value * mult)


def human_size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Limits:
    memory: int  # bytes
    pids: int
    cpu_weight: int  # 1..10000, 100 = a fair share (cgroup v2's scale)


class DesktopCgroup:
    """The cgroup(s) of one desktop: :attr:`procs_files` for the box to join, :meth:`limit_hit`
    for the health check, :meth:`remove` once its processes are gone."""

    def __init__(self, dirs: dict[str, Path], v2: bool, limits: Limits):
        self.dirs = dirs  # controller ("memory", "pids", "cpu"; v2: "unified") -> dir
        self.v2 = v2
        self.limits = limits

    @classmethod
    def of_process(cls, pid: int, limits: Limits) -> DesktopCgroup | None:
        """The cgroup(s) another manager (Docker) put ``pid`` in, to read its limit hits;
        None when they cannot be found from here (e.g. the farm runs in a container)."""
        try:
            own = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return None
        v2 = (CGROUP_FS / "cgroup.controllers").exists()
        mounts = {} if v2 else _v1_mounts()
        dirs: dict[str, Path] = {}
        for line in own.splitlines():
            _, controllers, path = line.split(":", 2)
            if v2 and controllers == "":
                dirs["unified"] = CGROUP_FS / path.lstrip("/")
            for c in controllers.split(","):
                if c in mounts:
                    dirs[c] = mounts[c] / path.lstrip("/")
        dirs = {c: d for c, d in dirs.items() if d.is_dir()}
        return cls(dirs, v2, limits) if dirs else None

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def _read(self, controller: str, name: str) -> dict[str, int]:
        d = self.dirs.get("unified" if self.v2 else controller)
        if d is None:
            return {}
        try:
            text = (d / name).read_text()
        except OSError:
            return {}
        out: dict[str, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
        return out

    def limit_hit(self) -> str | None:
        """Which limit the desktop ran into, or None. Named for the infra error."""
        mem = self._read("memory", "memory.events" if self.v2 else "memory.oom_control")
        if mem.get("oom_kill", 0) > 0:
            return (f"memory limit {human_size(self.limits.memory)} reached: the kernel killed "
                    f"{mem['oom_kill']} process(es) of the desktop (out of memory)")
        pids = self._read("pids", "pids.events")
        if pids.get("max", 0) > 0:
            return (f"process limit {self.limits.pids} reached: {pids['max']} fork(s) refused "
                    "(processes and threads count)")
        return None

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) every process of the cgroup used since it was made, dead
        ones included (double-forked daemons and reaped children alike); None without the
        accounting controller (v1 without cpuacct)."""
        try:
            if self.v2:
                d = self.dirs.get("unified")
                if d is None:
                    return None
                return self._read("cpu", "cpu.stat").get("usage_usec", 0) / 1e6
            d = self.dirs.get("cpuacct")
            return None if d is None else int((d / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError, ValueError):
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(out)

    def remove(self, timeout: float = 3.0) -> None:
        """Kill whatever is left in it and remove the dirs (idempotent)."""
        deadline = time.monotonic() + timeout
        for d in self.dirs.values():
            while d.exists():
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)


class CgroupRoot:
    """Where this farm makes its desktops' cgroups (see the module doc)."""

    def __init__(self, bases: dict[str, Path], v2: bool):
        self.bases = bases
        self.v2 = v2

    @classmethod
    def detect(cls) -> CgroupRoot:
        """The farm's own cgroups; ProviderError saying what is missing when limits are impossible."""
        if os.geteuid() != 0:
            raise ProviderError("per-desktop cgroups need root")
        own = _own_cgroups()
        if (CGROUP_FS / "cgroup.controllers").exists():
            base = CGROUP_FS / own.get("", "/").lstrip("/")
            _enable_v2_controllers(base)
            return cls({"unified": base}, v2=True)
        mounts = _v1_mounts()
        bases: dict[str, Path] = {}
        missing = []
        for c in V1_CONTROLLERS:
            if c not in mounts:
                missing.append(c)
                continue
            bases[c] = mounts[c] / own.get(c, "/").lstrip("/")
        for c in V1_OPTIONAL:
            if c in mounts:
                bases[c] = mounts[c] / own.get(c, "/").lstrip("/")
        if missing:
            raise ProviderError(f"cgroup v1 controllers not mounted: {', '.join(missing)} "
                                f"(needed for per-desktop limits; mounts under {CGROUP_FS})")
        return cls(bases, v2=False)

    def make(self, name: str, limits: Limits) -> DesktopCgroup:
        """A fresh cgroup ``name`` with ``limits`` (a stale one of that name is emptied first)."""
        dirs = {c: base / name for c, base in self.bases.items()}
        cg = DesktopCgroup(dirs, self.v2, limits)
        cg.remove()
        try:
            for d in dict.fromkeys(dirs.values()):  # cpu and cpuacct may share one mount
                d.mkdir()
            if self.v2:
                d = dirs["unified"]
                _write(d / "memory.max", str(limits.memory))
                _write(d / "memory.swap.max", "0", optional=True)
                _write(d / "memory.oom.group", "1", optional=True)
                _write(d / "pids.max", str(limits.pids))
                _write(d / "cpu.weight", str(limits.cpu_weight))
            else:
                _write(dirs["memory"] / "memory.limit_in_bytes", str(limits.memory))
                _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory), optional=True)
                _write(dirs["pids"] / "pids.max", str(limits.pids))
                _write(dirs["cpu"] / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
        except OSError as e:
            cg.remove()
            raise ProviderError(f"cannot set up cgroup {name}: {e}") from None
        return cg


def _write(path: Path, value: str, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except OSError:
        if not optional:
            raise


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" = the unified hierarchy)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _v1_mounts() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if len(fields) < 3 or fields[0] != "cgroup":
            continue
        mount_point = Path(left.split()[4])
        for opt in fields[2].split(","):
            if opt in (*V1_CONTROLLERS, *V1_OPTIONAL) and opt not in out:
                out[opt] = mount_point
    return out


def _enable_v2_controllers(base: Path) -> None:
    """Let ``base``'s children use memory, pids and cpu. v2 forbids that in a cgroup that has
    processes of its own, so the farm moves itself into a ``osfarm-farm`` leaf first when needed."""
    wanted = {"memory", "pids", "cpu"}
    have = set((base / "cgroup.controllers").read_text().split())
    if not wanted <= have:
        raise ProviderError(f"cgroup {base} lacks controllers {sorted(wanted - have)} "
                            "(delegate them to the farm, e.g. systemd Delegate=yes)")
    control = base / "cgroup.subtree_control"
    if wanted <= set(control.read_text().split()):
        return
    try:
        control.write_text(" ".join(f"+{c}" for c in sorted(wanted)))
        return
    except OSError:
        pass
    leaf = base / "osfarm-farm"
    leaf.mkdir(exist_ok=True)
    for pid in (base / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            (leaf / "cgroup.procs").write_text(pid)
    try:
        control.write_text(" ".join(f"+{c}" for c in sorted(wanted)))
    except OSError as e:
        raise ProviderError(f"cannot enable {sorted(wanted)} in {control}: {e.strerror}") from None
