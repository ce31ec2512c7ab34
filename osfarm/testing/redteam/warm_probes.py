"""Warm-reset persistence probes (issue 15's promise against the agent of issue 13): what one
lease's agent leaves behind a warm reset for the next lease's episode to see.

Each probe is a pair of agent codes, run through the guest's code route like an agent's actions:
``dirty`` in one lease, then (the desktop released, warm reset, leased again) ``check`` in the
next, which prints ``SURVIVED ...`` or ``CLEAN ...``. A probe is held when the check is clean
after a warm reset (the reset undid it) or when the farm restarted the desktop cold instead (the
fingerprint saw it: a counted fallback); a BREACH is a warm reset after which it is still there.

Registered as ``warm`` rows of :data:`probes.PROBES` (``bench/redteam.py`` runs them as the
``sandbox-warm`` and ``docker-warm`` columns); tests/security/test_warm_probes.py runs them on a
sandbox farm with ``reset_mode: warm``.
"""

from __future__ import annotations

from typing import Any

import httpx

from osfarm.farm import metrics
from osfarm.testing.redteam.probes import PROBES, Probe, register

PRELUDE = r'''
import ctypes, os, socket, subprocess, time
def sh(cmd, root=False, bg=False):
    argv = ["sudo", "-S", "-p", "", "sh", "-c", cmd] if root else ["sh", "-c", cmd]
    if bg:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        if root:
            p.stdin.write(b"password\n"); p.stdin.flush()
        return ""
    p = subprocess.run(argv, input="password\n" if root else None, capture_output=True, text=True, timeout=30)
    return (p.stdout + p.stderr).strip()
def verdict(survived, detail=""):
    print(("SURVIVED " if survived else "CLEAN ") + str(detail)[:300])
def x11():
    x = ctypes.CDLL("libX11.so.6")
    x.XOpenDisplay.restype = ctypes.c_void_p
    return x, ctypes.c_void_p(x.XOpenDisplay(None))
'''

_XKB_ENABLED = r'''
class Desc(ctypes.Structure):
    _fields_ = [("dpy", ctypes.c_void_p), ("flags", ctypes.c_ushort), ("device_spec", ctypes.c_ushort),
                ("min", ctypes.c_ubyte), ("max", ctypes.c_ubyte), ("ctrls", ctypes.c_void_p)]
x, dpy = x11()
x.XkbAllocKeyboard.restype = ctypes.POINTER(Desc)
desc = x.XkbAllocKeyboard()
desc.contents.device_spec = 0x100
x.XkbGetControls.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(Desc)]
x.XkbGetControls(dpy, 0xF8001FFF, desc)
enabled = int.from_bytes(ctypes.string_at(desc.contents.ctrls, 16)[12:16], "little")
'''

