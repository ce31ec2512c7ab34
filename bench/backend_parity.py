"""Backend parity: the replay, noop and fail agents' scores on every backend, side by side.

Each backend gets a farm of its own (tests/test_provider_conformance.py's settings: under TCG,
libvirt keeps one VM and reverts its snapshot per reset), and ``osfarm eval`` runs every agent on
the same tasks there: by default the offline suite's tasks across the terminal/files, a
spreadsheet and the browser plus one infeasible task, and OSWorld's own task files (with their
generated inputs and scripted solutions). The table gives each task's score per backend and
agent, and per backend and agent the agreement with sandbox: the share of tasks where it gives
sandbox's (status, score). Under TCG libvirt skips OSWorld's tasks (each cold-starts an office
app, GIMP, Thunderbird or VLC in an emulated VM: minutes apiece) unless --osworld-on-tcg.

Usage: python bench/backend_parity.py [--backends sandbox,docker,libvirt] [--agents replay,noop,fail]
       [--offline os=ID,ID;chrome=ID] [--no-osworld] [--osworld-agents replay] [--osworld-on-tcg] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from osfarm.testing.backend_parity import (
    OSWORLD_TASKS,
    SLOW_BOOT,
    Score,
    TaskSet,
    agreement,
    desktop_wait_s,
    eval_scores,
    farm_options,
    known,
    offline_tasks,
    osworld_tasks,
    remember,
    scores_of,
)
from osfarm.testing.farms import running_farm

DEFAULT_OFFLINE = ("os=0f5d2a10-0000-4000-8000-000000000001,0f5d2a10-0000-4000-8000-000000000002,"
                   "0f5d2a10-0000-4000-8000-000000000901;libreoffice_calc=0f5d2a10-0000-4000-8000-000000000101;"
                   "chrome=0f5d2a10-0000-4000-8000-000000000401")  # fmt: skip


def parse_index(text: str) -> dict[str, list[str]]:
    """``domain=id,id;domain=id`` -> {domain: [id, ...]}."""
    index: dict[str, list[str]] = {}
    for part in filter(None, text.split(";")):
        domain, sep, ids = part.partition("=")
        if not sep or not ids:
            raise SystemExit(f"--offline: expected domain=id[,id...], got {part!r}")
        index[domain.strip()] = [i.strip() for i in ids.split(",") if i.strip()]
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sandbox,docker,libvirt",
                    help="comma-separated providers; sandbox is the reference")
    ap.add_argument("--agents", default="replay,noop,fail", help="comma-separated agents of osfarm eval")
    ap.add_argument("--offline", default=DEFAULT_OFFLINE, help="offline suite tasks: domain=id,id;domain=id")
    ap.add_argument("--osworld", action=argparse.BooleanOptionalAction, default=True,
                    help="also OSWorld's own task files (../shared/osworld/tasks) where present")
    ap.add_argument("--osworld-agents", default=None, help="agents for OSWorld's tasks (default: --agents)")
    ap.add_argument("--osworld-on-tcg", action="store_true", help="run OSWorld's tasks on emulated libvirt too")
    ap.add_argument("--out", type=Path, default=None,
                    help="keep the eval runs here (default: a temporary folder); runs found there are reused")
    args = ap.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "sandbox" not in backends:
        backends.insert(0, "sandbox")
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    osworld_agents = [a.strip() for a in (args.osworld_agents or args.agents).split(",") if a.strip()]
    console = Console(width=160)  # the table is wider than a terminal's default when piped
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        root = args.out or Path(tmp)
        offline_index = parse_index(args.offline)
        sets: list[TaskSet] = [offline_tasks(offline_index)] if offline_index else []
        if args.osworld and OSWORLD_TASKS.is_dir():
            sets.append(osworld_tasks(root / "osworld"))
        scores: dict[tuple[str, str], dict[str, Score]] = {}  # (backend, agent) -> task -> score
        seconds: dict[str, float] = {}
        for backend in backends:
            t0 = time.monotonic()
            # the offline suite's tasks on light desktops (the test suite's), OSWorld's on GNOME at
            # 1920x1080: the screen their scripted solutions were written for
            for tasks in sets:
                if tasks.name == "osworld" and SLOW_BOOT.get(backend) and not args.osworld_on_tcg:
                    continue
                desktop = "gnome" if tasks.name == "osworld" else "light"
                runs = {agent: root / backend / f"{agent}-{tasks.name}"
                        for agent in (osworld_agents if tasks.name == "osworld" else agents)}  # fmt: skip
                for agent, out in runs.items():
                    if args.out and (out / "run" / "results.json").is_file():  # left in --out by an earlier bench
                        found = json.loads((out / "run" / "results.json").read_text())
                        remember(backend, desktop, agent, tasks, scores_of(found))
                farm_needed = not all(known(backend, desktop, agent, tasks) is not None for agent in runs)
                with contextlib.ExitStack() as stack:
                    # OSWorld's screen is 1920x1080: their solutions click there (as `osfarm eval`'s own farm)
                    screen: dict[str, Any] = {"width": 1920, "height": 1080} if tasks.name == "osworld" else {}
                    farm = stack.enter_context(running_farm(
                        prefix=f"bp{backend[:2]}", start_timeout_s=desktop_wait_s(backend) + 60, desktop=desktop,
                        **screen, **farm_options(backend))) if farm_needed else None  # fmt: skip
                    for agent, out in runs.items():
                        where = {"url": farm.url, "token": farm.token, "envs": farm.settings.pool_max} if farm else {}
                        got = eval_scores(backend, desktop, agent, tasks, out, **where,
                                          timeout_s=1200 + 8 * desktop_wait_s(backend))  # fmt: skip
                        scores.setdefault((backend, agent), {}).update({f"{tasks.name}/{t}": s for t, s in got.items()})
            seconds[backend] = time.monotonic() - t0
            console.print(f"{backend}: done in {seconds[backend]:.0f} s")

    table = Table(title="score per task (status: s=success f=failure; - = not run)")
    table.add_column("task")
    for agent in agents:
        for backend in backends:
            table.add_column(f"{agent}\n{backend}", justify="right")
    tasks_seen = sorted({t for run in scores.values() for t in run})
    for task in tasks_seen:
        cells = []
        for agent in agents:
            for backend in backends:
                s = scores.get((backend, agent), {}).get(task)
                cells.append("-" if s is None else f"{s[1]:g} {s[0][0]}")
        set_name, task_id = task.split("/")  # the offline suite's ids differ in their tail, OSWorld's in their head
        table.add_row(f"{set_name}/{task_id[-4:] if set_name == 'offline' else task_id[:8]}", *cells)
    console.print(table)

    summary = Table(title="agreement with sandbox (tasks where the backend gives sandbox's status and score)")
    summary.add_column("agent")
    for backend in backends:
        summary.add_column(backend, justify="right")
    for agent in agents:
        ratios = agreement({b: scores.get((b, agent), {}) for b in backends})
        cells = [f"{same}/{ran} = {same / ran:.2f}" if ran else "-" for same, ran in (ratios[b] for b in backends)]
        summary.add_row(agent, *cells)
    console.print(summary)
    console.print("wall time per backend: " + ", ".join(f"{b} {s:.0f} s" for b, s in seconds.items()))


if __name__ == "__main__":
    main()
