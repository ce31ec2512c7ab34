"""The desktop's fingerprint (guest route ``/v1/session/fingerprint``; a warm reset's answer).

A **fingerprint** says what state a desktop is in, in the terms a task or an agent could notice:
the processes by command line (guest's and agent's), the writable trees (``/home/user``,
``/tmp``, ``/var/tmp``, ``/dev/shm``, the POSIX message queues in ``/dev/mqueue``, the agent's
``/run``; names, types, modes, owners, sizes, content hashes) and what else is in ``/home``, the
agent's ``/etc`` and mount table, the X server's state (screen size, root window properties,
selection owners, pressed keys and buttons, pointer, keyboard mapping, top-level windows, the
active one, the settings ``xmodmap``/``xset``/``xhost`` change, clients whose resources outlived
them) and the guest's own scratch dir.
Random names (temp dirs, window ids, bus addresses) are normalised, so two cold starts give the
same fingerprint; ``digest`` is its hash. :mod:`osfarm.desktop.warm.fingerprint_diff` says where two differ.

The file scans come from the agent-side helper (:mod:`osfarm.desktop.warm.agent_root_helper`); what
that helper runs on (the agent's mount table and loader files) is read by the guest from the
kernel, so a helper the agent tampered with shows here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import TYPE_CHECKING, Any

from Xlib import X, Xatom

from osfarm.desktop.session.gnome import ON_DEMAND_PROCESSES, ON_DEMAND_WINDOW_CLASSES
from osfarm.desktop.warm.agent_root_helper import run_helper
from osfarm.desktop.warm.box_processes import is_agent, proc_table
from osfarm.desktop.x11 import xsettings
from osfarm.desktop.x11.x_read import WM_MANAGED, atom_name, raw_properties, x_connection, x_controls, x_orphans
from osfarm.desktop.x11.xkb import Xkb

if TYPE_CHECKING:
    from osfarm.desktop.session.guest_state import Desktop

SELECTIONS = ("PRIMARY", "SECONDARY", "CLIPBOARD", "WM_S0", "_NET_SYSTEM_TRAY_S0")
_RANDOM = [
    (re.compile(r"osfarm-(a11y|guest|run|code)-[A-Za-z0-9_]+"), r"osfarm-\1-*"),
    (re.compile(r"dbus-[A-Za-z0-9]{6,}"), "dbus-*"),
    (re.compile(r"guid=[0-9a-f]+"), "guid=*"),
    (re.compile(r"/proc/\d+/fd/\d+"), "/proc/*/fd/*"),
    (re.compile(r"bus_\d+"), "bus_*"),
    (re.compile(r"--print-address[= ]\d+"), "--print-address=*"),  # a pipe's fd number
]


def normalise(text: str) -> str:
    for pattern, repl in _RANDOM:
        text = pattern.sub(repl, text)
    return text


# The guest interpreter's scratch dir in /tmp: made anew with each interpreter (a warm reset
# restarts it in the background); what the agent writes into it is still counted.
_SCRATCH = re.compile(r"osfarm-code-\*$")


def _files(scan: dict[str, list[list[Any]]]) -> dict[str, list[list[Any]]]:
    out = {}
    for k, v in scan.items():
        rows = [[normalise(x) if isinstance(x, str) else x for x in e] for e in v]
        rows = [e for e in rows if not (_SCRATCH.match(e[0]) or e[0].startswith("osfarm-code-*/"))]
        out[k] = sorted(rows, key=json.dumps) if k != "homes" else rows
    return out


def _agent_world_view() -> dict[str, Any]:
    """What the helper runs on, seen by the guest from the kernel rather than reported by the
    helper: the agent's mount table (a bind mount over python3 or /usr would show here) and the
    dynamic loader's files in the agent's /etc (ld.so.preload, ld.so.cache could inject code into
    anything run there). An agent that forged the helper's report changes one of these, and the
    fingerprint differs from the cold start's."""
    guest_uid = os.getuid()
    agents = sorted(pid for pid, (uid, _, _) in proc_table().items() if is_agent(uid, guest_uid))
    for pid in agents:
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                rows = []
                for line in f:
                    left, _, right = line.partition(" - ")
                    a, b = left.split(), right.split()
                    rows.append(" ".join([a[4], a[5], b[0], normalise(b[2]) if len(b) > 2 else ""]))
            root = f"/proc/{pid}/root/etc"
            loader: dict[str, str | None] = {}  # None: the file does not exist
            for name in ("ld.so.preload", "ld.so.cache"):
                try:
                    fd = os.open(f"{root}/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except FileNotFoundError:
                    loader[name] = None
                    continue
                except OSError as e:
                    loader[name] = f"unreadable:{e.errno}"
                    continue
                with os.fdopen(fd, "rb") as fh:
                    loader[name] = hashlib.sha256(fh.read(64 << 20)).hexdigest()[:24]
            return {"mounts": sorted(rows), "loader": loader}
        except OSError:
            continue  # it went away: the next one
    return {"mounts": None, "loader": None}


def _sysv_ipc() -> dict[str, list[str]]:
    """The box's System V shared memory, semaphores and message queues (they outlive the process
    that made them): perms and size/count and owner, per object."""
    out: dict[str, list[str]] = {}
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        head = lines[0].split() if lines else []
        keep = [i for i, h in enumerate(head) if h in ("perms", "size", "nsems", "cbytes", "qnum", "uid")]
        out[kind] = sorted(" ".join(ln.split()[i] for i in keep) for ln in lines[1:] if ln.strip())
    return out


def processes(desk: Desktop) -> list[str]:
    me, guest_uid, runner = os.getpid(), os.getuid(), desk.runner_pid()
    rows = []
    for pid, (uid, cmd, _) in proc_table().items():
        if pid in (me, runner) or not cmd or "/osfarm_kernel.py" in cmd:  # the interpreter: restarted apart
            continue
        who = "guest" if uid == guest_uid else "agent" if is_agent(uid, guest_uid) else "box"
        if who == "agent" and cmd in ON_DEMAND_PROCESSES:
            continue
        rows.append(f"{who} {normalise(cmd)}")
    return sorted(rows)



def x_state(display: str, conn: Any = None) -> dict[str, Any]:
    with x_connection(display, conn) as d:
        root = d.screen().root
        s = d.screen()
        props: dict[str, Any] = {}
        for atom in root.list_properties():
            name = atom_name(d, atom)
            p = root.get_full_property(atom, X.AnyPropertyType)
            if p is None:
                continue
            tname = atom_name(d, p.property_type) if p.property_type else ""
            value: Any
            if name in WM_MANAGED or p.property_type in (Xatom.WINDOW, Xatom.PIXMAP):
                value = sum(1 for v in p.value if v)
                if name in WM_MANAGED and not value:
                    continue  # no active window, an empty list, or none at all: the same to a task
                if name == "_NET_ACTIVE_WINDOW":
                    try:
                        w = d.create_resource_object("window", p.value[0])
                        g = w.get_geometry()
                        value = [list(w.get_wm_class() or []), normalise(str(w.get_wm_name() or "")), g.width, g.height]
                    except Exception:  # noqa: BLE001 - a window that is gone: no active window
                        continue
            elif p.format == 8:
                raw = p.value if isinstance(p.value, bytes) else str(p.value).encode()
                value = normalise(raw.decode(errors="replace"))
            elif p.property_type == Xatom.ATOM:
                value = sorted(atom_name(d, v) for v in p.value)
            else:
                value = list(p.value)
            props[name] = [tname, p.format, value]
        selections = {}
        for sel in SELECTIONS:
            selections[sel] = bool(d.get_selection_owner(d.intern_atom(sel)))
        ptr = root.query_pointer()
        keymap = d.query_keymap()
        pressed = [i * 8 + b for i, byte in enumerate(keymap) for b in range(8) if byte & (1 << b)]
        first, last = d.display.info.min_keycode, d.display.info.max_keycode
        keysyms = [list(k) for k in d.get_keyboard_mapping(first, last - first + 1)]
        mapping = hashlib.sha256(json.dumps(keysyms).encode()).hexdigest()[:24]
        windows = []
        for w in root.query_tree().children:
            try:
                attrs = w.get_attributes()
                geo = w.get_geometry()
                cls = w.get_wm_class()
                if cls and cls[0] in ON_DEMAND_WINDOW_CLASSES:
                    continue
                windows.append([attrs.map_state, list(cls) if cls else [], geo.width, geo.height,
                                _props_digest(d, w), geo.x, geo.y])
            except Exception:  # noqa: BLE001 - a window that went away meanwhile
                continue
        return {
            "controls": x_controls(d),
            "xkb": Xkb.read(display),
            "orphan_clients": len(x_orphans(d)),
            # what a screenshot sees of the desktop's background (xsetroot sets no property)
            "background": root.get_image(s.width_in_pixels // 2, s.height_in_pixels // 3, 1, 1, X.ZPixmap,
                                         0xFFFFFFFF).data.hex(),
            "screen": [s.width_in_pixels, s.height_in_pixels],
            "root_properties": props,
            "selections": selections,
            "pointer": [ptr.root_x, ptr.root_y, ptr.mask],
            "pressed_keys": pressed,
            "keyboard_mapping": mapping,
            "windows": sorted(windows, key=json.dumps),
        }


def wait_wm(display: str, want: dict[str, Any], timeout: float = 3.0, conn: Any = None) -> dict[str, Any]:
    """The X state once the window manager has caught up with the windows that went away (its
    client list and active window are updated asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        state = x_state(display, conn)
        props = state["root_properties"]
        same = all(props.get(k) == want["root_properties"].get(k) for k in WM_MANAGED) if want else True
        if same or time.monotonic() > deadline:
            return state
        time.sleep(0.005)


# A process id differs each time the same program starts (GNOME's shell and settings daemons are
# started anew by every warm reset; the light desktop's window manager and panel are not).
PER_START_NUMBERS = frozenset({"_NET_WM_PID"})
# The X server gives each client its ids from a base (the bits above this mask) set by the order
# in which clients connected: the same program's ids differ from one start to the next.
_CLIENT_ID_MASK = 0x1FFFFF


def _props_digest(d: Any, w: Any) -> str:
    """A short hash of a window's properties (window and pixmap ids counted, atoms by name, ids
    of the window's own client's resources as "own", a process id as present, XSETTINGS as what
    they say)."""
    rows = []
    base = w.id & ~_CLIENT_ID_MASK
    for name, (ptype, fmt, value) in sorted(raw_properties(d, w).items()):
        if ptype in (Xatom.WINDOW, Xatom.PIXMAP) or name in PER_START_NUMBERS:
            value = sum(1 for v in value if v)
        elif ptype == Xatom.ATOM:  # atom numbers depend on the order clients interned them
            value = sorted(atom_name(d, v) for v in value)
        elif name == "_XSETTINGS_SETTINGS" and isinstance(value, bytes):
            try:
                value = [[k, "per-start" if k in xsettings.PER_START else v] for k, v in xsettings.settings(value)]
            except xsettings.XSettingsError:
                value = value.hex()
        elif isinstance(value, bytes):
            value = value.hex()
        elif not isinstance(value, str):
            value = ["own" if fmt == 32 and v and v & ~_CLIENT_ID_MASK == base else v for v in value]
        rows.append([name, atom_name(d, ptype) if ptype else "", fmt, value])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def fingerprint(desk: Desktop, scan: dict[str, Any] | None = None, x: dict[str, Any] | None = None) -> dict[str, Any]:
    """The desktop's state (see the module doc) with its ``digest`` (``scan``, ``x``: the helper's
    scan and the X state, where the caller has just taken them)."""
    if scan is None:
        scan = json.loads(run_helper(desk, "scan", desk.home))
    exchange = sorted(os.listdir(desk.exchange_dir)) if desk.exchange_dir else []
    fp: dict[str, Any] = {
        "processes": processes(desk),
        "files": _files(scan),
        "x": x if x is not None else x_state(desk.display),
        "guest": {"exchange": exchange, "wallpaper": desk.wallpaper is not None},
        "ipc": _sysv_ipc(),
        "agent_world": _agent_world_view(),
    }
    fp["digest"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
    return fp
