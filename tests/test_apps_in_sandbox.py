"""Real apps inside a real sandbox desktop, seen through the guest's OSWorld routes.

This is the path every agent takes: LibreOffice Calc and Chromium are launched by /setup/launch
in a sandbox box, and /accessibility must show their widgets (the session launcher sets up
the AT-SPI bus and the toolkit variables; nothing here does it by hand).
"""

from __future__ import annotations

import asyncio
import io
import tempfile
import time
import wave
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from osfarm.config import FarmSettings
from osfarm.providers.base import DesktopSpec
from osfarm.providers.sandbox import SandboxProvider

pytestmark = pytest.mark.slow

PAGE = """<!doctype html><html><head><title>osfarm a11y page</title></head>
<body><h1>Checkout</h1><button id="b">Press me</button> <a href="#x">Read the terms</a></body></html>"""


@pytest.fixture(scope="module")
async def guest() -> AsyncIterator[httpx.AsyncClient]:
    state = Path(tempfile.mkdtemp(prefix="ofa", dir="/tmp"))
    provider = SandboxProvider(FarmSettings(state_dir=state))
    handle = await provider.start("apps", DesktopSpec(width=1280, height=800))
    try:
        async with handle.endpoint.client(timeout=120) as client:
            yield client
    finally:
        await provider.stop(handle)
        await provider.close()


async def _launch(c: httpx.AsyncClient, command: list[str], wm_class: str) -> None:
    r = await c.post("/setup/launch", json={"command": command})
    assert r.status_code == 200, r.text
    r = await c.post("/v1/wait_for_window", json={"wm_class": wm_class, "timeout": 120})
    assert r.status_code == 200 and r.json()["ok"], f"no {wm_class} window: {r.text}"


