"""The agent's world inside a desktop: a user namespace and a mount namespace in which everything
done for the agent runs (its commands, the apps, the pyautogui interpreter, the file reads and
writes of the guest's file routes, the D-Bus session and AT-SPI buses), apart from the guest.

Two parties share a desktop:

* the **guest**: the session launcher, Xvfb, the window manager, the panel and the guest server,
  as one box-level uid (the *guest uid*) that is not mapped into the agent's user namespace;
* the **agent**: a user namespace owned by the guest uid in which box uids 0..65535 map to an
  outside range that holds neither the guest uid nor host root. ``user`` (uid 1000, HOME
  ``/home/user``) is the agent's account; ``sudo`` with the password makes it the namespace's root,
  as on OSWorld's VM.

What that gives: the agent's processes, root included, cannot signal, trace or impersonate the
guest (signals and ptrace need the same uid or a capability in the guest's namespace, which the
agent's root does not have; the guest uid is unmapped, so no setuid reaches it), cannot read or
replace the guest's token and socket (0700 dirs of an unmapped owner: the agent's
CAP_DAC_OVERRIDE covers only inodes whose owner is mapped), and sees host files as ``nobody``.
The guest owns the namespace, so it can start processes in it (``nsenter``), see, signal and
kill them.

The agent's mount namespace belongs to its user namespace and starts as a copy of the box's
mounts; on top of them it gets its own ``/etc`` (an overlay whose top layer holds passwd, group,
shadow, sudoers, hosts and hostname, owned by the agent's root so that ``sudo`` and account
tools work; writes go to a tmpfs), its own ``/run`` (``/run/user/1000``; the guest's
``/run/osfarm`` is covered), and a copy of ``sudo`` owned by the agent's root (a setuid binary
works in a user namespace only when its owner is mapped there). The agent's root may remount
anything in that namespace: it changes only the agent's own view. The guest never runs a
program, reads a file or loads a library through it: ``nsenter`` sets the agent's uid before it
executes anything there.

:func:`make_agent_world` (box-level root, before the launcher starts) builds it and returns the
two namespace fds; the launcher inherits them and says where they are in ``$OSFARM_AGENT_WORLD``.
:class:`AgentWorld` (the guest side) turns a command into one that runs in the agent's world, and
gives the environment the agent's processes get.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from osfarm.desktop.box import linux_ns
from osfarm.errors import OsfarmError

ENV_VAR = "OSFARM_AGENT_WORLD"
ID_COUNT = 65536  # box uids/gids 0..65535 are mapped for the agent
NOBODY = 65534
AGENT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The guest's variables that the agent's processes must not inherit.
GUEST_ONLY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV", "TMPDIR", "XDG_CACHE_HOME",
                  "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", ENV_VAR)
AGENT_OSFARM_ENV = ("OSFARM_PYTHON",)  # osfarm-settle (task setups run it as the agent) needs it
SUDOERS = """\
# The agent's sudoers (osfarm): OSWorld's VM gives "user" sudo with its password.
Defaults\tenv_reset
Defaults\tmail_badpass
Defaults\tsecure_path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
root\tALL=(ALL:ALL) ALL
%sudo\tALL=(ALL:ALL) ALL
"""  # no @includedir: the box's own /etc/sudoers.d is not the agent's root's to read


class AgentWorldError(OsfarmError, RuntimeError):
    """The agent's namespaces could not be made; the message says which step failed."""


@dataclass(frozen=True)
class AgentWorldSpec:
    """What :func:`make_agent_world` builds. Ids are the box's (the sandbox: host ids)."""

    guest_uid: int
    guest_gid: int
    outside_base: int  # box uid/gid of the agent's root; the agent's ids are [base, base + ID_COUNT)
    password_hash: str  # crypt(3) hash of the user's password; "" = the user's hash in the box's /etc/shadow
    user: str = "user"
    user_uid: int = 1000
    user_gid: int = 1000
    home: str = "/home/user"
    hostname: str = ""  # "" = the box's own
    sudo: str = "/usr/bin/sudo"
    sudo_libexec: str = "/usr/libexec/sudo"
    # An empty dir of the box where the agent's tmpfs (its /etc layer, the sudo copy) is mounted;
    # under /run, so the agent's own /run covers it.
    state_dir: str = "/run/osfarm-agent"
    state_size: str = "64m"
    run_size: str = "64m"

    def check(self) -> None:
        for name in ("guest_uid", "guest_gid"):
            v = getattr(self, name)
            if self.outside_base <= v < self.outside_base + ID_COUNT:
                raise AgentWorldError(f"{name} {v} lies inside the agent's id range "
                                      f"[{self.outside_base}, {self.outside_base + ID_COUNT})")
        if self.outside_base <= 0:
            raise AgentWorldError("outside_base must be above 0: the agent's root must not be the box's root")


