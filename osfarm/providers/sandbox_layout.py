"""What a sandbox box contains: its file system, its ids, and the templates it is made from.

The box's ``/`` is a read-only tmpfs holding only what a desktop needs (built by
:mod:`osfarm.desktop.box.box_init`, as root, in the box's new mount namespace):

==========================  ================================================================
box path                    what it is
==========================  ================================================================
``/usr``                    the host's, read-only, nosuid (host setuid binaries are inert)
``/bin /sbin /lib*``        the host's symlinks into ``/usr`` (or read-only binds)
``/usr/local``              the agent's local tree (template ``agent-local``): ``bin/python``
                            -> ``python3``, and ``pyautogui`` with its dependencies in
                            ``lib/python3.X/dist-packages``, for the system ``python3``
``/etc``                    read-only overlay: the box's own passwd/group/hostname/hosts/
                            machine-id over the host's ``/etc`` with everything not on
                            :data:`ETC_ALLOW` whited out (no shadow, ssh keys, tokens, service
                            configs). The agent gets its own writable layer on top
                            (:mod:`osfarm.desktop.box.agent_world`)
``/opt/osfarm``             the guest's Python (``bin/python3``: osfarm's interpreter with
                            ``lib/osfarm`` and the farm's ``site/N`` packages): code only, no
                            checkout, no task data
``/home``                   tmpfs of ``sandbox_home_size`` owned by the agent's root;
                            ``/home/user`` filled from the template home, owned by ``user``
``/tmp /var/tmp /dev/shm``  tmpfs, size-capped
``/run``                    tmpfs; ``/run/osfarm`` is the guest's run dir (token, socket,
                            state; the guest's uid, 0700), bound from the host
``/dev``                    null, zero, full, random, urandom, tty, a private devpts, shm, mqueue
``/proc``                   the box's PID namespace, ``hidepid=invisible``
``/sys``                    the host's, read-only
``/var``                    tmpfs, with the host's dpkg database and font cache read-only
==========================  ================================================================

Not in the box: the host's ``/root``, other homes, ``/work`` and every checkout, the farm's
state dir (other desktops' run dirs and tokens), task suites and caches, ``/opt`` and the
host's ``/usr/local``.

Ids: every box has a uid slot (:mod:`osfarm.providers.slots`): the guest runs as the slot's
guest uid, the agent's user namespace maps box uids 0..65535 to the slot's agent range.

Templates (``<state_dir>/templates``, built once, read-only in boxes): ``home-vN`` (the
agent's home), ``agent-local-<hash>`` (above), ``etc-mask`` (the whiteouts, rebuilt at each
provider start so new host entries stay hidden), ``osfarm-bin-<hash>`` (the guest's
interpreter wrapper).
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.util
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path

import osfarm
from osfarm.desktop.box.agent_world import AgentWorldSpec
from osfarm.desktop.box.box_init import BoxPlan, Mount
from osfarm.desktop.session import gnome
from osfarm.desktop.session.session import ASSETS, home_files
from osfarm.providers.boxes import password_hash
from osfarm.providers.slots import Slot

BOX_RUN = "/run/osfarm"
BOX_OSFARM = "/opt/osfarm"
BOX_PYTHON = f"{BOX_OSFARM}/bin/python3"
AGENT_UID = 1000
PASSWORD = "password"  # OSWorld's VM: user "user", password "password"

# /etc entries a desktop needs; the rest of the host's /etc is invisible in a box.
ETC_ALLOW = frozenset({
    "X11", "alternatives", "adduser.conf", "bash.bashrc", "bash_completion.d", "bindresvport.blacklist",
    "ca-certificates", "ca-certificates.conf", "chromium", "chromium.d", "dbus-1", "dconf", "debconf.conf",
    "debian_version", "default", "deluser.conf", "dictionaries-common", "emacs", "environment.d", "ethertypes",
    "fonts", "gai.conf", "ghostscript", "gimp", "glvnd", "gprofng.rc", "groff", "gtk-2.0", "gtk-3.0", "host.conf",
    "inputrc", "java-17-openjdk", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "libaudit.conf", "libpaper.d",
    "libreoffice", "locale.alias", "locale.conf", "locale.gen", "localtime", "login.defs", "logcheck", "magic",
    "magic.mime", "mailcap", "manpath.config", "mime.types", "mke2fs.conf", "netconfig", "networks",
    "nsswitch.conf", "openal", "os-release", "pam.conf", "pam.d", "papersize", "perl", "profile", "profile.d",
    "protocols", "pulse", "python3", "python3.11", "python3.12", "rmt", "rpc", "security", "sensors.d",
    "sensors3.conf", "services", "sgml", "shells", "skel", "ssl", "terminfo", "thunderbird", "timezone", "ucf.conf",
    "vdpau_wrapper.cfg", "vim", "vlc", "vulkan", "wgetrc", "xattr.conf", "xdg", "xml", "mtab",
})
# Inside allowed dirs, still hidden.
ETC_DENY = ("ssl/private",)
# Python distributions the agent's python3 gets (pyautogui and what it imports), by top-level
# name as installed in the farm's environment.
AGENT_MODULES = ("pyautogui", "pymsgbox", "pytweening", "pyscreeze", "pygetwindow", "pyrect", "mouseinfo",
                 "pyperclip", "Xlib", "six", "PIL")  # six: python-xlib imports it
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
AT_SPI_CONF = "/usr/share/defaults/at-spi2/accessibility.conf"
# systemd's list of NTP services: timedated asks systemd (absent in a box) about each one, and
# `timedatectl status` fails on the first ("No route to host"). A box sees an empty list.
NTP_UNITS = "/usr/lib/systemd/ntp-units.d"


class Templates:
    """The host dirs boxes are made from (see the module doc); built at provider start."""

    def __init__(self, root: Path, home_template: Path):
        self.root = root
        self.home = home_template
        self.root.mkdir(parents=True, exist_ok=True)
        self.etc_mask = self._etc_mask()
        self.guest_paths = guest_python_paths()
        self.bytecode_note = compile_guest_code()
        self.osfarm_bin = self._osfarm_bin()
        self.agent_local, self.agent_python_note = self._agent_local()
        self.password_hash = password_hash(PASSWORD)
        self.empty = self.root / "empty"
        self.empty.mkdir(mode=0o755, exist_ok=True)
        self._gnome_db: Path | None = None

    def gnome_db(self) -> Path:
        """The GNOME desktop's defaults as a dconf database (osfarm.desktop.session.gnome), compiled once
        per version of the settings file."""
        if self._gnome_db is None:
            text = b"".join(p.read_bytes() for p in sorted((gnome.GNOME / "dconf").iterdir()))
            dest = self.root / f"gnome-dconf-{hashlib.sha256(text).hexdigest()[:12]}"
            if not dest.is_file():
                gnome.compile_defaults(dest)
            self._gnome_db = dest
        return self._gnome_db

    def _etc_mask(self) -> Path:
        """A layer of overlayfs whiteouts (0:0 char devices) over every host /etc entry that is
        not allowed; made afresh, then swapped in by rename."""
        dest = self.root / "etc-mask"
        tmp = self.root / f".etc-mask.{os.getpid()}.{secrets.token_hex(3)}"
        tmp.mkdir()
        for name in os.listdir("/etc"):
            if name not in ETC_ALLOW:
                os.mknod(tmp / name, 0o600 | 0o020000, os.makedev(0, 0))
        for rel in ETC_DENY:
            if os.path.lexists(f"/etc/{rel}"):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                os.mknod(tmp / rel, 0o600 | 0o020000, os.makedev(0, 0))
        old = self.root / f".etc-mask.old.{secrets.token_hex(3)}"
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
        return dest

    def _osfarm_bin(self) -> Path:
        """``bin/python3``: the guest's interpreter with osfarm's packages on its path."""
        interpreter, paths = self.guest_paths["interpreter"], self.guest_paths["pythonpath"]
        script = (f"#!/bin/sh\n# osfarm's interpreter in a sandbox box (the guest's; not the agent's python3)\n"
                  f"PYTHONPATH={':'.join(paths)} exec {interpreter} \"$@\"\n")
        dest = self.root / f"osfarm-bin-{hashlib.sha256(script.encode()).hexdigest()[:12]}"
        if not dest.is_dir():
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            (tmp / "python3").write_text(script)
            (tmp / "python3").chmod(0o755)
            (tmp / "python").symlink_to("python3")
            _publish(tmp, dest)
        return dest

    def _agent_local(self) -> tuple[Path, str]:
        """``/usr/local`` of the agent: ``python`` and pyautogui for the system python3, copied
        from this interpreter's packages when its version is the system one's."""
        system = _system_python_version()
        mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
        found = {m: _module_dirs(m) for m in AGENT_MODULES} if system == mine else {}
        key = hashlib.sha256(repr((system, sorted((m, [str(p) for p in ps]) for m, ps in found.items()))).encode())
        dest = self.root / f"agent-local-{key.hexdigest()[:12]}"
        note = "" if system == mine else (f"the agent's python3 ({system}) lacks pyautogui: the farm runs "
                                          f"{mine}, whose packages cannot be shared with it")
        if not dest.is_dir():
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "bin").mkdir(parents=True)
            (tmp / "sbin").mkdir()
            (tmp / "share").mkdir()
            (tmp / "bin" / "python").symlink_to("/usr/bin/python3")
            if system:
                _copy_modules(found, tmp / "lib" / system / "dist-packages")
            _publish(tmp, dest)
        return dest, note

    def guest_etc(self, dest: Path, slot: Slot, hostname: str, gnome_timezone: str | None = None) -> Path:
        """The box's own /etc files for the guest's view (top of the /etc overlay); with
        ``gnome_timezone``, a GNOME desktop's too (dconf defaults, the time zone)."""
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(mode=0o755)
        users = [ln for ln in _etc_lines("passwd") if _system_line(ln)]
        groups = [ln for ln in _etc_lines("group") if _system_line(ln)]
        users += [f"osfarm-guest:x:{slot.guest_uid}:{slot.guest_uid}:osfarm guest:{BOX_RUN}:/usr/sbin/nologin",
                  f"user:x:{slot.agent_id(AGENT_UID)}:{slot.agent_id(AGENT_UID)}:user:/home/user:/bin/bash"]
        groups += [f"osfarm-guest:x:{slot.guest_uid}:", f"user:x:{slot.agent_id(AGENT_UID)}:"]
        files = {
            "passwd": "\n".join(users) + "\n",
            "group": "\n".join(groups) + "\n",
            "hostname": hostname + "\n",
            "hosts": f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
            "machine-id": secrets.token_hex(16) + "\n",
        }
        for name, text in files.items():
            (dest / name).write_text(text)
            (dest / name).chmod(0o644)
        if gnome_timezone is not None:
            for rel, content in gnome.etc_files(self.gnome_db(), gnome_timezone).items():
                path = dest / rel
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                if isinstance(content, str) and content.startswith("->"):
                    path.symlink_to(content[2:])
                    continue
                if isinstance(content, str):
                    path.write_text(content)
                else:
                    path.write_bytes(content)
                path.chmod(0o644)
        return dest


