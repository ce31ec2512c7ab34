"""``osfarm demo``: the scripted main job, each phase timed: lease a desktop (of an in-process farm
unless ``--url``), open a terminal, type a command, save a screenshot and the timings."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from osfarm.cli.common import ConfigOpt, err, fail, farm_errors, out, settings_or_exit
from osfarm.runner.options import FarmTokenOpt, FarmUrlOpt


class _Phases:
    """Named, timed phases shown as a rich progress list."""

    def __init__(self, progress: Any):
        self.progress = progress
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        task = self.progress.add_task(name, total=1)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.timings[name] = dt
            self.progress.update(task, completed=1, description=f"{name} [dim]{dt * 1000:.0f} ms[/]")


def _wait_focused(desk: Any, wm_class: str, timeout: float = 30.0) -> bool:
    """Wait until a window of ``wm_class`` has the keyboard focus: a window is listed before the
    window manager has mapped and focused it (GNOME's mutter takes a frame or more), and keys
    typed before then go elsewhere."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obs = desk.observe(screenshot=False, windows=True, cursor=False)
        if any(w.focused and wm_class in w.wm_class.lower() for w in obs.windows or []):
            return True
        time.sleep(0.1)
    return False


def _wait_settled(desk: Any, timeout: float = 5.0) -> bytes:
    """Screenshots until two in a row are identical: the screen finished redrawing."""
    prev = desk.screenshot("png")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = desk.screenshot("png")
        if cur == prev:
            return cur
        prev = cur
    return prev


def demo(
    out_dir: Annotated[Path, typer.Option("--out", help="run directory root")] = Path("runs"),
    url: FarmUrlOpt = None,
    token: FarmTokenOpt = None,
    text: Annotated[str, typer.Option("--text", help="command typed into the terminal")] = "echo hello from osfarm",
    width: Annotated[int | None, typer.Option(help="screen width (in-process farm)", show_default=False)] = None,
    height: Annotated[int | None, typer.Option(help="screen height (in-process farm)", show_default=False)] = None,
    config: ConfigOpt = None,
) -> None:
    """The main job: lease a desktop, open a terminal, type a command, save a screenshot."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from osfarm.client import Farm, FarmAPIError

    settings = None
    if url is None:
        settings = settings_or_exit(config, pool_min=1, pool_max=1, port=0, width=width, height=height)
    run_dir = out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
    server = None
    t_all = time.perf_counter()
    with Progress(SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"),
                  console=err) as progress:
        phase = _Phases(progress)
        try:
            if settings is not None:
                with phase("start farm (1 warm desktop)"):
                    from osfarm.farm.local import start_local_farm
                    from osfarm.providers.base import ProviderError

                    try:  # a missing box tool or Xvfb is one clear line, not a traceback
                        server = start_local_farm(settings)
                    except (ProviderError, RuntimeError) as e:
                        raise fail(str(e)) from None
                    url, token = server.url, server.token
            assert url is not None
            with farm_errors(), Farm(url, token) as farm:
                with phase("lease a desktop"):
                    desk = farm.lease(owner="osfarm-demo", ttl_s=300)
                # Ubuntu's terminal on the GNOME desktop (OSWorld's screen), xfce4-terminal on light
                terminal = "gnome-terminal" if desk.info.desktop == "gnome" else "xfce4-terminal"
                try:
                    with phase(f"launch {terminal}"):
                        desk.guest("POST", "/setup/launch", json={"command": [terminal], "shell": False})
                    with phase("wait for its window"):
                        r = desk.guest("POST", "/v1/wait_for_window", json={"wm_class": terminal, "timeout": 30})
                        if not r.json().get("ok"):
                            raise FarmAPIError(504, f"the terminal window did not appear: {r.json().get('detail')}")
                        if not _wait_focused(desk, terminal):
                            raise FarmAPIError(504, "the terminal window did not take the keyboard focus in 30 s")
                        # painted and idle (osfarm.desktop.x11.settle): GNOME's compositor shows a new
                        # window a few frames after it is focused
                        desk.guest("POST", "/execute", json={"command": [
                            "osfarm-settle", "--window", "Terminal", "--timeout", "30", "--quiet", "0.3"]}, timeout=40)
                    with phase(f"type {text!r} + Enter"):
                        res = desk.step([
                            {"action_type": "TYPING", "parameters": {"text": text}},
                            {"action_type": "PRESS", "parameters": {"key": "enter"}},
                        ])  # fmt: skip
                        bad = [a for a in res.results if not a.ok]
                        if bad:
                            raise FarmAPIError(500, f"action {bad[0].index} failed: {bad[0].error}")
                    with phase("screenshot"):
                        png = _wait_settled(desk)
                        run_dir.mkdir(parents=True, exist_ok=True)
                        (run_dir / "screenshot.png").write_bytes(png)
                finally:
                    with phase("release"):
                        desk.close()
        finally:
            if server is not None:
                with phase("stop farm"):
                    server.stop()
    total = time.perf_counter() - t_all
    timings = {**phase.timings, "total": total}
    (run_dir / "timings.json").write_text(json.dumps({k: round(v, 4) for k, v in timings.items()}, indent=2))
    table = Table("phase", "ms", title="osfarm demo")
    for name, dt in timings.items():
        table.add_row(name, f"{dt * 1000:.0f}")
    out.print(table)
    out.print(f"screenshot: {run_dir / 'screenshot.png'}", highlight=False)