@dataclass(frozen=True)
class AgentWorld:
    """The guest's handle on the agent's world (see the module doc)."""

    userns_fd: int
    mntns_fd: int
    uid: int = 1000
    gid: int = 1000
    user: str = "user"
    home: str = "/home/user"
    runtime_dir: str = "/run/user/1000"
    nsenter: str = "/usr/bin/nsenter"
    setpriv: str = "/usr/bin/setpriv"
    holder_pid: int = field(default_factory=os.getpid)  # the process holding the two fds

    def to_env(self) -> str:
        d = asdict(self)
        d.pop("holder_pid")
        return json.dumps(d)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> AgentWorld | None:
        """The world this process was started with, or None (a desktop without one: commands
        run as the launcher's own user, as ``osfarm desktop run`` does on a workstation)."""
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            return None
        d = json.loads(raw)
        world = cls(**d)
        for fd in (world.userns_fd, world.mntns_fd):
            os.fstat(fd)  # fail now, not at the first command, when the fds did not survive
        return world

    def command(self, argv: list[str], cwd: str | None = None, root: bool = False) -> list[str]:
        """``argv`` run as the agent's user in its namespaces (``cwd`` is opened before); with
        ``root``, as the agent's root (what ``sudo`` gives it: the GNOME desktop's system bus).

        ``nsenter`` enters the namespaces as the agent's root; ``setpriv``, the first program run
        there, becomes ``user`` with its groups (``sudo``...) from the agent's /etc/group, as a
        login on OSWorld's VM has them. Nothing of the agent's world runs with the guest's uid:
        nsenter changes its uid before it executes anything (what it executes is the agent's, as
        the agent's root: no more than the agent's sudo gives).
        """
        pre = [
            self.nsenter,
            f"--user=/proc/{self.holder_pid}/fd/{self.userns_fd}",
            f"--mount=/proc/{self.holder_pid}/fd/{self.mntns_fd}",
            "--setuid=0", "--setgid=0",
        ]  # fmt: skip
        if cwd:
            pre.append(f"--wd={cwd}")
        if root:
            return [*pre, "--", *argv]
        become = [self.setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--"]
        return [*pre, "--", *become, *argv]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment of the agent's processes: the desktop's (display, buses,
        accessibility switches, locale) as the user, without the guest's own variables."""
        env = {k: v for k, v in base.items()
               if k not in GUEST_ONLY_ENV and (not k.startswith("OSFARM_") or k in AGENT_OSFARM_ENV)}
        path = [p for p in base.get("PATH", "").split(":") if p.endswith("/assets/bin")]
        env.update(
            HOME=self.home, USER=self.user, LOGNAME=self.user, SHELL="/bin/bash",
            XDG_RUNTIME_DIR=self.runtime_dir, PATH=":".join([*path, AGENT_PATH]),
        )  # fmt: skip
        return env


# -- building it (box-level root) -------------------------------------------------------------------


def make_agent_world(spec: AgentWorldSpec) -> tuple[int, int]:
    """Create the agent's user and mount namespaces; returns (userns fd, mntns fd), inheritable.

    First this process (root) moves into a user namespace of its own that maps every id to
    itself (:func:`enter_identity_namespace`). Then a child drops to the guest uid and makes the
    agent's user namespace (so the guest owns it); this process writes its id maps; the child,
    now the namespace's root, makes the mount namespace and the agent's mounts, then waits until
    both namespaces are held by fds here, and exits. This process is left in the identity
    namespace, where it drops to the guest uid and starts the launcher.
    """
    spec.check()
    enter_identity_namespace()
    if not spec.password_hash:  # read here: the agent's root cannot read the box's shadow file
        spec = dataclasses.replace(spec, password_hash=_shadow_hash(Path("/etc"), spec.user))
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(to_parent_r)
        os.close(to_child_w)
        code = 0
        try:
            os.setgroups([])
            os.setresgid(spec.guest_gid, spec.guest_gid, spec.guest_gid)
            os.setresuid(spec.guest_uid, spec.guest_uid, spec.guest_uid)
            linux_ns.unshare(linux_ns.CLONE_NEWUSER)
            os.write(to_parent_w, b"u")
            if os.read(to_child_r, 1) != b"g":
                raise AgentWorldError("the parent did not write the id maps")
            os.setgroups([])
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
            # Changing credentials made this process non-dumpable, and its memory still belongs
            # to the host's namespace: the parent could then not open its namespace files.
            linux_ns.set_dumpable(True)
            linux_ns.unshare(linux_ns.CLONE_NEWNS)
            _agent_mounts(spec)
            os.write(to_parent_w, b"m")
            os.read(to_child_r, 1)
        except BaseException as e:  # noqa: BLE001 - any failure in the child goes to the parent as text
            code = 1
            try:
                os.write(to_parent_w, b"!" + f"{type(e).__name__}: {e}".encode()[:4000])
            except OSError:
                pass
        os._exit(code)
    os.close(to_parent_w)
    os.close(to_child_r)
    try:
        msg = os.read(to_parent_r, 4096)
        if msg != b"u":
            raise AgentWorldError(f"creating the agent's user namespace: {_child_error(msg)}")
        ids = [(0, spec.outside_base, ID_COUNT)]
        linux_ns.write_id_maps(pid, ids, ids)
        os.write(to_child_w, b"g")
        msg = os.read(to_parent_r, 4096)
        if msg != b"m":
            raise AgentWorldError(f"making the agent's mounts: {_child_error(msg)}")
        userns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
        mntns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
        os.write(to_child_w, b"x")
    finally:
        os.close(to_parent_r)
        os.close(to_child_w)
        os.waitpid(pid, 0)
    os.set_inheritable(userns, True)
    os.set_inheritable(mntns, True)
    return userns, mntns


def enter_identity_namespace() -> None:
    """Move this (single-threaded, root) process into a new user namespace mapping every id to
    itself, as its root.

    Why: writing a child namespace's id maps needs CAP_SYS_ADMIN over that namespace. Root in a
    container has no CAP_SYS_ADMIN; here, as the owner of the identity namespace, it has every
    capability in it and in the namespaces made from it (the agent's is made from it, by the
    guest). Ids, file owners and the host's view of processes are unchanged.
    """
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(up_r)
        os.close(down_w)
        code = 0
        try:
            linux_ns.unshare(linux_ns.CLONE_NEWUSER)
            os.write(up_w, b"u")
        except OSError as e:
            code = 1
            os.write(up_w, b"!" + str(e).encode()[:2000])
        os.read(down_r, 1)  # hold the namespace until the parent has joined it
        os._exit(code)
    os.close(up_w)
    os.close(down_r)
    try:
        msg = os.read(up_r, 4096)
        if msg != b"u":
            raise AgentWorldError(f"making the identity user namespace: {_child_error(msg)}")
        full = [(0, 0, 0xFFFFFFFF)]
        linux_ns.write_id_maps(pid, full, full)
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
        try:
            linux_ns.setns(fd, linux_ns.CLONE_NEWUSER)
        finally:
            os.close(fd)
    finally:
        os.close(up_r)
        os.close(down_w)
        os.waitpid(pid, 0)


def _child_error(msg: bytes) -> str:
    return msg[1:].decode(errors="replace") if msg.startswith(b"!") else "the child exited"


def _agent_mounts(spec: AgentWorldSpec) -> None:
    """In the child, as the agent's root in its new mount namespace (see the module doc)."""
    state = spec.state_dir
    linux_ns.mount("tmpfs", state, "tmpfs", linux_ns.MS_NOSUID | linux_ns.MS_NODEV, f"mode=755,size={spec.state_size}")
    top, upper, work = f"{state}/etc", f"{state}/etc.upper", f"{state}/etc.work"
    for d in (top, upper, work):
        os.mkdir(d, 0o755)
    files = agent_etc_files(spec, Path("/etc"))
    for name, (text, mode, gid) in files.items():
        path = f"{top}/{name}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        os.chown(path, 0, gid)
        os.chmod(path, mode)
    try:
        linux_ns.mount("overlay", "/etc", "overlay", linux_ns.MS_NOSUID | linux_ns.MS_NODEV,
                       f"lowerdir={top}:/etc,upperdir={upper},workdir={work},userxattr")
    except OSError:
        # /etc has mounts of its own (Docker binds /etc/hosts, hostname, resolv.conf), which an
        # overlay cannot take as its lower layer: bind the files instead (writable, but not
        # replaceable by rename, so account tools that rename over /etc/passwd fail).
        for name in files:
            if os.path.lexists(f"/etc/{name}") and not os.path.islink(f"/etc/{name}"):
                linux_ns.bind(f"{top}/{name}", f"/etc/{name}", readonly=False)
    if os.path.isfile(spec.sudo):
        sudo_dir = f"{state}/sudo"
        os.mkdir(sudo_dir, 0o755)
        shutil.copyfile(spec.sudo, f"{sudo_dir}/sudo")
        os.chmod(f"{sudo_dir}/sudo", 0o4755)
        linux_ns.bind(f"{sudo_dir}/sudo", spec.sudo, nosuid=False)
        if os.path.isdir(spec.sudo_libexec):
            shutil.copytree(spec.sudo_libexec, f"{sudo_dir}/libexec", symlinks=True)
            linux_ns.bind(f"{sudo_dir}/libexec", spec.sudo_libexec, nosuid=False)
    linux_ns.mount("tmpfs", "/run", "tmpfs", linux_ns.MS_NOSUID | linux_ns.MS_NODEV, f"mode=755,size={spec.run_size}")
    runtime = f"/run/user/{spec.user_uid}"
    os.makedirs(runtime, 0o755)
    os.chown(runtime, spec.user_uid, spec.user_gid)
    os.chmod(runtime, 0o700)
    os.mkdir("/run/lock", 0o1777)
    os.chmod("/run/lock", 0o1777)


def agent_etc_files(spec: AgentWorldSpec, etc: Path) -> dict[str, tuple[str, int, int]]:
    """The agent's own /etc files: name -> (text, mode, group). System accounts (uid below 1000,
    and nobody) come from the box's passwd and group; the guest's account is left out."""
    users = [ln for ln in _lines(etc / "passwd") if _id_of(ln) is not None and _system_id(_id_of(ln), spec)]
    groups = [ln for ln in _lines(etc / "group") if _id_of(ln) is not None and _system_id(_id_of(ln), spec)]
    names = {ln.split(":")[0] for ln in users}
    if "root" not in names:
        users.insert(0, "root:x:0:0:root:/root:/bin/bash")
    users.append(f"{spec.user}:x:{spec.user_uid}:{spec.user_gid}:{spec.user}:{spec.home}:/bin/bash")
    gnames = {ln.split(":")[0]: i for i, ln in enumerate(groups)}
    if "root" not in gnames:
        groups.insert(0, "root:x:0:")
        gnames = {ln.split(":")[0]: i for i, ln in enumerate(groups)}
    if "sudo" in gnames:
        i = gnames["sudo"]
        members = [m for m in groups[i].split(":")[3].split(",") if m]
        groups[i] = ":".join(groups[i].split(":")[:3] + [",".join([*members, spec.user])])
    else:
        groups.append(f"sudo:x:27:{spec.user}")
    groups.append(f"{spec.user}:x:{spec.user_gid}:")
    shadow_gid = next((int(ln.split(":")[2]) for ln in groups if ln.startswith("shadow:")), 0)
    shadow = [f"{ln.split(':')[0]}:*:19000:0:99999:7:::" for ln in users[:-1]]
    shadow.append(f"{spec.user}:{spec.password_hash or '!'}:19000:0:99999:7:::")
    gshadow = [f"{ln.split(':')[0]}:*::{ln.split(':')[3]}" for ln in groups]
    hostname = spec.hostname or socket.gethostname()
    return {
        "passwd": ("\n".join(users) + "\n", 0o644, 0),
        "group": ("\n".join(groups) + "\n", 0o644, 0),
        "shadow": ("\n".join(shadow) + "\n", 0o640, shadow_gid),
        "gshadow": ("\n".join(gshadow) + "\n", 0o640, shadow_gid),
        "sudoers": (SUDOERS, 0o440, 0),
        "sudo.conf": ("# osfarm: the defaults\n", 0o644, 0),
        "hostname": (hostname + "\n", 0o644, 0),
        "hosts": (f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
                  0o644, 0),
    }


def _shadow_hash(etc: Path, user: str) -> str:
    """The password hash of ``user`` in the box's own shadow file (an image made with chpasswd);
    "!" (no password login) when there is none."""
    for line in _lines(etc / "shadow"):
        parts = line.split(":")
        if parts[0] == user and len(parts) > 1:
            return parts[1]
    return "!"


def _lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    except OSError:
        return []


def _id_of(line: str) -> int | None:
    parts = line.split(":")
    return int(parts[2]) if len(parts) >= 4 and parts[2].isdigit() else None


def _system_id(n: int | None, spec: AgentWorldSpec) -> bool:
    return n is not None and (n < 1000 or n == NOBODY) and n not in (spec.guest_uid, spec.guest_gid)


def private_dir(path: str, uid: int, gid: int, mode: int = 0o700) -> None:
    """``path`` as a directory owned by uid:gid with ``mode``, refusing a symlink in its place."""
    os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise AgentWorldError(f"{path} is not a directory")
    os.chown(path, uid, gid)
    os.chmod(path, mode)