# name, what it tries, dirty, check
WARM_PROBES: list[tuple[str, str, str, str]] = [
    ("warm_daemons", "daemons that escape the kill: setsid, double fork, SIGTERM ignored, one as the agent's root, "
     "one whose main thread exited (stat says zombie) serving on loopback",
     r'''
ZOMBIE = ("import ctypes, socket, threading, time\n"
          "def serve():\n"
          "    s = socket.socket(); s.bind(('127.0.0.1', 8082)); s.listen(); time.sleep(999)\n"
          "threading.Thread(target=serve).start(); time.sleep(0.3); ctypes.CDLL(None).pthread_exit(None)")
subprocess.Popen(["setsid", "python3", "-c", ZOMBIE])
sh("setsid -f sh -c 'exec -a warmprobe-daemon sleep 1001'", bg=True)
sh("(sh -c 'trap \"\" TERM; exec -a warmprobe-trap sleep 1002' &) ; exit 0", bg=True)
sh("setsid -f sh -c 'exec -a warmprobe-root sleep 1003'", root=True, bg=True)
time.sleep(0.5)
''', r'''
out = sh("ps -eo stat,args")
thread = socket.socket().connect_ex(("127.0.0.1", 8082)) == 0
# the probe's zombie leader is a python3; the new session's own short-lived helpers (GNOME's gvfsd)
# can be zombies for the second before the guest reaps them
leader = [ln for ln in out.splitlines() if "defunct" in ln and "python" in ln]
verdict("warmprobe" in out or "sleep 100" in out or leader or thread,
        [ln for ln in out.splitlines() if "100" in ln] + leader + ["a zombie leader's thread"] * thread)
'''),
    ("warm_listener", "a fake server on loopback (tcp 127.0.0.1:8080) and an abstract unix socket for the next episode",
     r'''
sh("python3 -c 'import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
   "s.bind((\"127.0.0.1\",8080)); s.listen(); u=socket.socket(socket.AF_UNIX); u.bind(\"\\0warmprobe\"); u.listen(); "
   "time.sleep(999)'", bg=True)
time.sleep(0.5)
''', r'''
found = []
for fam, addr in ((socket.AF_INET, ("127.0.0.1", 8080)), (socket.AF_UNIX, "\0warmprobe")):
    s = socket.socket(fam)
    try:
        s.connect(addr); found.append(addr)
    except OSError:
        pass
    finally:
        s.close()
verdict(bool(found), found)
'''),
    ("warm_mqueue", "a POSIX message queue holding a message for the next episode", r'''
rt = ctypes.CDLL("librt.so.1", use_errno=True)
fd = rt.mq_open(b"/warmprobe", os.O_CREAT | os.O_RDWR, 0o600, None)
rt.mq_send(fd, b"answer", 6, 0)
''', r'''
rt = ctypes.CDLL("librt.so.1", use_errno=True)
verdict(rt.mq_open(b"/warmprobe", os.O_RDWR, 0o600, None) >= 0)
'''),
    ("warm_sysv_ipc", "System V shared memory, a message queue and semaphores",
     'sh("ipcmk -M 4096; ipcmk -Q; ipcmk -S 2")',
     # what the probe made: a keyed segment nobody attaches, a queue, a semaphore set (a fresh GNOME
     # desktop has segments of its own: private, attached by the shell and marked for deletion)
     r'''
left = [ln for kind in ("-m", "-q", "-s") for ln in sh("ipcs " + kind).splitlines() if ln.startswith("0x")
        and (kind != "-m" or not ln.startswith("0x00000000") or ln.split()[5] == "0")]
verdict(bool(left), left)
'''),
    ("warm_files", "files in the home, /tmp, /var/tmp, /dev/shm, /run/user, the home's parent; a kept dir's "
     "timestamp as a message (touch -d)", r'''
for p in (os.path.expanduser("~/.cache/warmprobe"), "/tmp/.warmprobe", "/var/tmp/warmprobe", "/dev/shm/warmprobe",
          "/run/user/1000/warmprobe"):
    os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "w").write("x")
sh("touch /home/warmprobe; touch -d 2001-02-03 /run/user/1000", root=True)
''', r'''
left = [p for p in (os.path.expanduser("~/.cache/warmprobe"), "/tmp/.warmprobe", "/var/tmp/warmprobe",
                    "/dev/shm/warmprobe", "/run/user/1000/warmprobe", "/home/warmprobe") if os.path.lexists(p)]
old = os.stat("/run/user/1000").st_mtime < 1.1e9
verdict(bool(left) or old, left + (["/run/user/1000 dated 2001"] if old else []))
'''),
    ("warm_etc", "the agent's root edits /etc (hosts) and mounts a tmpfs", r'''
sh("echo 127.0.0.2 warmprobe >> /etc/hosts; mount -t tmpfs none /mnt", root=True)
''', 'verdict("warmprobe" in open("/etc/hosts").read() or os.path.ismount("/mnt"))'),
    ("warm_x_mappings", "swapped mouse buttons, no Control modifier, a remapped key (xmodmap)", r'''
sh("xmodmap -e 'pointer = 3 2 1' -e 'clear control' -e 'keycode 38 = q Q'")
''', r'''
out = sh("xmodmap -pp -pm -pke")
pointer = [ln.split() for ln in out.splitlines() if ln.strip().startswith("1 ")][:1]
verdict(pointer != [["1", "1"]] or "Control_L" not in out or "keycode  38 = a" not in out, pointer)
'''),
    ("warm_x_settings", "xset: screen saver after 2 s, pointer acceleration, no autorepeat, bell; xhost +; "
     "a red desktop (xsetroot)", r'''
sh("xset s 2 2 m 20 1 -r b 100 1000 100 c 100; xhost +; xsetroot -solid red")
''', r'''
from Xlib import display, X
d = display.Display()
red = d.screen().root.get_image(500, 300, 1, 1, X.ZPixmap, 0xFFFFFFFF).data[:3] == b"\x00\x00\xff"
out = sh("xset q; xhost")
verdict(red or "timeout:  2 " in out or "20/1" in out or "auto repeat:  off" in out or "control disabled" in out,
        [ln for ln in out.splitlines() if "timeout" in ln or "acceleration" in ln or "repeat:" in ln] + ["red"] * red)
'''),
    ("warm_xkb", "XKB: Caps Lock locked, SlowKeys and StickyKeys on (the next episode's typing swallowed)", r'''
sh("xdotool key Caps_Lock")
x, dpy = x11()
x.XkbChangeEnabledControls(dpy, 0x100, 0xA, 0xA)
x.XSync(dpy, 0)
''', _XKB_ENABLED + r'''
caps = "Caps Lock:   on" in sh("xset q")
verdict(bool(enabled & 0xA) or caps, "enabled=%#x caps=%s" % (enabled, caps))
'''),
    ("warm_x_retained", "X resources kept past their client (RetainPermanent): a hidden window owning a selection",
     r'''
sh("python3 -c 'from Xlib import display, X; d = display.Display(); d.set_close_down_mode(X.RetainPermanent); "
   "top = [w for w in d.screen().root.query_tree().children if w.get_attributes().map_state][0]; "
   "w = top.create_window(0, 0, 1, 1, 0, d.screen().root_depth); "
   "w.set_selection_owner(d.intern_atom(\"WARMPROBE\"), X.CurrentTime); d.sync()'")
''', r'''
out = sh("python3 -c 'from Xlib import display; d = display.Display(); "
         "print(d.get_selection_owner(d.intern_atom(\"WARMPROBE\")))'")
verdict(out.strip() not in ("0", ""), out)
'''),
    ("warm_x_windows", "the panel's and the window manager's windows: a strut, a message, the panel moved", r'''
from Xlib import display, Xatom
d = display.Display()
for w in d.screen().root.query_tree().children:
    w.change_property(d.intern_atom("WARMPROBE"), Xatom.STRING, 8, b"answer")
    w.change_property(d.intern_atom("_NET_WM_STRUT"), Xatom.CARDINAL, 32, [300, 0, 0, 0])
    if w.get_attributes().map_state:
        w.configure(x=300, y=200)
d.sync()
''', r'''
from Xlib import display
d = display.Display()
tops = d.screen().root.query_tree().children
left = [w.id for w in tops if w.get_full_property(d.intern_atom("WARMPROBE"), 0)]
left += ["moved"] if any((w.get_geometry().x, w.get_geometry().y) == (300, 200) for w in tops) else []
verdict(bool(left), left)
'''),
    ("warm_wm", "the window manager's state: 4 desktops, the 3rd shown, showing the desktop", r'''
sh("wmctrl -n 4; wmctrl -s 2; wmctrl -k on")
''', r'''
# a fresh desktop: the first workspace shown, not the desktop; one workspace (openbox) or GNOME's
# dynamic two (the one in use and an empty one)
out = sh("wmctrl -d")
lines = out.splitlines()
current = next((i for i, ln in enumerate(lines) if ln.split()[1:2] == ["*"]), None)
showing = "showing the desktop\" mode: ON" in sh("wmctrl -m")
verdict(len(lines) > 2 or current != 0 or showing, out)
'''),
    ("warm_keyring", "a kernel key in the user keyring", r'''
k = ctypes.CDLL(None)
k.syscall(248, b"user", b"warmprobe", b"answer", 6, -4)
''', r'''
k = ctypes.CDLL(None)
verdict(k.syscall(250, 7, -4, b"user", b"warmprobe", 0) > 0)
'''),
    ("warm_interpreter", "the code interpreter's globals and builtins",
     'WARMPROBE = 1\nimport builtins\nbuiltins.WARMPROBE = 1',
     'import builtins\nverdict("WARMPROBE" in globals() or hasattr(builtins, "WARMPROBE"))'),
]

