"""osfarm.desktop.session.a11y against real apps on a real Xvfb + D-Bus + AT-SPI session.

One session per module (starting LibreOffice and Chromium costs tens of seconds on a small box).
Every process started here carries a marker in its environment, so teardown finds and kills
all of them, including daemonised children (soffice.bin, Chromium's zygotes and crashpad).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from osfarm.desktop.session import a11y, a11y_bus
from osfarm.testing.waiting import wait_until

# The a11y tree takes seconds to read: poll it less often than cheap conditions.
wait_for = functools.partial(wait_until, interval=0.3)

pytestmark = pytest.mark.slow

ST = f"{{{a11y.NS['st']}}}"
CP = f"{{{a11y.NS['cp']}}}"
MARKER_ENV = "OSFARM_A11Y_TEST_MARKER"


class Session:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = uuid.uuid4().hex
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env: dict[str, str] = {}

    def popen(self, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        env = dict(self.env, **kw.pop("env", {}))
        log = open(self.root / f"{Path(args[0]).name}-{len(self.procs)}.log", "wb")
        p = subprocess.Popen(args, env=env, stdout=kw.pop("stdout", log), stderr=log,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        mine = []
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get(MARKER_ENV) == self.marker:
                    mine.append(proc)
            except (psutil.Error, OSError):
                continue
        mine += [psutil.Process(p.pid) for p in self.procs if p.poll() is None]
        for proc in mine:
            try:
                proc.send_signal(signal.SIGCONT)  # a test may have stopped one
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(mine, timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        for p in self.procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass




def tree() -> ET.Element:
    return ET.fromstring(a11y.accessibility_tree(timeout_s=30))


def app_named(root: ET.Element, *names: str) -> ET.Element | None:
    for app in root:
        if app.get("name", "").lower() in names:
            return app
    return None


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    s = Session(Path(tempfile.mkdtemp(prefix="osfarm-a11y-")))
    run = s.root / "run"
    run.mkdir(mode=0o700)
    (s.root / "home").mkdir()
    s.env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(s.root / "home"),
        "XDG_RUNTIME_DIR": str(run),
        "LANG": "C.UTF-8",
        MARKER_ENV: s.marker,
    }
    saved = {k: os.environ.get(k) for k in ("DISPLAY", "DBUS_SESSION_BUS_ADDRESS", "AT_SPI_BUS_ADDRESS")}
    try:
        # Xvfb picks a free display and writes its number to the pipe.
        rfd, wfd = os.pipe()
        s.popen(["Xvfb", "-displayfd", str(wfd), "-nolisten", "tcp", "-screen", "0", "1280x800x24"],
                pass_fds=(wfd,))
        os.close(wfd)
        with os.fdopen(rfd) as f:
            display = ":" + f.readline().strip()
        assert display != ":", "Xvfb did not report a display"
        s.env["DISPLAY"] = display

        bus = s.popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"],
                      stdout=subprocess.PIPE)
        assert bus.stdout is not None
        s.env["DBUS_SESSION_BUS_ADDRESS"] = bus.stdout.readline().decode().strip()
        assert s.env["DBUS_SESSION_BUS_ADDRESS"], "dbus-daemon gave no address"

        s.popen(["/usr/libexec/at-spi-bus-launcher", "--launch-immediately"])
        s.popen(["openbox"])
        os.environ.update({k: s.env[k] for k in ("DISPLAY", "DBUS_SESSION_BUS_ADDRESS")})
        os.environ.pop("AT_SPI_BUS_ADDRESS", None)
        wait_for(a11y_bus.a11y_bus_ok, 20, "the AT-SPI registry")
        # Apps must not take the bus address from the X root window (anyone can overwrite it).
        address = a11y_bus.a11y_bus_address()
        assert address
        s.env["AT_SPI_BUS_ADDRESS"] = address
        # Chromium exposes nothing unless the a11y bus says it is enabled.
        assert a11y_bus.set_a11y_enabled(True)
        yield s
    finally:
        s.kill_all()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(s.root, ignore_errors=True)


def test_bus_ok_is_quick(session: Session) -> None:
    t0 = time.monotonic()
    assert a11y_bus.a11y_bus_ok() is True
    assert time.monotonic() - t0 < 1.0


def test_bus_ok_false_without_bus(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={session.root}/no-such-bus")
    t0 = time.monotonic()
    assert a11y_bus.a11y_bus_ok() is False
    assert time.monotonic() - t0 < 1.0


def test_calc_tree(session: Session) -> None:
    csv = session.root / "scores.csv"
    csv.write_text("Name,Score\nAlphaCell,42\nBetaCell,7\n")
    session.popen(
        ["soffice", "--calc", "--norestore", "--nologo", "--nolockcheck",
         f"-env:UserInstallation=file://{session.root}/lo-profile",
         "--infilter=CSV:44,34,76,1", str(csv)],
        env={"SAL_USE_VCLPLUGIN": "gtk3"},
    )

    def calc_ready() -> ET.Element | None:
        root = tree()
        app = app_named(root, "soffice", "libreoffice calc")
        if app is None:
            return None
        texts = {(c.text or "").strip() for c in app.iter("table-cell")}
        # the menu bar's entries reach the tree after the cells (seen on a loaded machine)
        menus = {m.get("name") for m in app.iter("menu")}
        return root if "AlphaCell" in texts and {"File", "Edit", "View"} <= menus else None

    root = wait_for(calc_ready, 120, "Calc showing the CSV's cells and its menus")
    app = app_named(root, "soffice", "libreoffice calc")
    assert app is not None
    assert app.tag == "application"
    assert app.find(".//document-spreadsheet") is not None
    table = app.find(".//table")
    assert table is not None
    cells = table.findall("table-cell")
    # Only the visible window of the 16384 x 1048576 grid, row-major from A1.
    assert 20 <= len(cells) <= 5000, len(cells)
    assert cells[0].get("name") == "A1" and (cells[0].text or "") == "Name"
    by_name = {c.get("name"): (c.text or "") for c in cells}
    assert by_name.get("A2") == "AlphaCell" and by_name.get("B2") == "42"
    assert all(c.get(ST + "showing") == "true" for c in cells)
    assert cells[0].get(CP + "screencoord", "").startswith("(")
    menus = {m.get("name") for m in app.iter("menu")}
    assert {"File", "Edit", "View"} <= menus

    def titled_frame() -> bool:
        calc = app_named(tree(), "soffice")
        return calc is not None and any(
            f.tag == "frame" and "scores" in f.get("name", "") for f in calc)

    # The window title is set a moment after the cells appear.
    assert wait_for(titled_frame, 30, "Calc's frame titled after the file")


def test_chromium_tree(session: Session) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe is not None, "chromium is not installed (scripts/system-packages.txt lists it)"
    page = session.root / "page.html"
    page.write_text(
        "<!doctype html><html><head><title>A11y Probe Page</title></head><body>"
        "<h1>Probe heading</h1><button>Press me</button> "
        "<a href='#there'>Example link</a><p id='there'>Some paragraph</p></body></html>"
    )
    session.popen(
        [exe, "--no-sandbox", "--force-renderer-accessibility",
         f"--user-data-dir={session.root}/chromium", "--no-first-run", "--no-default-browser-check",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-gpu", "--password-store=basic", page.as_uri()]
    )

    def page_ready() -> ET.Element | None:
        root = tree()
        app = app_named(root, "chromium", "google-chrome", "chrome")
        if app is None:
            return None
        buttons = {b.get("name") for b in app.iter("push-button")}
        return app if "Press me" in buttons else None

    app = wait_for(page_ready, 90, "Chromium exposing the page's button")
    doc = next(d for d in app.iter("document-web") if d.get("name") == "A11y Probe Page")
    assert "Example link" in {a.get("name") for a in doc.iter("link")}
    button = next(b for b in doc.iter("push-button") if b.get("name") == "Press me")
    assert button.get(CP + "size", "").startswith("(")
    assert any(k.startswith(f"{{{a11y.NS['act']}}}") for k in button.attrib)
    assert "Probe heading" in {h.get("name") for h in doc.iter("heading")}


def test_terminal_text(session: Session) -> None:
    marker = "MARKER-" + uuid.uuid4().hex[:8]
    session.popen(["xfce4-terminal", "--disable-server", "-x", "sh", "-c", f"echo {marker}; sleep 120"])

    def text_with_marker() -> str | None:
        text = a11y.terminal_text()
        if text is None or marker not in text:
            # The new window normally takes focus; if it did not, give it focus.
            subprocess.run(["wmctrl", "-x", "-a", "xfce4-terminal"], env=session.env,
                           capture_output=True, check=False)
            return None
        return text

    text = wait_for(text_with_marker, 60, "the terminal's text via AT-SPI")
    assert text.splitlines()[0] == marker
    assert text == text.rstrip()


def test_terminal_text_none_when_not_focused(session: Session) -> None:
    # Focus Calc: the active window then has no terminal widget.
    subprocess.run(["wmctrl", "-x", "-a", "libreoffice-calc"], env=session.env, capture_output=True, check=False)
    assert wait_for(lambda: a11y.terminal_text() is None, 20, "terminal_text() to be None")


def _depth(el: ET.Element) -> int:
    return 1 + max((_depth(c) for c in el), default=0)


def test_bounds(session: Session) -> None:
    full = tree()
    n_full = sum(1 for _ in full.iter()) - 1
    assert n_full > 300  # Calc + Chromium (+ terminal) are up from the tests above

    small = ET.fromstring(a11y.accessibility_tree(max_nodes=40))
    assert small.tag == "desktop-frame"
    assert 1 <= sum(1 for _ in small.iter()) - 1 <= 40

    shallow = ET.fromstring(a11y.accessibility_tree(max_depth=3))
    assert _depth(shallow) - 1 <= 3  # applications are depth 1, as in OSWorld
    assert any(len(app) for app in shallow)

    narrow = ET.fromstring(a11y.accessibility_tree(max_width=2, max_depth=6))
    assert all(len(el) <= 2 for app in narrow for el in app.iter())

    t0 = time.monotonic()
    tiny = ET.fromstring(a11y.accessibility_tree(timeout_s=0.05))
    assert time.monotonic() - t0 < 1.5
    assert tiny.tag == "desktop-frame"
    assert sum(1 for _ in tiny.iter()) - 1 < n_full


def test_hung_app_does_not_hang_the_tree(session: Session) -> None:
    root = tree()
    assert app_named(root, "soffice") is not None
    soffice = [p for p in psutil.process_iter(["name", "environ"])
               if p.info["name"] == "soffice.bin" and (p.info["environ"] or {}).get(MARKER_ENV) == session.marker]
    assert soffice, "soffice.bin not found"
    for p in soffice:
        p.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        root = ET.fromstring(a11y.accessibility_tree(timeout_s=5))
        elapsed = time.monotonic() - t0
        assert elapsed < 8, elapsed
        # The apps that answer are still there.
        assert app_named(root, "chromium", "google-chrome", "chrome") is not None
        t0 = time.monotonic()
        a11y.terminal_text()
        assert time.monotonic() - t0 < 8
    finally:
        for p in soffice:
            p.send_signal(signal.SIGCONT)
    assert wait_for(lambda: app_named(tree(), "soffice") is not None, 30, "Calc answering again")


def test_concurrent_calls_are_serialised(session: Session) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: a11y.accessibility_tree(max_nodes=300), range(4)))
    for xml in results:
        assert ET.fromstring(xml).tag == "desktop-frame"
