"""Red team of the ``settle`` timing's zygote (issue 26): agent code runs in a child forked from a
pre-imported interpreter that lives on between actions, as the agent's user. That must not give the
code what OSWorld's fresh ``python -c`` per action does not: state kept for the next action (through
the child's own globals or through the zygote it was forked from: its memory, a trace, its fds),
a life past its action (a timeout kills it even where it cleared the signal its zygote's death
sends), or the guest server's privileges (its token, its process, the pipes between guest and
zygote). Each probe prints what it could do; the test fails naming any breach. On a desktop of the
session's shared farm (the light one: what is probed is the box, not the session)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from osfarm.client import Farm, RemoteDesktop
from osfarm.farm.server import FarmServer

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(300)]

# In a child: leave state everywhere a next action could find it, and try to reach the zygote.
DIRTY = r"""
import builtins, ctypes, json, os, sys
KEPT = 1
builtins.SETTLEPROBE = 1
pyautogui.SETTLEPROBE = 1
sys.modules["settleprobe"] = sys
os.environ["SETTLEPROBE"] = "1"
os.chdir("/tmp")
zygote = os.getppid()
reached = {}
for what, reach in (("mem", lambda: open("/proc/%d/mem" % zygote, "r+b").close()),
                    ("fds", lambda: os.listdir("/proc/%d/fd" % zygote)),
                    ("environ", lambda: open("/proc/%d/environ" % zygote, "rb").read())):
    try:
        reach()
        reached[what] = "reached"
    except OSError as e:
        reached[what] = e.strerror
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, zygote, 0, 0) == 0:  # PTRACE_ATTACH
    reached["ptrace"] = "reached"
    os.waitpid(zygote, 0x40000000)  # __WALL: the tracee's stop, then let it go on
    libc.ptrace(17, zygote, 0, 0)  # PTRACE_DETACH
else:
    reached["ptrace"] = os.strerror(ctypes.get_errno())
print(json.dumps(reached))
"""

CHECK = r"""
import builtins, json, os, sys
print(json.dumps({"globals": "KEPT" in globals(), "builtins": hasattr(builtins, "SETTLEPROBE"),
                  "pyautogui": hasattr(pyautogui, "SETTLEPROBE"), "modules": "settleprobe" in sys.modules,
                  "environ": "SETTLEPROBE" in os.environ, "cwd": os.getcwd() == "/tmp"}))
"""

# A child that clears the signal its zygote's death sends it, then outlives its action's timeout.
OUTLIVE = r"""
import ctypes, os
ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG: none
open("/tmp/settleprobe.pid", "w").write(str(os.getpid()))
time.sleep(120)
"""

ALIVE = r"""
import os
pid = int(open("/tmp/settleprobe.pid").read())
for _ in range(50):  # its death may take a moment on a loaded machine
    try:
        state = open("/proc/%d/stat" % pid).read().rpartition(")")[2].split()[0]
    except OSError:
        state = "gone"
    if state in ("gone", "Z", "X"):
        break
    time.sleep(0.1)
print(state)
"""

# The guest server (GUEST_PID: its pid, from its /v1/health, in the box's pid namespace).
GUEST = r"""
import json, os
guest = GUEST_PID
reached = {}
for what, reach in (("signal", lambda: os.kill(guest, 0)),
                    ("environ", lambda: open("/proc/%d/environ" % guest, "rb").read()),
                    ("fds", lambda: os.listdir("/proc/%d/fd" % guest)),
                    ("token", lambda: open("/run/osfarm/token").read())):
    try:
        reach()
        reached[what] = "reached"
    except OSError as e:
        reached[what] = e.strerror
print(json.dumps(reached))
"""


def _out(desk: RemoteDesktop, code: str, timeout: float = 30.0) -> str:
    sr = desk.step([code], timing="settle", code_timeout=timeout)
    assert sr.results[0].ok, sr.results[0]
    return (sr.results[0].output or "").strip()


def test_settle_code_keeps_no_state_and_cannot_reach_its_zygote(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f, f.lease(wait_s=120) as desk:
        reached = json.loads(_out(desk, DIRTY))
        assert not [w for w, v in reached.items() if v == "reached"], f"the code reached its zygote: {reached}"
        kept = json.loads(_out(desk, CHECK))
        assert not any(kept.values()), f"state kept for the next action: {kept}"


def test_settle_code_cannot_outlive_its_action(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f, f.lease(wait_s=120) as desk:
        sr = desk.step([OUTLIVE], timing="settle", code_timeout=3)
        assert not sr.results[0].ok and "timed out" in (sr.results[0].error or ""), sr.results[0]
        assert _out(desk, ALIVE) in ("gone", "Z", "X"), "the timed-out action's child runs on"


def test_settle_code_cannot_reach_the_guest(farm: FarmServer) -> None:
    with Farm(farm.url, farm.token) as f, f.lease(wait_s=120) as desk:
        guest = desk.guest("GET", "/v1/health").json()["pid"]
        reached = json.loads(_out(desk, GUEST.replace("GUEST_PID", str(int(guest)))))
        assert not [w for w, v in reached.items() if v == "reached"], f"the code reached the guest: {reached}"
        assert reached["signal"] == os.strerror(errno.EPERM), reached  # the guest's pid was there, not signalled
