"""Chromium's DevTools, reached from inside the desktop.

The desktop has its own network namespace, so the evaluator cannot connect to port 9222 itself:
a small stdlib script runs *inside* the desktop (through the guest controller) and speaks the
DevTools HTTP and WebSocket protocol there. Where OSWorld drives Playwright (reading a tab's
page, opening a page or the settings for the evaluation), the script evaluates JavaScript in the
tab. Modes: ``tabs`` (every page's title and URL), ``active`` (the visible tab's title, URL and
live DOM), ``eval_url URL EXPR`` (evaluate in the tab showing URL), ``open_eval URL EXPR SECONDS``
(open URL in a new tab, poll EXPR until it has a value, close the tab).
"""

from __future__ import annotations

import json
from typing import Any

from osfarm.evaluators.getters.env import EvalEnv

__all__ = ["DEVTOOLS_PORT", "devtools"]

DEVTOOLS_PORT = 9222

_DEVTOOLS_SCRIPT = r'''
import base64, json, os, socket, struct, sys, time, urllib.parse, urllib.request
mode, port = sys.argv[1], int(sys.argv[2])
args = sys.argv[3:]
BASE = "http://127.0.0.1:%d" % port

def pages():
    with urllib.request.urlopen(BASE + "/json/list", timeout=5) as r:
        return [t for t in json.load(r) if t.get("type") == "page"]

def evaluate(ws_url, expr):
    hostport, path = ws_url.split("://", 1)[1].split("/", 1)
    host, p = hostport.rsplit(":", 1)
    s = socket.create_connection((host, int(p)), timeout=15)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(("GET /%s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n" % (path, hostport, key)).encode())
        f = s.makefile("rb")
        if b" 101" not in f.readline():
            raise RuntimeError("websocket upgrade refused")
        while f.readline() not in (b"\r\n", b""):
            pass
        msg = json.dumps({"id": 1, "method": "Runtime.evaluate",
                          "params": {"expression": expr, "returnByValue": True, "awaitPromise": True}}).encode()
        n = len(msg)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(msg)))
        buf = b""
        while True:
            b1, b2 = f.read(2)
            n = b2 & 0x7F
            if n == 126:
                n = struct.unpack(">H", f.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", f.read(8))[0]
            data = f.read(n)
            op = b1 & 0x0F
            if op == 8:
                raise RuntimeError("websocket closed")
            if op in (9, 10):
                continue
            buf += data
            if b1 & 0x80:
                reply = json.loads(buf)
                buf = b""
                if reply.get("id") == 1:
                    return reply.get("result", {}).get("result", {}).get("value")
    finally:
        s.close()

def norm(url):
    return urllib.parse.unquote(url or "").rstrip("/")

def visible(t):
    try:
        return evaluate(t["webSocketDebuggerUrl"], "document.visibilityState") == "visible"
    except Exception:  # noqa: BLE001 - a tab that does not answer is not the visible one
        return False

EXPR = ("JSON.stringify({visible: document.visibilityState === 'visible', title: document.title, "
        "url: location.href, content: (document.doctype ? new XMLSerializer().serializeToString("
        "document.doctype) : '') + document.documentElement.outerHTML})")

try:
    targets = pages()
except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
    print(json.dumps({"error": repr(e)}))
    sys.exit(0)
if mode == "tabs":
    print(json.dumps({"tabs": [{"title": t.get("title", ""), "url": t.get("url", "")} for t in targets]}))
elif mode == "active":
    first = None
    for t in targets:  # DevTools lists pages most recently active first
        if not t.get("webSocketDebuggerUrl"):
            continue
        try:
            info = json.loads(evaluate(t["webSocketDebuggerUrl"], EXPR))
        except Exception:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
            continue
        first = first or info
        if info.pop("visible"):
            print(json.dumps({"active": info}))
            break
    else:
        if first:
            first.pop("visible", None)
        print(json.dumps({"active": first}))
elif mode == "eval_url":
    # args: url, expression. The tab showing url (the visible one if several do) evaluates it.
    want = norm(args[0])
    same = [t for t in targets if t.get("webSocketDebuggerUrl") and norm(t.get("url")) == want]
    if not same:
        print(json.dumps({"found": False, "urls": [t.get("url") for t in targets]}))
        sys.exit(0)
    tab = next((t for t in same if visible(t)), same[0])
    print(json.dumps({"found": True, "url": tab.get("url"), "value": evaluate(tab["webSocketDebuggerUrl"], args[1])}))
elif mode == "open_eval":
    # args: url, expression, seconds. Open url in a new tab of the running browser (its cookies
    # and settings), poll the expression until it gives a value, close the tab.
    req = urllib.request.Request(BASE + "/json/new?" + urllib.parse.quote(args[0], safe=""), method="PUT")
    with urllib.request.urlopen(req, timeout=15) as r:
        tab = json.load(r)
    value, deadline = None, time.monotonic() + float(args[2])
    try:
        while True:
            try:
                value = evaluate(tab["webSocketDebuggerUrl"], args[1])
            except Exception:  # noqa: BLE001 - the page is still navigating: ask again
                value = None
            if value is not None or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    finally:
        try:
            urllib.request.urlopen(BASE + "/json/close/" + tab["id"], timeout=5).close()
        except Exception:  # noqa: BLE001 - the tab may be gone already
            pass
    print(json.dumps({"value": value}))
'''


def devtools(env: EvalEnv, mode: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    """The script's JSON answer for ``mode``; ``{"error": ...}`` when the browser does not answer
    or the command fails (the getters then return their "nothing found" value)."""
    try:
        r = env.controller.execute(["python3", "-c", _DEVTOOLS_SCRIPT, mode, str(DEVTOOLS_PORT), *args],
                                   timeout=timeout)
        out = (r.get("output") or "").strip().splitlines()
        return json.loads(out[-1]) if out else {"error": r.get("error")}
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        return {"error": repr(e)}
