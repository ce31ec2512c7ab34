"""Reset-to-ready, CPU per reset, warm lease and idle memory per provider, side by side in one run.

* reset-to-ready: ``provider.reset(handle)`` on a running desktop until the fresh box's guest
  answers /v1/health (sandbox: kill + new namespace box, or with ``sandbox-warm`` the warm reset
  of osfarm/desktop/warm/warm.py; docker: a new container from the image, started while the old one is
  removed, or with ``docker-warm`` the same warm reset in the kept container). What the farm pays
  between two episodes. Before each reset the desktop is dirtied as a task would (files in the
  home and /tmp, a double-forked daemon, a clipboard owner, a held key; ``--clean`` skips it).
* CPU-seconds per reset: the box's (its cgroup, else its processes) from the reset's start until
  SETTLE_S after it is ready (a cold box's panel and accessibility registry finish starting after
  its guest answers), less what the idle desktop uses over as long, plus the farm process's own.
  Warm resets that fell back to cold are counted. ``sandbox-fork``: the box template's own CPU
  (its fork of each box) counts as the farm's.
* warm lease: ``POST /v1/desktops`` on a real `osfarm serve --provider X` with ready desktops.
* idle memory: PSS of every process of one idle desktop (shared pages shared out).

Usage: python bench/reset_latency.py [--providers sandbox,docker] [--resets 10] [--leases 10]
Each entry of VARIANTS is a provider with its settings; add one to compare a new box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import psutil  # noqa: E402
from percentiles import median_ms, p90_ms  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from osfarm.config import FarmSettings  # noqa: E402
from osfarm.providers import make_provider  # noqa: E402
from osfarm.providers.base import DesktopHandle, DesktopSpec, SupportsCpuSeconds, tree_cpu_seconds  # noqa: E402
from osfarm.testing.farms import running_farm  # noqa: E402

# name -> (provider, settings overrides); both reset modes named (cold is the farm's default), and
# no periodic cold reset in the warm variants (cold_every 0): each column measures one mode
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sandbox": ("sandbox", {"reset_mode": "cold"}),
    "sandbox-warm": ("sandbox", {"reset_mode": "warm", "cold_every": 0}),
    # the GNOME desktop (osfarm.desktop.session.gnome): the shell and its daemons start again in a warm reset
    "gnome": ("sandbox", {"reset_mode": "cold", "desktop": "gnome"}),
    "gnome-warm": ("sandbox", {"reset_mode": "warm", "cold_every": 0, "desktop": "gnome"}),
    # cold starts forked from the box template (sandbox_start fork); a warm reset does not start a box
    "sandbox-fork": ("sandbox", {"reset_mode": "cold", "sandbox_start": "fork"}),
    "docker": ("docker", {"docker_network": "none", "reset_mode": "cold"}),
    "docker-warm": ("docker", {"docker_network": "none", "reset_mode": "warm", "cold_every": 0}),
    # libvirt VMs (disk: `osfarm image build-vm`): fresh overlay + boot, and internal snapshot revert
    "libvirt-boot": ("libvirt", {"libvirt_reset": "boot", "libvirt_memory_mb": 2048}),
    "libvirt-snapshot": ("libvirt", {"libvirt_reset": "snapshot", "libvirt_memory_mb": 2048}),
}
IDLE_S = 3.0
SETTLE_S = 2.0
DIRTY = r"""
import os, subprocess, pyautogui
home = os.path.expanduser("~")
open(os.path.join(home, "Desktop", "bench.txt"), "w").write("x" * 10000)
open("/tmp/bench.tmp", "w").write("y")
subprocess.Popen(["sh", "-c", "(sleep 1000 &) ; exit 0"])
subprocess.Popen(["python3", "-c", "from Xlib import display, X; import time; d = display.Display(); "
                  "w = d.screen().root.create_window(0, 0, 1, 1, 0, 0); "
                  "w.set_selection_owner(d.intern_atom('CLIPBOARD'), X.CurrentTime); d.flush(); time.sleep(1000)"])