def install_agent_modules(local: Path = Path("/usr/local")) -> Path:
    """Copy pyautogui and what it imports from this interpreter's packages into ``local``'s
    ``lib/python3.X/dist-packages`` for the system ``python3``, and link ``bin/python`` to it:
    the agent's Python in the Docker image, as in sandbox boxes (OSWorld's VM has a system
    ``python3`` with pyautogui, nothing of osfarm's). Fails when the versions differ."""
    system = _system_python_version()
    mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if system != mine:
        raise RuntimeError(f"the system python3 is {system or 'missing'}, this interpreter {mine}: "
                           "their packages cannot be shared")
    site = local / "lib" / system / "dist-packages"
    found = {m: _module_dirs(m) for m in AGENT_MODULES}
    missing = sorted(m for m, paths in found.items() if not paths)
    if missing:
        raise RuntimeError(f"modules the agent's python3 needs are not installed here: {missing}")
    _copy_modules(found, site)
    (local / "bin").mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        link = local / "bin" / name
        if link.is_symlink() or link.exists():
            link.unlink()
    (local / "bin" / "python").symlink_to("/usr/bin/python3")
    return site


def _copy_modules(found: dict[str, list[Path]], site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    for paths in found.values():
        for p in paths:
            copy = shutil.copytree if p.is_dir() else shutil.copy2
            copy(p, site / p.name)


def compile_guest_code() -> str:
    """Write the bytecode of osfarm's modules next to them (``__pycache__``), as ``pip install``
    does for the farm's other packages. A box binds osfarm's package dir read-only and the guest
    cannot write there anyway, so without it every box's Python compiles every module it imports
    (~50 ms of each cold start's CPU for the launcher and the guest server alone). Up-to-date
    files are only checked; a module edited later is compiled in memory again, as before.
    Returns why it could not be done ("" when done)."""
    pkg = Path(osfarm.__file__).resolve().parent
    if not os.access(pkg, os.W_OK):
        return f"{pkg} is not writable: boxes compile osfarm's modules at every start"
    try:
        ok = compileall.compile_dir(pkg, quiet=2, workers=1)
    except OSError as e:
        return f"compiling {pkg}: {e}"
    return "" if ok else f"some of {pkg}'s modules did not compile"


def guest_python_paths() -> dict:
    """Where this interpreter and osfarm live on the host, and their box paths: osfarm's package
    dir alone (never the checkout around it) and the environment's site dirs."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    pkg = Path(osfarm.__file__).resolve().parent
    binds: list[tuple[str, str]] = [(str(pkg), f"{BOX_OSFARM}/lib/osfarm")]
    pythonpath = [f"{BOX_OSFARM}/lib"]
    stdlib = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
    for i, p in enumerate(sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})):
        if not p.endswith(("site-packages", "dist-packages")) or p.startswith("/usr/lib/python3"):
            continue  # the stdlib, the system's dist-packages (visible through /usr), the checkout
        if any(p == s for s in stdlib):
            continue
        binds.append((p, f"{BOX_OSFARM}/site/{i}"))
        pythonpath.append(f"{BOX_OSFARM}/site/{i}")
    base = os.path.realpath(sys.base_prefix)
    if not base.startswith("/usr"):
        binds.append((base, base))  # an interpreter outside /usr (pyenv, conda): same path in the box
    return {"interpreter": interpreter, "binds": binds, "pythonpath": pythonpath}


def box_plan(
    *,
    ddir: Path,
    slot: Slot,
    templates: Templates,
    guest_etc: Path,
    hostname: str,
    desktop: str,
    launcher_args: list[str],
    env: dict[str, str],
    cgroup_procs: list[str],
    home_size: str,
    tmp_size: str,
    shm_size: str,
) -> BoxPlan:
    """The plan :mod:`osfarm.desktop.box.box_init` carries out for one sandbox box."""
    agent_root, user_id = slot.agent_id(0), slot.agent_id(AGENT_UID)
    m: list[Mount] = []
    for name in TOP_LINKS:
        host = f"/{name}"
        if os.path.islink(host):
            m.append(Mount("symlink", host, source=os.readlink(host)))
        elif os.path.isdir(host):
            m.append(Mount("bind", host, source=host))
    m += [
        Mount("bind", "/usr", source="/usr"),
        Mount("bind", "/usr/local", source=str(templates.agent_local)),
        Mount("overlay", "/etc", options=f"lowerdir={guest_etc}:{templates.etc_mask}:/etc"),
        Mount("bind", "/sys", source="/sys", exec=False),
        Mount("dir", "/root", mode=0o700),
        Mount("dir", "/mnt"), Mount("dir", "/media"), Mount("dir", "/srv"), Mount("dir", "/opt"),
    ]  # fmt: skip
    if os.path.isfile(AT_SPI_CONF):
        m.append(Mount("bind", AT_SPI_CONF, source=str(ASSETS / "dbus" / "accessibility.conf")))
    if os.path.isdir(NTP_UNITS):
        m.append(Mount("bind", NTP_UNITS, source=str(templates.empty)))
    # The guest's interpreter and code.
    m.append(Mount("dir", BOX_OSFARM))
    for host, box in templates.guest_paths["binds"]:
        m.append(Mount("bind", box, source=host))
    m.append(Mount("bind", f"{BOX_OSFARM}/bin", source=str(templates.osfarm_bin)))
    # /dev
    m.append(Mount("tmpfs", "/dev", options="mode=755,size=64k", readonly=False, exec=False))
    for dev in DEVICES:
        m.append(Mount("bind", f"/dev/{dev}", source=f"/dev/{dev}", readonly=False, dev=True, exec=False))
    m += [
        Mount("devpts", "/dev/pts", options="newinstance,ptmxmode=0666,mode=620", readonly=False, dev=True,
              exec=False),
        Mount("symlink", "/dev/ptmx", source="pts/ptmx"),
        Mount("tmpfs", "/dev/shm", options=f"mode=1777,size={shm_size}", readonly=False),
        # the box's POSIX message queues (its own IPC namespace): listed here, so a warm reset sees and removes them
        Mount("mqueue", "/dev/mqueue", readonly=False, exec=False),
        Mount("symlink", "/dev/fd", source="/proc/self/fd"),
        Mount("symlink", "/dev/stdin", source="/proc/self/fd/0"),
        Mount("symlink", "/dev/stdout", source="/proc/self/fd/1"),
        Mount("symlink", "/dev/stderr", source="/proc/self/fd/2"),
        Mount("dir", "/proc", mode=0o555),
        # writable, size-capped
        Mount("tmpfs", "/tmp", options=f"mode=1777,size={tmp_size}", readonly=False),
        Mount("tmpfs", "/home", options=f"mode=755,size={home_size},uid={agent_root},gid={agent_root}",
              readonly=False),
        Mount("dir", "/home/user", mode=0o755, uid=user_id, gid=user_id),
        Mount("tmpfs", "/run", options="mode=755,size=16m", readonly=False),
        Mount("bind", BOX_RUN, source=str(ddir / "run"), readonly=False, exec=False),
        Mount("dir", "/run/osfarm-agent"),
        Mount("dir", "/run/lock", mode=0o1777),
        Mount("tmpfs", "/var", options="mode=755,size=16m", readonly=False),
        Mount("tmpfs", "/var/tmp", options=f"mode=1777,size={tmp_size}", readonly=False),
        Mount("dir", "/var/lib/dbus"), Mount("dir", "/var/cache"), Mount("dir", "/var/log"),
        Mount("symlink", "/var/lib/dbus/machine-id", source="/etc/machine-id"),
        Mount("symlink", "/var/run", source="/run"),
        Mount("symlink", "/var/lock", source="/run/lock"),
    ]  # fmt: skip
    for ro in ("/var/lib/dpkg", "/var/cache/fontconfig"):
        if os.path.isdir(ro):
            m.append(Mount("bind", ro, source=ro))
    agent = AgentWorldSpec(guest_uid=slot.guest_uid, guest_gid=slot.guest_uid, outside_base=agent_root,
                           password_hash=templates.password_hash, user_uid=AGENT_UID, user_gid=AGENT_UID,
                           home="/home/user", hostname=hostname)
    return BoxPlan(
        launcher=[BOX_PYTHON, "-m", "osfarm.desktop.launch.launcher", *launcher_args],
        env=env,
        guest_uid=slot.guest_uid,
        guest_gid=slot.guest_uid,
        run_dir=BOX_RUN,
        home="/home/user",
        home_uid=user_id,
        home_gid=user_id,
        home_template=str(templates.home),
        home_files=home_files(desktop),
        agent=agent,
        new_root=str(ddir / "root"),
        mounts=m,
        proc_options="hidepid=invisible",
        hostname=hostname,
        cgroup_procs=cgroup_procs,
        cwd="/home/user",
        death_signal=int(signal.SIGKILL),
    )


def _publish(tmp: Path, dest: Path) -> None:
    """Make a built template appear at ``dest`` at once (a concurrent builder may win)."""
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _system_python_version() -> str:
    """'python3.11' for the system python3 (the agent's), '' when there is none."""
    try:
        target = os.path.basename(os.path.realpath("/usr/bin/python3"))
    except OSError:
        return ""
    return target if target.startswith("python3.") else ""


def _module_dirs(name: str) -> list[Path]:
    """A top-level module's dir (or file) in this environment, with its dist-info and bundled
    libraries (Pillow's ``pillow.libs``)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return []
    if spec.submodule_search_locations:
        paths = [Path(p) for p in spec.submodule_search_locations][:1]
    elif spec.origin:
        paths = [Path(spec.origin)]
    else:
        return []
    site = paths[0].parent
    for extra in site.glob(f"{name.lower()}*.libs"):
        paths.append(extra)
    if name == "PIL":
        paths += list(site.glob("pillow*.libs")) + list(site.glob("[Pp]illow-*.dist-info"))
    else:
        paths += [p for p in site.glob("*.dist-info") if p.name.lower().replace("-", "_").startswith(
            name.lower() + "-") or (name == "Xlib" and p.name.lower().startswith("python_xlib-"))]
    return sorted(set(paths))


def _etc_lines(name: str) -> list[str]:
    try:
        return [ln for ln in Path("/etc", name).read_text().splitlines() if ln and not ln.startswith("#")]
    except OSError:
        return []


def _system_line(line: str) -> bool:
    parts = line.split(":")
    return len(parts) >= 4 and parts[2].isdigit() and (int(parts[2]) < 1000 or int(parts[2]) == 65534)
