"""A box's init: what runs as the box's root before the desktop, in every provider.

``python -m osfarm.desktop.box.box_init PLAN.json`` (as root: the host's for the sandbox, the
container's or the VM's for Docker and libvirt) carries out a :class:`BoxPlan`:

1. joins the desktop's cgroups (the sandbox: so that every process of the box is limited);
2. (the sandbox) builds the box's file system on a tmpfs from the plan's mounts, sets the
   hostname, and pivots into it; then mounts ``/proc`` for the box's PID namespace with
   ``hidepid=invisible`` (the agent sees its own processes only);
3. fills the agent's home from a template (owned by the agent's user) and makes the guest's run
   dir the guest's (``0700``: the token and the socket are the guest's alone);
4. makes the agent's world (:mod:`osfarm.desktop.box.agent_world`);
5. drops to the guest uid (no groups, no capabilities) and executes the session launcher.

The sandbox provider starts it as PID 1 of new namespaces (``unshare``), so the launcher ends up
as the box's PID 1: killing it from the host kills the box. A box forked from the sandbox's box template
(:mod:`osfarm.desktop.launch.box_zygote`) runs steps 1-4 (:func:`prepare`) and the drop of step 5
(:func:`become_guest`) the same way, then the launcher in its process. Standard library only (it starts on
every reset).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from osfarm.desktop.box import linux_ns
from osfarm.desktop.box.agent_world import (
    ENV_VAR,
    AgentWorld,
    AgentWorldSpec,
    make_agent_world,
)
from osfarm.errors import InfraError

PLAN_ENV = "OSFARM_BOX_PLAN"  # ``--env``: the plan in this variable (a container's command line)


@dataclass(frozen=True)
class Mount:
    """One step of building a box's file system. ``target`` is a box path.

    kinds: ``bind`` (``source`` on the host; a file or a dir), ``tmpfs``, ``mqueue`` and ``overlay``
    (``options`` is the mount data), ``proc``, ``devpts``, ``dir`` (mkdir with ``mode``,
    ``uid``, ``gid``), ``symlink`` (to ``source``), ``file`` (an empty file: a bind target).
    """

    kind: str
    target: str
    source: str = ""
    options: str = ""
    readonly: bool = True
    suid: bool = False
    dev: bool = False
    exec: bool = True
    mode: int = 0o755
    uid: int = 0
    gid: int = 0

    def flags(self) -> int:
        return ((linux_ns.MS_RDONLY if self.readonly else 0) | (0 if self.suid else linux_ns.MS_NOSUID)
                | (0 if self.dev else linux_ns.MS_NODEV) | (0 if self.exec else linux_ns.MS_NOEXEC))


@dataclass(frozen=True)
class BoxPlan:
    launcher: list[str]  # argv, box paths
    env: dict[str, str]
    guest_uid: int
    guest_gid: int
    run_dir: str  # box path; made the guest's, 0700
    home: str  # box path of the agent's home (exists: a mount or a dir of the image)
    home_uid: int  # box ids of the agent's user
    home_gid: int
    home_template: str = ""  # copied into the home (a host path for the sandbox, else a box path)
    home_files: dict[str, str] = field(default_factory=dict)  # rel path -> text, written where missing
    # a container's or VM's own /etc (a sandbox gets its /etc as a mount): rel path -> text, or
    # "->target" for a symlink; the GNOME desktop's time zone
    etc_files: dict[str, str] = field(default_factory=dict)
    agent: AgentWorldSpec | None = None
    new_root: str = ""  # sandbox: an empty host dir to build the box in ("" = stay in this root)
    mounts: list[Mount] = field(default_factory=list)  # before the pivot, in order
    proc_options: str = ""  # "" = do not mount /proc (a container or VM has its own)
    hostname: str = ""
    cgroup_procs: list[str] = field(default_factory=list)
    cwd: str = "/"
    death_signal: int = 0  # re-armed after dropping to the guest uid (the sandbox: SIGKILL)
    loopback_up: bool = False  # a new network namespace: bring up lo

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BoxPlan:
        d = json.loads(text)
        d["mounts"] = [Mount(**m) for m in d.get("mounts", [])]
        if d.get("agent"):
            d["agent"] = AgentWorldSpec(**d["agent"])
        return cls(**d)


class BoxInitError(InfraError, RuntimeError):
    """A step of the box's init failed; the message names the step."""