pyautogui.keyDown("shift")
pyautogui.moveTo(11, 13)
"""


async def dirty(handle: DesktopHandle) -> None:
    async with handle.endpoint.client(timeout=60) as c:
        r = await c.post("/v1/pyautogui", json={"code": DIRTY, "timeout": 30})
        r.raise_for_status()
        if not r.json().get("ok"):
            raise RuntimeError(f"dirtying the desktop failed: {r.json()}")
    await asyncio.sleep(0.3)


def box_cpu(provider: Any, handle: DesktopHandle) -> float:
    used = provider.cpu_seconds(handle) if isinstance(provider, SupportsCpuSeconds) else tree_cpu_seconds(
        provider.pids(handle))
    return used or 0.0


def template_cpu(provider: Any) -> float:
    """CPU-s of the sandbox's box template itself (``sandbox_start: fork``; its forks of new
    boxes), not its reaped children (a box's processes, counted in the box's cgroup)."""
    template = getattr(provider, "_template", None)
    if template is None or template.pid is None:
        return 0.0
    try:
        t = psutil.Process(template.pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


async def resets(name: str, n: int, width: int, height: int, clean: bool = False) -> dict[str, Any]:
    """Reset-to-ready and CPU seconds per reset, first start seconds, idle PSS MiB, warm
    fallbacks for one variant."""
    provider_name, overrides = VARIANTS[name]
    state = Path(tempfile.mkdtemp(prefix="ofr", dir="/tmp"))
    settings = FarmSettings(provider=provider_name, state_dir=state, width=width, height=height, **overrides)
    provider = make_provider(settings)
    await provider.reap_orphans()
    spec = DesktopSpec(width=width, height=height, desktop=settings.desktop, timezone=settings.desktop_timezone)
    m0, t0 = time.monotonic(), time.perf_counter()
    handle = await provider.start("bench1", spec)
    first = time.perf_counter() - t0
    out: list[float] = []
    cpu: list[float] = []
    fallbacks: list[str] = []
    steps: list[str] = []
    parts: list[dict[str, float]] = []  # cold starts' parts (sandbox), the first start's first
    try:
        await asyncio.sleep(IDLE_S)
        warm = overrides.get("reset_mode") == "warm"
        got = cold_parts(handle, m0, first, warm)
        if got:
            parts.append(got)
        mem = pss_mib(provider.pids(handle))
        c0 = box_cpu(provider, handle)
        await asyncio.sleep(SETTLE_S)
        idle_per_s = max(0.0, box_cpu(provider, handle) - c0) / SETTLE_S
        for _ in range(n):
            if not clean:
                await dirty(handle)
            before = box_cpu(provider, handle)
            tpl = template_cpu(provider)
            p0, m0, t0 = time.process_time(), time.monotonic(), time.perf_counter()
            handle = await provider.reset(handle)
            out.append(time.perf_counter() - t0)
            farm = time.process_time() - p0 + template_cpu(provider) - tpl
            await asyncio.sleep(SETTLE_S)  # also lets the old box's teardown finish outside the timing
            if handle.info.get("reset_mode") != "warm":
                got = cold_parts(handle, m0, out[-1], warm)
                if got:
                    parts.append(got)
            after = box_cpu(provider, handle)
            if handle.info.get("reset_mode") == "warm":
                used = after - before - idle_per_s * (out[-1] + SETTLE_S)
            else:  # a new box (cgroup, container, VM): everything it used since it started
                used = after - idle_per_s * SETTLE_S
            cpu.append(max(0.0, used) + farm)
            if handle.info.get("warm_ms"):
                steps.append(handle.info["warm_ms"])
            if handle.info.get("reset_fallback"):
                fallbacks.append(f"{handle.info.get('reset_fallback_kind')}: {handle.info['reset_fallback'][:300]}")
    finally:
        await provider.stop(handle)
        await provider.close()
        shutil.rmtree(state, ignore_errors=True)
    return {"resets": out, "cpu": cpu, "first": first, "mem": mem, "fallbacks": fallbacks, "steps": steps,
            "parts": parts}


# A sandbox cold start's parts: (name, in the chain the start waits on, what it is); each is its
# ms since the reset (or start) began, from the box's init (osfarm.desktop.box.box_init), the
# session's state file (osfarm.desktop.session.session; all on the monotonic clock) and the provider's
# handle. The launcher imports the server stack while Xvfb and the desktop's processes start (a
# thread): those run alongside the chain.
COLD_PARTS = [
    ("box_init", True, "old box killed, host dirs + cgroup + plan, namespaces, box init's Python started"),
    ("box_fs", True, "the box's file system mounted"),
    ("agent_world", True, "the agent's user namespace, /etc layer, sudo"),
    ("session", True, "launcher's Python started (exec, imports)"),
    ("xvfb", False, "Xvfb ready"),
    ("spawned", False, "WM, panel, D-Bus started, AT-SPI launcher spawned"),
    ("guest_import", True, "the server stack imported"),
    ("guest_listens", True, "guest server listening"),
    ("ready", True, "start/reset returned: socket claimed, /v1/health answered"),
    ("baseline", True, "warm mode: the baseline taken (start returned)"),
    ("wm", False, "window manager running"),
    ("panel", False, "panel mapped"),
    ("a11y", False, "AT-SPI registry running"),
]


def cold_parts(handle: DesktopHandle, m0: float, total_s: float, baseline: bool) -> dict[str, float]:
    """ms since ``m0`` (time.monotonic() when the start or reset began) of each part of a sandbox
    cold start that the box and the session recorded; {} where there is no state file.
    ``baseline``: the start also took a warm-reset baseline (after ``start_s``)."""
    try:
        st = json.loads((Path(handle.info["dir"]) / "run" / "state.json").read_text())
    except (KeyError, OSError, ValueError):
        return {}
    box, t = st.get("box_monotonic") or {}, st.get("timings_ms") or {}
    s0 = st.get("t0_monotonic")
    if s0 is None:
        return {}
    out: dict[str, float] = {}
    for key, name in (("init", "box_init"), ("root", "box_fs"), ("agent_world", "agent_world")):
        if key in box:
            out[name] = (box[key] - m0) * 1000
    out["session"] = (s0 - m0) * 1000
    at = (s0 - m0) * 1000
    for key, name in (("xvfb_ready_ms", "xvfb"), ("desktop_spawned_ms", "spawned"), ("import_ms", "guest_import"),
                      ("ready_ms", "guest_listens"), ("wm_ready_ms", "wm"), ("panel_ready_ms", "panel"),
                      ("a11y_ready_ms", "a11y")):
        if key in t:
            out[name] = at + t[key]
    if "guest_import" in out:  # a duration from just before Xvfb's start: roughly from the session's start
        out["guest_import"] = at + t["import_ms"]
    start_s = float(handle.info.get("start_s", 0) or 0)
    if baseline and start_s and total_s > start_s:
        out["ready"] = start_s * 1000
        out["baseline"] = total_s * 1000
    else:
        out["ready"] = total_s * 1000
    return out


def warm_leases(name: str, n: int, width: int, height: int) -> list[float]:
    provider_name, overrides = VARIANTS[name]
    saved = dict(os.environ)
    os.environ["OSFARM_PROVIDER"] = provider_name
    for k, v in overrides.items():
        os.environ[f"OSFARM_{k.upper()}"] = str(v)
    out: list[float] = []
    try:
        with running_farm(process=True, pool_min=2, pool_max=3, width=width, height=height, start_timeout_s=300,
                          ready=2) as served:
            url, token = served.url, served.token
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
                for _ in range(n):
                    _wait_ready(c, 1)
                    t0 = time.perf_counter()
                    r = c.post("/v1/desktops", json={})
                    out.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    c.delete(f"/v1/desktops/{r.json()['id']}").raise_for_status()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out


def _wait_ready(c: httpx.Client, k: int) -> None:
    deadline = time.monotonic() + 180
    while c.get("/v1/pool").json()["counts"].get("ready", 0) < k:
        if time.monotonic() > deadline:
            raise RuntimeError("pool did not refill in 180 s")
        time.sleep(0.02)


def print_parts(console: Console, name: str, parts: list[dict[str, float]]) -> None:
    """The cold starts' parts: median ms since the start began; for the chain the start waits on,
    also since the chain's step before (the others run alongside it)."""
    table = Table(title=f"{name}: a cold start's parts ({len(parts)} starts, the first start's included; medians)")
    for col in ("part", "ms since start", "ms for this step", "what"):
        table.add_column(col, justify="right" if col.startswith("ms") else "left")
    rows = []
    for key, chain, what in COLD_PARTS:
        values = [p[key] for p in parts if key in p]
        if values:
            rows.append((statistics.median(values), key, chain, what))
    prev = 0.0
    for at, key, chain, what in sorted(rows):
        step = f"{at - prev:.0f}" if chain else "(alongside)"
        table.add_row(key, f"{at:.0f}", step, what)
        if chain:
            prev = at
    console.print(table)


