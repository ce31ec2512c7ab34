"""The red team as a table: every probe of osfarm/testing/redteam/probes.py against every provider.

Box probes run as tests/security/test_box_probes.py runs them: an adversarial agent through the
normal runner on a desktop of a farm with small limits, next to a bystander desktop; the
destructive ones (bombs) get an episode each. A cell is ``held`` when the probe reported HELD
from inside the box and what must hold outside did (the farm serving, the bystander intact, the
loopback listener untouched, the episode never a success; for bombs an infra error naming the
limit), else ``BREACH`` with what happened. ``pytest`` probes (hostile task files and API calls,
the same on every provider) are their tests, run once: the "farm" column.

The ``sandbox-warm`` and ``docker-warm`` columns are warm-reset persistence
(osfarm/testing/redteam/warm_probes.py): on a farm with ``reset_mode: warm``, what one lease's agent leaves
behind (daemons, listeners, message queues, files, X and XKB settings, retained X resources, the
window manager's state ...) must be gone for the next lease: ``held (undone)`` by the warm reset,
``held (cold restart)`` where the fingerprint saw it and the farm restarted the desktop cold
(``cold_every: 0``, so no periodic cold restart hides a probe). The box columns run on the farm's
default reset (cold).

Usage: python bench/redteam.py [--providers sandbox,docker,sandbox-warm,docker-warm,libvirt] [--json out.json]
(libvirt under TCG takes minutes per boot; its bombs are not run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from osfarm.testing.farms import running_farm
from osfarm.testing.redteam.adversary import verdicts
from osfarm.testing.redteam.farm import bystander_ok, destructive_held, farm_options, redteam_farm, run_adversary
from osfarm.testing.redteam.probes import PROBES, PROVIDERS, box_probes
from osfarm.testing.redteam.warm_probes import run_warm_probes

ROOT = Path(__file__).resolve().parent.parent

BOMB_LIMITS = {"fork_bomb": "process limit", "memory_bomb": "memory limit"}


def run_provider(name: str, console: Console) -> dict[str, str]:
    """probe name -> cell for one provider."""
    cells: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="osfarm-redteam-") as tmp, redteam_farm(name, Path(tmp)) as s:
        probes = box_probes(name, destructive=False)
        console.print(f"[bold]{name}[/]: {len(probes)} probes in one episode ...")
        res = run_adversary(s["server"], [p.code(s["ctx"]) for p in probes], Path(tmp) / "w0", Path(tmp))
        got = verdicts(res)
        outside = [why for why in (
            None if res.status in ("failure", "infra_error") else f"the episode was a {res.status}",
            None if s["listener"].accepted == 0 else "the loopback listener was reached",
            bystander_ok(s)) if why]
        for i, p in enumerate(probes):
            verdict, detail = got[i] if i < len(got) else ("NONE", f"no step ran (episode {res.status}: {res.error})")
            if verdict == "HELD" and not outside:
                cells[p.name] = "held"
            else:
                cells[p.name] = f"BREACH: {detail if verdict != 'HELD' else '; '.join(outside)}"[:200]
        if name == "libvirt":
            for p in box_probes(name, destructive=True):
                cells[p.name] = "not run (TCG)"
            return cells
        for p in box_probes(name, destructive=True):
            console.print(f"[bold]{name}[/]: {p.name} ...")
            res = run_adversary(s["server"], [p.code(s["ctx"]), "import time; time.sleep(5)"], Path(tmp) / p.name,
                                Path(tmp))
            got = verdicts(res)
            why = next((f"BREACH: {d}" for v, d in got if v == "BREACH"), None)
            why = why or destructive_held(res, BOMB_LIMITS.get(p.name, "limit")) or bystander_ok(s)
            cells[p.name] = "held" if why is None else f"BREACH: {why}"[:200]
    return cells


def run_warm_provider(name: str, console: Console) -> dict[str, str]:
    """probe name -> cell for ``PROVIDER-warm``: the warm probes, one desktop, warm resets between."""
    base = name.removesuffix("-warm")
    console.print(f"[bold]{name}[/]: {sum(p.kind == 'warm' for p in PROBES)} warm-reset probes ...")
    opts = {**farm_options(base), "pool_min": 1, "pool_max": 1, "reset_mode": "warm", "cold_every": 0,
            "warm_reset_timeout_s": 60.0}
    with running_farm(prefix=f"orw{base[:2]}", **opts) as server:
        return run_warm_probes(server.url, server.token)


def run_pytest_probes(console: Console) -> dict[str, str]:
    cells: dict[str, str] = {}
    for p in (p for p in PROBES if p.kind == "pytest"):
        console.print(f"[bold]farm[/]: {p.name} ({p.node}) ...")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", p.node], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600, check=False)
        cells[p.name] = "held" if r.returncode == 0 else f"BREACH: {r.stdout.strip().splitlines()[-1:]}"
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="sandbox,docker,sandbox-warm,docker-warm",
                    help=f"comma list of {', '.join(PROVIDERS)}, sandbox-warm, docker-warm")
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args()
    console = Console()
    providers = [p for p in args.providers.split(",") if p]
    columns: dict[str, dict[str, str]] = {}
    for name in providers:
        warm = name.endswith("-warm")
        try:
            columns[name] = run_warm_provider(name, console) if warm else run_provider(name, console)
        except Exception as e:  # noqa: BLE001 - a provider that cannot run is a column saying why
            columns[name] = {p.name: f"not run: {e}"[:200] for p in PROBES if p.kind == ("warm" if warm else "box")}
    columns["farm"] = run_pytest_probes(console)
    table = Table(title="red team: probes x providers (held = refused, the farm and the bystander fine)")
    table.add_column("probe")
    table.add_column("what it tries", max_width=60)
    for name in columns:
        table.add_column(name)
    for p in PROBES:
        row = [columns[c].get(p.name, "-") for c in columns]
        table.add_row(p.name, p.title, *[(f"[green]{v}[/]" if v.startswith("held") else f"[red]{v}[/]" if
                                          v.startswith("BREACH") else v) for v in row])
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"probes": [{"name": p.name, "title": p.title, "kind": p.kind} for p in PROBES],
                                         "cells": columns}, indent=1))
    if any(v.startswith("BREACH") for col in columns.values() for v in col.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