async def _tree_until(c: httpx.AsyncClient, found: Callable[[ET.Element], bool], timeout: float = 90) -> ET.Element:
    """Poll /accessibility until ``found`` holds: apps publish their widgets a while after mapping."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        r = await c.get("/accessibility")
        assert r.status_code == 200, r.text
        last = r.json()["AT"]
        root = ET.fromstring(last)
        if found(root):
            return root
        if time.monotonic() > deadline:
            raise AssertionError(f"widget not in the a11y tree after {timeout}s; tree starts:\n{last[:3000]}")
        await asyncio.sleep(0.5)


def _named(root: ET.Element, tag_part: str, name: str) -> list[ET.Element]:
    return [e for e in root.iter() if tag_part in e.tag and name in (e.get("name") or "") + (e.text or "")]


async def test_calc_widgets_in_accessibility_tree(guest: httpx.AsyncClient) -> None:
    csv = "name,score\nAlice,91\nBob,78\n"
    r = await guest.post("/setup/upload", data={"file_path": "/home/user/scores.csv"},
                         files={"file_data": ("scores.csv", csv.encode())})
    assert r.status_code == 200, r.text
    # The CSV filter options skip the import dialog (comma, quote, UTF-8, from line 1).
    await _launch(guest, ["soffice", "--calc", "--norestore", "--nologo",
                          "--infilter=CSV:44,34,76,1", "/home/user/scores.csv"], "libreoffice")
    root = await _tree_until(guest, lambda t: bool(_named(t, "table-cell", "Alice")))
    assert root.tag == "desktop-frame"
    assert _named(root, "table-cell", "91"), "cell B2 (91) missing"
    assert _named(root, "menu", "File"), "Calc's File menu missing"
    r = await guest.get("/v1/observation", params={"a11y": "true", "screenshot": "false"})
    assert r.status_code == 200 and "Alice" in r.json()["a11y"]


async def test_chromium_page_widgets_in_accessibility_tree(guest: httpx.AsyncClient) -> None:
    r = await guest.post("/setup/upload", data={"file_path": "/home/user/page.html"},
                         files={"file_data": ("page.html", PAGE.encode())})
    assert r.status_code == 200, r.text
    await _launch(guest, ["chromium", "--no-sandbox", "--force-renderer-accessibility", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--disable-gpu", "file:///home/user/page.html"], "chromium")
    root = await _tree_until(guest, lambda t: bool(_named(t, "push-button", "Press me")))
    assert _named(root, "link", "Read the terms"), "the page's link is missing"


async def test_google_chrome_answers_devtools_as_osworld_sets_it_up(guest: httpx.AsyncClient) -> None:
    # OSWorld's chrome tasks: launch google-chrome on 1337, then socat exposes it on 9222.
    await _launch(guest, ["google-chrome", "--remote-debugging-port=1337", "about:blank"], "chrom")
    r = await guest.post("/setup/launch", json={"command": ["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"]})
    assert r.status_code == 200, r.text
    probe = "for i in $(seq 100); do curl -sf localhost:9222/json/version && exit 0; sleep 0.1; done; exit 1"
    r = await guest.post("/execute", json={"command": probe, "shell": True})
    assert r.status_code == 200 and r.json()["returncode"] == 0, r.text
    assert '"Browser"' in r.json()["output"]
    # The profile lives where OSWorld's getters read it.
    r = await guest.post("/execute", json={"command": ["ls", "/home/user/.config/google-chrome"]})
    assert "Default" in r.json()["output"] or "Local State" in r.json()["output"], r.text
    # OSWorld's evaluators restart the browser with `pkill chrome` (a process-name match), which
    # must reach Chromium too.
    stop = "pkill chrome; for i in $(seq 100); do pgrep -x chromium >/dev/null || exit 0; sleep 0.1; done; exit 1"
    r = await guest.post("/execute", json={"command": stop, "shell": True})
    assert r.status_code == 200 and r.json()["returncode"] == 0, r.text


async def test_vlc_http_interface_with_osworld_password(guest: httpx.AsyncClient) -> None:
    r = await guest.post("/setup/launch", json={"command": ["vlc"]})
    assert r.status_code == 200, r.text
    probe = ("for i in $(seq 150); do curl -sf -u :password localhost:8080/requests/status.xml && exit 0; "
             "sleep 0.1; done; exit 1")
    r = await guest.post("/execute", json={"command": probe, "shell": True})
    assert r.status_code == 200 and r.json()["returncode"] == 0, r.text
    assert "<state>" in r.json()["output"]
    # Playing sound in a box without a sound card raises neither VLC's first-run privacy dialog
    # nor its "audio output failed" error window (the home's vlcrc and .asoundrc).
    tone = io.BytesIO()
    with wave.open(tone, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(b"\x00\x10\x00\xf0" * 8000)
    r = await guest.post("/setup/upload", data={"file_path": "/home/user/tone.wav"},
                         files={"file_data": ("tone.wav", tone.getvalue())})
    assert r.status_code == 200, r.text
    play = ("curl -sf -u :password 'localhost:8080/requests/status.xml?command=in_play&input=/home/user/tone.wav'"
            " >/dev/null; for i in $(seq 50); do curl -sf -u :password localhost:8080/requests/status.xml"
            " | grep -q '<state>playing' && exit 0; sleep 0.1; done; exit 1")
    r = await guest.post("/execute", json={"command": play, "shell": True})
    assert r.status_code == 200 and r.json()["returncode"] == 0, r.text
    await asyncio.sleep(1)  # an audio error dialog would map within this second
    windows = (await guest.get("/v1/observation", params={"screenshot": "false"})).json()["windows"]
    titles = [w["title"] for w in windows]
    assert not [t for t in titles if "Privacy" in t or t == "Errors"], titles


async def test_open_file_of_text_opens_an_editor_window(guest: httpx.AsyncClient) -> None:
    r = await guest.post("/setup/upload", data={"file_path": "/home/user/notes.txt"},
                         files={"file_data": ("notes.txt", b"hello\n")})
    assert r.status_code == 200, r.text
    r = await guest.post("/setup/open_file", json={"path": "/home/user/notes.txt"})
    assert r.status_code == 200, r.text
    windows = (await guest.get("/v1/observation", params={"screenshot": "false"})).json()["windows"]
    assert any("notes.txt" in w["title"] for w in windows), windows