def ratio(value: float, ref: float | None) -> str:
    return f"{value / ref:.2f}x" if ref else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--providers", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--resets", type=int, default=10)
    ap.add_argument("--leases", type=int, default=10)
    ap.add_argument("--size", default="1920x1080", help="screen WxH")
    ap.add_argument("--clean", action="store_true", help="reset without dirtying the desktop first")
    args = ap.parse_args()
    names = [n.strip() for n in args.providers.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"--providers: unknown {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    width, height = (int(v) for v in args.size.lower().split("x"))
    console = Console()
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        console.print(f"[bold]{name}[/]: {args.resets} resets, {args.leases} warm leases ...")
        got = asyncio.run(resets(name, args.resets, width, height, args.clean))
        rs = got["resets"]
        wl = warm_leases(name, args.leases, width, height) if args.leases else [0.0]
        rows[name] = {"first": got["first"] * 1000, "reset_med": median_ms(rs), "reset_p90": p90_ms(rs),
                      "cpu_med": statistics.median(got["cpu"]), "fallbacks": len(got["fallbacks"]),
                      "lease_med": median_ms(wl), "lease_p90": p90_ms(wl), "mem": got["mem"]}
        if got["steps"]:  # a warm reset's steps, cumulative ms (the median reset's)
            console.print(f"  warm reset steps (ms since its start): {sorted(got['steps'])[len(got['steps']) // 2]}",
                          highlight=False)
        for f in got["fallbacks"]:
            console.print(f"  [yellow]fallback to cold[/]: {f}", highlight=False)
        if got["parts"]:
            print_parts(console, name, got["parts"])
    ref = rows.get(names[0])
    table = Table(title=f"reset-to-ready, warm lease and idle memory per provider ({width}x{height}); "
                        f"ratios vs {names[0]}")
    for col in ("provider", "cold start ms", "reset median ms", "reset p90 ms", "vs ref", "CPU-s per reset",
                "vs ref", "fallbacks", "warm lease median ms", "warm lease p90 ms", "idle PSS MiB", "vs ref"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, f"{r['first']:.0f}", f"{r['reset_med']:.0f}", f"{r['reset_p90']:.0f}",
                      ratio(r["reset_med"], ref and ref["reset_med"]), f"{r['cpu_med']:.3f}",
                      ratio(r["cpu_med"], ref and ref["cpu_med"]), str(r["fallbacks"]), f"{r['lease_med']:.1f}",
                      f"{r['lease_p90']:.1f}", f"{r['mem']:.0f}", ratio(r["mem"], ref and ref["mem"]))
    console.print(table)


if __name__ == "__main__":
    main()