def join_cgroups(procs_files: list[str]) -> None:
    for path in procs_files:
        try:
            with open(path, "w") as f:
                f.write("0\n")
        except OSError as e:
            raise BoxInitError(f"joining cgroup {os.path.dirname(path)}: {e.strerror}") from None


def build_root(plan: BoxPlan) -> None:
    """Mount the plan's file system at ``new_root``, fill the home (its template is a host
    path, still visible here), and pivot into it."""
    root = plan.new_root
    linux_ns.mount("tmpfs", root, "tmpfs", linux_ns.MS_NOSUID | linux_ns.MS_NODEV, "mode=755,size=1m")
    for m in plan.mounts:
        try:
            _mount(root, m)
        except OSError as e:
            raise BoxInitError(f"box file system: {m.kind} {m.source or ''} -> {m.target}: {e}") from None
    fill_home(plan, root + plan.home)
    linux_ns.mount(None, root, None, linux_ns.MS_REMOUNT | linux_ns.MS_RDONLY | linux_ns.MS_NOSUID | linux_ns.MS_NODEV)
    if plan.hostname:
        socket.sethostname(plan.hostname)
    os.chdir(root)
    linux_ns.pivot_root(".", ".")  # the old root ends up stacked under the new one ...
    linux_ns.umount(".")  # ... and is detached here
    os.chdir("/")


def _mount(root: str, m: Mount) -> None:
    target = root + m.target
    if m.kind == "dir":
        os.makedirs(target, exist_ok=True)
        os.chown(target, m.uid, m.gid)
        os.chmod(target, m.mode)
        return
    if m.kind == "symlink":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(m.source, target)
        return
    if m.kind == "file":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
        return
    if m.kind == "bind":
        if not os.path.lexists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(m.source):
                os.mkdir(target)
            else:
                open(target, "a").close()
        linux_ns.bind(m.source, target, readonly=m.readonly, nosuid=not m.suid, nodev=not m.dev, noexec=not m.exec)
        return
    os.makedirs(target, exist_ok=True)
    if m.kind in ("tmpfs", "overlay", "devpts", "mqueue"):
        linux_ns.mount(m.kind, target, m.kind, m.flags() & ~linux_ns.MS_RDONLY, m.options or None)
        if m.readonly:
            linux_ns.mount(None, target, None, linux_ns.MS_REMOUNT | m.flags())
        return
    raise BoxInitError(f"unknown mount kind {m.kind!r}")


def fill_home(plan: BoxPlan, home: str) -> None:
    """Copy the template into the (empty) home and write the home files it lacks, all owned by
    the agent's user. Symlinks are copied as symlinks, never followed."""
    if plan.home_template and os.path.isdir(plan.home_template):
        shutil.copytree(plan.home_template, home, symlinks=True, dirs_exist_ok=True)
    for rel, text in plan.home_files.items():
        path = os.path.join(home, rel)
        if os.path.lexists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), plan.home_uid, plan.home_gid)
    os.chown(home, plan.home_uid, plan.home_gid)


def write_etc(files: dict[str, str], etc: str = "/etc") -> None:
    """Write the plan's /etc files (root's, 0644), replacing what is there; a path that leaves
    ``etc`` is refused."""
    for rel, content in files.items():
        path = os.path.normpath(os.path.join(etc, rel))
        if not path.startswith(etc.rstrip("/") + "/"):
            raise BoxInitError(f"etc file {rel!r} is outside {etc}")
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        if content.startswith("->"):
            os.symlink(content[2:], path)
        else:
            with open(path, "w") as f:
                f.write(content)
            os.chmod(path, 0o644)


