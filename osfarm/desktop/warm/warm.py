"""Warm reset, guest side (routes ``/v1/session/baseline`` and ``/v1/session/warm_reset``).

A **warm reset** gives a used desktop back the state it had once its cold start was ready, without
restarting Xvfb, the window manager, the panel or the guest: :func:`take_baseline` (right after
the cold start, once its panel and accessibility registry run) records what to go back to;
:func:`warm_reset` kills *every* process of the agent (:mod:`osfarm.desktop.warm.kill_rounds`: SIGKILL,
in rounds, until none is left; the agent's D-Bus and AT-SPI buses too, since a task could have
tampered with them), puts the home back from the baseline's copy and removes what was added to
the other writable trees (:mod:`osfarm.desktop.warm.agent_root_helper`: as the agent's root, in the
agent's namespaces), puts the X state back (:mod:`osfarm.desktop.warm.x_reset`), starts the agent's
buses again and returns the new fingerprint's digest (:mod:`osfarm.desktop.warm.fingerprint`; the
whole fingerprint where it differs from the baseline's); the route then re-arms the guest with a
new token and, once it has answered, starts the guest's interpreter again. The farm compares the
digest to the baseline's and restarts the box cold where they differ.

What a warm reset cannot undo is refused (:class:`WarmResetError`, the farm then restarts cold):
a changed screen size, a wallpaper set, an agent process that survives the kill rounds; what it
does not undo shows in the fingerprint (the agent's own mounts, its /etc layer) and makes the
farm restart cold.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from Xlib import display as xdisplay
from Xlib.error import XError

from osfarm.desktop.warm.agent_root_helper import WRITABLE, HelperSession, run_helper
from osfarm.desktop.warm.fingerprint import fingerprint, processes, wait_wm
from osfarm.desktop.warm.kill_rounds import kill_agent_processes, reap_agent_zombies
from osfarm.desktop.warm.warm_reset_error import WarmResetError
from osfarm.desktop.warm.x_reset import x_reset
from osfarm.desktop.x11.x_read import WM_MANAGED, forget_atom_names, geometry, raw_properties, x_controls
from osfarm.desktop.x11.xkb import Xkb

if TYPE_CHECKING:
    from osfarm.desktop.session.guest_state import Desktop


@dataclass
class Baseline:
    home_archive: bytes  # the helper's snapshot of the home
    keep: dict[str, list[str]]  # writable tree -> the relative paths it held
    root_properties: dict[str, tuple[int, int, Any]]
    windows: set[int]
    pointer: tuple[int, int]
    screen: tuple[int, int]
    exchange: set[str]
    controls: dict[str, Any] = field(default_factory=dict)  # x_read.x_controls at the baseline
    xkb: dict[str, Any] = field(default_factory=dict)  # Xkb.read at the baseline
    window_properties: dict[int, dict[str, tuple[int, int, Any]]] = field(default_factory=dict)  # top-level
    window_geometry: dict[int, tuple[int, int, int, int, int, bool]] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)  # the WM-managed root properties set at the baseline
    fingerprint: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()


def current_fingerprint(desk: Desktop) -> dict[str, Any]:
    """The desktop's fingerprint now; waits for a baseline or a warm reset in progress, so it never
    shows one half done."""
    with _lock:
        return fingerprint(desk)


def take_baseline(desk: Desktop) -> dict[str, Any]:
    """Record the state a warm reset goes back to (call once the cold start is ready, before any
    agent action); returns its fingerprint."""
    if desk.agent is None:
        raise WarmResetError("warm resets need a box (the agent's own namespaces)")
    with contextlib.suppress(ImportError):  # what a warm reset's bus restart uses: loaded now, not then
        from gi.repository import Gio, GLib  # noqa: F401
    # The interpreter's start-up runs agent processes of its own (pyautogui's import asks `which
    # scrot`): over before the baseline, or a loaded machine records one and every reset differs.
    desk.prestarted_runner.start()
    with _lock:
        forget_atom_names()
        _wait_settled(desk)
        home_archive = run_helper(desk, "snapshot", desk.home)
        scan = json.loads(run_helper(desk, "scan", desk.home))
        keep = {t: [e[0] for e in scan.get(t, [])] for t in WRITABLE}
        d = xdisplay.Display(desk.display)
        try:
            root = d.screen().root
            props = raw_properties(d)
            window_properties, window_geometry = {}, {}
            for child in root.query_tree().children:
                try:
                    window_properties[child.id] = raw_properties(d, child)
                    window_geometry[child.id] = geometry(child)
                except XError:  # gone since the listing (a session service's short-lived window)
                    window_properties.pop(child.id, None)
            windows = set(window_geometry)
            ptr = root.query_pointer()
            s = d.screen()
            screen = (s.width_in_pixels, s.height_in_pixels)
            controls = x_controls(d)
        finally:
            d.close()
        base = Baseline(
            home_archive=home_archive, keep=keep, root_properties=props, windows=windows,
            window_properties=window_properties, window_geometry=window_geometry,
            pointer=(ptr.root_x, ptr.root_y), screen=screen, controls=controls, xkb=Xkb.read(desk.display),
            active={k for k in WM_MANAGED if k in props and any(props[k][2])},
            exchange=set(os.listdir(desk.exchange_dir)) if desk.exchange_dir else set(),
        )
        base.fingerprint = fingerprint(desk, scan)
        desk.warm_baseline = base
        return base.fingerprint


def _wait_settled(desk: Desktop, timeout: float = 15.0) -> None:
    """Wait until the session's start is over: the AT-SPI registry runs (where there is an AT-SPI
    bus) and the processes and windows stay the same for a moment."""
    def look() -> tuple[list[str], list[tuple[int, int, int]]]:
        d = xdisplay.Display(desk.display)
        try:
            wins = []
            for w in d.screen().root.query_tree().children:
                with contextlib.suppress(Exception):
                    g = w.get_geometry()
                    wins.append((w.get_attributes().map_state, g.width, g.height))
            width = d.screen().width_in_pixels
        finally:
            d.close()
        procs = processes(desk)
        # the panel maps its window about a second after it starts
        panel = not any("tint2" in p for p in procs) or any(m and w == width for m, w, _ in wins)
        return procs, sorted(wins) if panel else []

    deadline = time.monotonic() + timeout
    last = look()
    while time.monotonic() < deadline:
        time.sleep(0.15)
        now = look()
        registry = not any("at-spi-bus-launcher" in p for p in now[0]) or any("registryd" in p for p in now[0])
        if now == last and now[1] and registry:
            return
        last = now


def warm_reset(desk: Desktop) -> dict[str, Any]:
    """Put the desktop back to its baseline (see the module doc); returns the new fingerprint (only
    its ``digest`` where it is the baseline's) with ``timings_ms``. Raises WarmResetError where it
    cannot (the farm restarts the box cold). The caller starts the interpreter again
    (``desk.restart_runner``)."""
    base: Baseline | None = getattr(desk, "warm_baseline", None)
    if desk.agent is None:
        raise WarmResetError("warm resets need a box (the agent's own namespaces)")
    if base is None:
        raise WarmResetError("no baseline: the desktop was not prepared for warm resets")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def mark(what: str) -> None:
        timings[what] = round((time.perf_counter() - t0) * 1000, 1)

    with _lock:
        if desk.wallpaper is not None:
            raise WarmResetError("a wallpaper was set")
        kill_agent_processes(set())  # every one: the buses too (a task could have tampered with them)
        mark("kill")
        desk.reset_helpers()  # the interpreter (killed above: no graceful wait), recorder, input bindings
        reap_agent_zombies()
        mark("killed")
        # From here on no process of the agent's runs but the ones started below: the helper (its
        # files, as its root) and, once the files are back, its buses.
        old_a11y = [os.path.join("/tmp", n) for n in os.listdir("/tmp") if n.startswith("osfarm-a11y-")]
        helper = HelperSession(desk, "reset", desk.home)
        xconn = None
        try:
            xconn = xdisplay.Display(desk.display)  # one X connection for the reset and the state after
            keep = b"\0".join(os.fsencode(os.path.join(top, rel)) for top, rels in base.keep.items() for rel in rels)
            emptied = b"\0".join(os.fsencode(d) for d in old_a11y)
            helper.send(b"%d %d %d\n" % (len(keep), len(emptied), len(base.home_archive))
                        + keep + emptied + base.home_archive)
            # while the helper starts and restores the files: X (no file of the agent's matters to it)
            x_reset(desk.display, base, xconn)
            if desk.exchange_dir:
                for name in set(os.listdir(desk.exchange_dir)) - base.exchange:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(desk.exchange_dir, name))
            mark("x")
            if helper.line() != b"restored":
                raise WarmResetError("agent-side helper: unexpected answer")
            mark("files")
            # the helper scans the home and the agent's /etc meanwhile (the buses write neither)
            if desk.restart_buses is not None:
                steps = desk.restart_buses()
                for d in old_a11y:  # the old AT-SPI bus's dirs (the guest's)
                    shutil.rmtree(d, ignore_errors=True)
                timings.update({f"buses.{k}": v for k, v in (steps or {}).items()})
            mark("buses")
            scan = json.loads(helper.line())
            mark("scanned")
            helper.send(b"scan\n")
            # while it scans the writable trees: X, once the window manager caught up
            state = wait_wm(desk.display, base.fingerprint.get("x", {}), conn=xconn)
            mark("wm")
            scan.update(json.loads(helper.finish()))
            mark("scan")
        finally:
            helper.close()
            if xconn is not None:
                xconn.close()
        if tuple(state["screen"]) != base.screen:
            raise WarmResetError(f"the screen size changed to {state['screen']}")
        fp = fingerprint(desk, scan, x=state)  # the helper is gone: the process list is the desktop's
        mark("fingerprint")
    # The interpreter is started again by the caller, once its answer is out (the route's
    # background task): nothing waits for it. The farm compares digests: the whole fingerprint
    # goes back only where it differs from the baseline's (the farm then says where).
    if fp["digest"] == base.fingerprint.get("digest"):
        fp = {"digest": fp["digest"]}
    fp["timings_ms"] = timings  # not part of the digest
    return fp