for _name, _title, _dirty, _check in WARM_PROBES:
    register(Probe(_name, _title, "warm", providers=("sandbox", "docker"),
                   meta={"dirty": PRELUDE + _dirty, "check": PRELUDE + _check}))


def _fallbacks() -> float:
    return sum(metrics.REGISTRY.get_sample_value("osfarm_warm_reset_fallbacks_total", {"reason": k}) or 0.0
               for k in ("mismatch", "error", "timeout", "every_n"))


def run_warm_probes(url: str, token: str, names: list[str] | None = None) -> dict[str, str]:
    """probe name -> cell, on a farm (in this process: its fallback counter is read) of one
    desktop with ``reset_mode: warm``: ``held (undone)``, ``held (cold restart)`` or ``BREACH: ...``."""
    cells: dict[str, str] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=180) as c:

        def lease() -> str:
            r = c.post("/v1/desktops", json={"ttl_s": 300, "wait_s": 180})
            r.raise_for_status()
            return str(r.json()["id"])

        def run(lease_id: str, code: str) -> dict[str, Any]:
            r = c.post(f"/v1/desktops/{lease_id}/guest/v1/pyautogui", json={"code": code, "timeout": 60})
            r.raise_for_status()
            return dict(r.json())

        lease_id = lease()
        try:
            for p in (p for p in PROBES if p.kind == "warm" and (names is None or p.name in names)):
                run(lease_id, p.meta["dirty"])  # whether each part worked is the check's to say
                before = _fallbacks()
                c.delete(f"/v1/desktops/{lease_id}").raise_for_status()
                lease_id = lease()
                cold = _fallbacks() > before
                got = run(lease_id, p.meta["check"])
                out = (got.get("output") or "").strip()
                if not got.get("ok") or not out.startswith(("CLEAN", "SURVIVED")):
                    cells[p.name] = f"BREACH: the check did not run: {got.get('error') or out}"[:200]
                elif out.startswith("SURVIVED"):
                    cells[p.name] = f"BREACH: survived a {'cold' if cold else 'warm'} reset: {out[9:]}"[:200]
                else:
                    cells[p.name] = "held (cold restart)" if cold else "held (undone)"
        finally:
            c.delete(f"/v1/desktops/{lease_id}")
    return cells