def guest_run_dir(plan: BoxPlan) -> None:
    """The run dir and its token, the guest's alone (already so when the farm could make them so)."""
    st = os.lstat(plan.run_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise BoxInitError(f"run dir {plan.run_dir} is not a directory")
    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (plan.guest_uid, plan.guest_gid, 0o700):
        return  # made so by the farm (this root may lack the capability to look inside)
    token = os.path.join(plan.run_dir, "token")
    for path, mode in ((token, 0o400), (plan.run_dir, 0o700)):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise BoxInitError(f"{path} is a symlink")
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
        if (st.st_uid, st.st_gid) != (plan.guest_uid, plan.guest_gid):
            os.chown(path, plan.guest_uid, plan.guest_gid)


# When this process started its work (monotonic, the host's clock too): with the later steps'
# times, passed to the session (TIMES_VAR), which reports them with its own (a cold start's parts).
_STARTED = time.monotonic()
TIMES_VAR = "OSFARM_BOX_TIMES"


def prepare(plan: BoxPlan, started: float | None = None) -> dict[str, str]:
    """Carry out the plan up to the launcher (steps 1-4, as the box's root); returns the
    launcher's environment. Shared by :func:`run` and a box forked from the template
    (:mod:`osfarm.desktop.launch.box_zygote`, ``sandbox_start: fork``); ``started``: when the box's init
    began (monotonic; default: when this module was imported)."""
    times = {"init": _STARTED if started is None else started}
    join_cgroups(plan.cgroup_procs)
    if plan.loopback_up:
        linux_ns.loopback_up()
    if plan.new_root:
        build_root(plan)
    else:
        write_etc(plan.etc_files)
        fill_home(plan, plan.home)
    if plan.proc_options:
        os.makedirs("/proc", exist_ok=True)
        linux_ns.mount("proc", "/proc", "proc", linux_ns.MS_NOSUID | linux_ns.MS_NODEV | linux_ns.MS_NOEXEC,
                       plan.proc_options)
    guest_run_dir(plan)
    times["root"] = time.monotonic()
    env = dict(plan.env)
    if plan.agent is not None:
        userns, mntns = make_agent_world(plan.agent)
        nsenter = shutil.which("nsenter", path=env.get("PATH")) or "/usr/bin/nsenter"
        setpriv = shutil.which("setpriv", path=env.get("PATH")) or "/usr/bin/setpriv"
        world = AgentWorld(userns, mntns, uid=plan.agent.user_uid, gid=plan.agent.user_gid, user=plan.agent.user,
                           home=plan.agent.home, runtime_dir=f"/run/user/{plan.agent.user_uid}", nsenter=nsenter,
                           setpriv=setpriv)
        env[ENV_VAR] = world.to_env()
    times["agent_world"] = time.monotonic()
    env[TIMES_VAR] = json.dumps(times)
    return env


def become_guest(plan: BoxPlan) -> None:
    """Step 5 without the exec: the plan's cwd, then the guest uid (no groups, no capabilities)."""
    os.chdir(plan.cwd)
    os.setgroups([])
    os.setresgid(plan.guest_gid, plan.guest_gid, plan.guest_gid)
    os.setresuid(plan.guest_uid, plan.guest_uid, plan.guest_uid)
    if plan.death_signal:
        # Changing credentials cleared the parent-death signal the box was started with
        # (``unshare --kill-child``): set it again, so the box still dies with its parent.
        linux_ns.set_parent_death_signal(plan.death_signal)


def run(plan: BoxPlan) -> None:
    """Carry out the plan, then exec the launcher (does not return)."""
    env = prepare(plan)
    become_guest(plan)
    os.execve(plan.launcher[0], plan.launcher, env)


PLAN_MAX_BYTES = 1 << 20  # a plan is ~16 KiB (mounts, ids, the launcher's arguments)


def read_plan(path: str) -> BoxPlan:
    """A plan file as the farm wrote it: a regular file (no symlink) of root's, mode 0600, at most
    PLAN_MAX_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{path}: not a regular file of root's, mode 0600")
        if st.st_size > PLAN_MAX_BYTES:
            raise ValueError(f"{path}: {st.st_size} bytes, a plan has at most {PLAN_MAX_BYTES}")
        return BoxPlan.from_json(f.read(PLAN_MAX_BYTES))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2 and args[0] != "--env"):
        print("usage: python -m osfarm.desktop.box.box_init PLAN.json | --env VAR (as root)", file=sys.stderr)
        return 2
    try:
        text = os.environ.get(args[1], "") if len(args) == 2 else Path(args[0]).read_text()
        plan = BoxPlan.from_json(text)
    except (OSError, ValueError, TypeError) as e:
        print(f"osfarm-box-init: cannot read plan {args[0]}: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("osfarm-box-init: must run as root (it makes namespaces and mounts, then drops to the guest uid)",
              file=sys.stderr)
        return 2
    try:
        run(plan)
    except (OSError, BoxInitError) as e:
        print(f"osfarm-box-init: {e}", file=sys.stderr)
        return 1
    return 1  # execve does not return


if __name__ == "__main__":
    sys.exit(main())
