"""A loopback HTTP server (127.0.0.1 only) that serves task files under OSWorld-like URL paths,
and misbehaves on purpose: redirects (also to file:// and in a loop), a slow body, a 404, a 500,
a body cut short, a body larger than announced, gzip, byte ranges with ETags (as HuggingFace's
file store answers)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

HF = "/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main"


@dataclass
class AssetServer:
    base: str
    files: dict[str, bytes]  # path -> bytes, served at that path
    hits: Counter[str] = field(default_factory=Counter)  # path -> GET requests
    ranges: list[str] = field(default_factory=list)  # Range headers received
    cut_once: set[str] = field(default_factory=set)  # paths whose next answer is cut halfway

    def url(self, path: str) -> str:
        return self.base + path


def _handler(srv: AssetServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  length: int | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: C901 - one branch per misbehaviour
            path = self.path.split("?", 1)[0]
            srv.hits[path] += 1
            if path.startswith("/redirect/"):  # /redirect/<n>/<rest>: n hops, relative Locations
                m = re.match(r"/redirect/(\d+)(/.*)", path)
                assert m
                n, rest = int(m.group(1)), m.group(2)
                loc = rest if n <= 1 else f"/redirect/{n - 1}{rest}"
                return self._send(302, headers={"Location": loc})
            if path == "/loop":
                return self._send(302, headers={"Location": "/loop"})
            if path == "/to-file":
                return self._send(302, headers={"Location": "file:///etc/passwd"})
            if path == "/to-ftp":
                return self._send(301, headers={"Location": "ftp://127.0.0.1/x"})
            if path == "/to-private":  # off the allow-list: another name for the same machine
                return self._send(302, headers={"Location": srv.base.replace("127.0.0.1", "localhost") + HF + "/a.txt"})
            if path == "/error":
                return self._send(500, b"boom")
            if path.startswith("/slow/"):  # headers at once, then one byte a second
                body = b"s" * 100
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for b in body:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(1.0)
                return None
            if path == "/huge-announced":
                return self._send(200, b"", length=10 << 30)
            if path == "/huge-unannounced":  # no Content-Length: the cap must stop the stream
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                for _ in range(64):
                    self.wfile.write(b"h" * 65536)
                return None
            if path == "/gzip":
                body = gzip.compress(b"plain text " * 100)
                return self._send(200, body, {"Content-Encoding": "gzip"})
            stored = srv.files.get(path)
            if stored is None:
                return self._send(404, b"not found")
            body = stored
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            rng = self.headers.get("Range")
            if rng:
                srv.ranges.append(rng)
            m = re.fullmatch(r"bytes=(\d+)-", rng or "")
            if m and self.headers.get("If-Range") in (etag, None):
                start = int(m.group(1))
                if start >= len(body):
                    return self._send(416, headers={"Content-Range": f"bytes */{len(body)}"})
                part = body[start:]
                return self._send(206, part, {"ETag": etag,
                                              "Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"})
            if path in srv.cut_once:  # announce everything, send half, hang up
                srv.cut_once.discard(path)
                self.send_response(200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return None
            return self._send(200, body, {"ETag": etag})

    return Handler


@contextmanager
def asset_server(files: dict[str, bytes] | None = None) -> Iterator[AssetServer]:
    srv_state = AssetServer("", dict(files or {}))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(srv_state))
    httpd.daemon_threads = True
    srv_state.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield srv_state
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(5)
