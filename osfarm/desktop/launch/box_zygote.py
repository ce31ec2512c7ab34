"""The sandbox's box template (``sandbox_start: fork``): one pre-initialised process per farm
that forks a box per request, instead of a new interpreter per box.

A cold box spends about half of its CPU importing the guest's server stack (fastapi, uvicorn,
numpy, our routes). The template imports it once; each box is a fork of it that keeps those
modules. Started by the sandbox provider (:mod:`osfarm.providers.box_template`), as root, in two
steps, both ``python -m osfarm.desktop.launch.box_zygote``:

1. ``--mounts JSON`` (the farm's interpreter): set a parent-death signal (the farm's thread),
   enter a private mount namespace, mount a tmpfs at ``/opt/osfarm`` holding osfarm's code and
   packages exactly where a box has them (:mod:`osfarm.providers.sandbox_layout`), and exec step 2
   with the box's interpreter (``/opt/osfarm/bin/python3``). Every module path, and every path
   computed from ``__file__`` (the session's assets), is then the box's.
2. ``--serve FD``: import the launcher, the session and the guest's server stack (numpy with
   OpenBLAS single-threaded), say ``ready``, and serve requests on FD (one end of a socketpair
   the provider kept the other end of: nobody else can reach it).

A request names a plan file the farm wrote (root's, 0600, read as :func:`box_init.read_plan`
checks) and carries the box's log as a passed fd. The template (single-threaded: checked before
every fork) forks the box's top process, which does what ``unshare --fork --kill-child`` does in
an exec start: a new session, a parent-death signal, new mount, PID, IPC, UTS (and network)
namespaces, a fork whose child is the box's PID 1, waited for; it exits as that child did. PID 1
carries out the plan (:func:`box_init.prepare`, as an exec start does), drops to the guest uid
(:func:`box_init.become_guest`) and runs the launcher's ``main`` in its process (a launcher
other than osfarm's is exec'd). The template reaps the boxes' top processes (a pidfd each) and
reports ``{"exit": pid, "status": wait status}``.

What forked boxes share with the template and each other: the template's memory (code and
imported modules; no token or plan is ever in it), its address-space layout and its hash seed
(see docs/security.md). ``random`` re-seeds itself in a forked child; numpy's global generator is
re-seeded here.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from osfarm.desktop.box import box_init, linux_ns
from osfarm.desktop.launch import launcher

MSG_MAX = 65536
BOX_OSFARM = "/opt/osfarm"  # sandbox_layout.BOX_OSFARM (the provider's layer; this one runs below it)
LAUNCHER = ["-m", "osfarm.desktop.launch.launcher"]


# -- step 1: the template's mount namespace --------------------------------------------------


def mount_box_osfarm(binds: list[list[str]]) -> None:
    """In a new private mount namespace, ``/opt/osfarm`` as a box has it: a tmpfs with each
    ``[host path, box path]`` bound read-only. ``/opt``'s other entries stay reachable (an
    interpreter or state dir under ``/opt``): when ``/opt/osfarm`` does not exist on the host,
    ``/opt`` becomes a tmpfs with each of its entries bound back."""
    linux_ns.unshare(linux_ns.CLONE_NEWNS)
    linux_ns.mount(None, "/", None, linux_ns.MS_REC | linux_ns.MS_PRIVATE)
    # the sources, held open: the tmpfs below hides whatever of them lies under /opt/osfarm
    sources = [(os.open(host, os.O_PATH), box) for host, box in binds if box.startswith(BOX_OSFARM + "/")]
    if not os.path.isdir(BOX_OSFARM):
        opt = os.path.dirname(BOX_OSFARM)
        old = os.open(opt, os.O_PATH | os.O_DIRECTORY)
        entries = os.listdir(opt)
        linux_ns.mount("tmpfs", opt, "tmpfs", linux_ns.MS_NOSUID | linux_ns.MS_NODEV, "mode=755,size=64k")
        for name in entries:
            src, dst = f"/proc/self/fd/{old}/{name}", os.path.join(opt, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
                continue
            if os.path.isdir(src):
                os.mkdir(dst)
            else:
                open(dst, "a").close()
            linux_ns.mount(src, dst, None, linux_ns.MS_BIND | linux_ns.MS_REC)
        os.close(old)
        os.mkdir(BOX_OSFARM)
    linux_ns.mount("tmpfs", BOX_OSFARM, "tmpfs", linux_ns.MS_NOSUID | linux_ns.MS_NODEV, "mode=755,size=64k")
    for fd, box in sources:  # (a bind outside /opt/osfarm has the same path in the box and here)
        os.makedirs(box, exist_ok=True)
        linux_ns.bind(f"/proc/self/fd/{fd}", box, readonly=True, nosuid=True, nodev=True, recursive=True)
        os.close(fd)


# -- step 2: the template ----------------------------------------------------------------------


def preload() -> None:
    """Import what a box's launcher imports, the server stack included."""
    launcher.import_numpy_single_threaded()
    from osfarm.desktop.guest import guest_server  # noqa: F401


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def exit_child(work: Callable[[], int], brief: tuple[type[BaseException], ...] = ()) -> NoReturn:
    """In a forked child: run ``work`` and leave with its exit code, never returning into the
    template's loop. A ``brief`` error is one line in the box's log, any other its traceback (code 1)."""
    code = 1
    try:
        code = work()
    except brief as e:
        with contextlib.suppress(BaseException):
            print(f"osfarm-box-init: {e}", file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the box's log
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Template:
    def __init__(self, chan: socket.socket):
        self.chan = chan
        self.sel = selectors.DefaultSelector()
        self.boxes: dict[int, int] = {}  # pidfd -> pid of a box's top process
        self.pid = os.getpid()

    def send(self, msg: dict) -> None:
        with contextlib.suppress(OSError):
            self.chan.send(json.dumps(msg).encode())

    def serve(self) -> None:
        self.sel.register(self.chan, selectors.EVENT_READ)
        self.send({"ready": self.pid, "threads": threads(), "python": sys.executable,
                   "session": sys.modules["osfarm.desktop.session.session"].__file__})
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.chan:
                    if not self.request():
                        return  # the provider closed its end
                else:
                    self.reap(key.fd)

    def request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.chan, MSG_MAX, 4)
        except InterruptedError:
            return True
        if not data:
            return False
        req = None
        try:
            req = json.loads(data)
            if len(fds) != 1:
                raise ValueError(f"a request carries one fd (the box's log), got {len(fds)}")
            plan = box_init.read_plan(req["plan"])
            pid = self.fork_box(plan, fds[0], bool(req.get("net")))
            self.send({"id": req["id"], "pid": pid})
        except Exception as e:  # noqa: BLE001 - answered; the provider starts that box by exec
            self.send({"id": req.get("id") if isinstance(req, dict) else None, "error": f"{type(e).__name__}: {e}"})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def reap(self, pidfd: int) -> None:
        pid = self.boxes.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = -1
        self.send({"exit": pid, "status": status})

    def fork_box(self, plan: box_init.BoxPlan, log_fd: int, net: bool) -> int:
        n = threads()
        if n != 1:
            raise RuntimeError(f"the template has {n} threads: it forks only single-threaded")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            exit_child(lambda: self.box_top(plan, log_fd, net))
        pidfd = os.pidfd_open(pid)
        self.boxes[pidfd] = pid
        self.sel.register(pidfd, selectors.EVENT_READ)
        return pid

    # -- in the box's top process (the fork) ---------------------------------------------------

    def box_top(self, plan: box_init.BoxPlan, log_fd: int, net: bool) -> int:
        """``setpriv --pdeathsig KILL unshare --mount --pid --ipc --uts [--net] --fork
        --kill-child=SIGKILL`` in a forked process."""
        started = time.monotonic()
        linux_ns.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != self.pid:
            return 1  # the template died already
        os.setsid()
        self.sel.close()
        self.chan.close()
        for fd in self.boxes:
            os.close(fd)
        self.boxes = {}
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        flags = linux_ns.CLONE_NEWNS | linux_ns.CLONE_NEWPID | linux_ns.CLONE_NEWIPC | linux_ns.CLONE_NEWUTS
        linux_ns.unshare(flags | (linux_ns.CLONE_NEWNET if net else 0))
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            exit_child(lambda: self.box_init(plan, started, me), brief=(OSError, box_init.BoxInitError))
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)  # die of it, as unshare does
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
            os.kill(me, sig)
            return 128 + sig
        return os.waitstatus_to_exitcode(status)

    def box_init(self, plan: box_init.BoxPlan, started: float, parent: int) -> int:
        """The box's PID 1: the plan carried out as an exec start does, then the launcher."""
        linux_ns.set_parent_death_signal(signal.SIGKILL)
        env = box_init.prepare(plan, started)
        box_init.become_guest(plan)
        if plan.launcher[1:3] != LAUNCHER:
            os.execve(plan.launcher[0], plan.launcher, env)
        # What the exec of an exec start does: dropping to the guest uid made this process
        # non-dumpable (its /proc files root's), so the guest's own commands could not open its
        # fds (the agent world's namespaces: nsenter --user=/proc/1/fd/N).
        linux_ns.set_dumpable(True)
        os.environ.clear()
        os.environ.update(env)
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # random re-seeds itself after a fork; numpy does not
        sys.argv = [launcher.__file__, *plan.launcher[3:]]
        return launcher.main(plan.launcher[3:])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if os.geteuid() != 0:
        print("osfarm-box-template: must run as root", file=sys.stderr)
        return 2
    if len(args) >= 4 and args[0] == "--mounts":
        # --mounts JSON --parent PID --tag TAG -- EXEC...
        spec, parent = json.loads(args[1]), int(args[3])
        linux_ns.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:
            return 1  # the farm is gone already
        mount_box_osfarm(spec["binds"])
        rest = args[args.index("--") + 1:]
        os.chdir("/")
        os.execve(rest[0], rest, spec["env"])
    if len(args) >= 2 and args[0] == "--serve":
        chan = socket.socket(fileno=int(args[1]))
        preload()
        Template(chan).serve()
        return 0
    print("usage: python -m osfarm.desktop.launch.box_zygote --mounts JSON --parent PID --tag TAG -- CMD... | "
          "--serve FD [--tag TAG]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
