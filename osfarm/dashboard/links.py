"""Where each page lives: under ``/ui`` on a server, or as files of an exported site.

The templates only ever build a URL through a ``Links`` object, so the same template renders
the served page and the static one; :class:`SiteLinks` makes every link relative to the page
being written, so an exported site works from any folder (or straight from disk).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from urllib.parse import quote, urlencode

PREFIX = "/ui"


def slug(text: str) -> str:
    """A file-name-safe, collision-free name for a run key or an episode id (both may hold any
    character: a run dir's name, an id from a record)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:60] or "x"
    return f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


class ServerLinks:
    """Links of the served dashboard (absolute paths under ``/ui``)."""

    static_site = False

    def __init__(self, prefix: str = PREFIX):
        self.p = prefix

    def _q(self, path: str, **params: str) -> str:
        return f"{self.p}{path}?{urlencode(params)}" if params else f"{self.p}{path}"

    def home(self) -> str:
        return f"{self.p}/"

    def leaderboard(self) -> str:
        return self._q("/runs")

    def run(self, key: str) -> str:
        return self._q("/run", r=key)

    def episode(self, key: str, episode_id: str) -> str:
        return self._q("/episode", r=key, e=episode_id)

    def compare(self, a: str, b: str) -> str:
        return self._q("/compare", a=a, b=b)

    def compare_form(self) -> str:
        return self._q("/compare")

    def training(self, key: str) -> str:
        return self._q("/training", r=key)

    def file(self, key: str, rel: str) -> str:
        return self._q("/file", r=key, p=rel)

    def static(self, name: str) -> str:
        return f"{self.p}/static/{quote(name)}"

    def login(self) -> str:
        return self._q("/login")

    def logout(self) -> str:
        return self._q("/logout")

    def pool(self) -> str:
        return self._q("/pool")

    def pool_events(self) -> str:
        return self._q("/pool/events")

    def pool_json(self) -> str:
        return "/v1/pool"

    def desktop(self, desktop_id: str) -> str:
        return f"{self.p}/desktops/{quote(desktop_id, safe='')}"

    def live_ws(self, desktop_id: str) -> str:
        return f"{self.p}/desktops/{quote(desktop_id, safe='')}/live"


class SiteLinks:
    """Links between the files of an exported site, relative to the page ``here`` (a path
    relative to the site's root, e.g. ``runs/a-1234/index.html``)."""

    static_site = True

    def __init__(self, here: str):
        self.here_dir = posixpath.dirname(here)

    def rel(self, target: str) -> str:
        return quote(posixpath.relpath(target, self.here_dir or "."))

    @staticmethod
    def run_dir(key: str) -> str:
        return f"runs/{slug(key)}"

    def home(self) -> str:
        return self.rel("index.html")

    def leaderboard(self) -> str:
        return self.rel("index.html")

    def run(self, key: str) -> str:
        return self.rel(f"{self.run_dir(key)}/index.html")

    def episode(self, key: str, episode_id: str) -> str:
        return self.rel(f"{self.run_dir(key)}/episodes/{slug(episode_id)}.html")

    def compare(self, a: str, b: str) -> str:
        return self.rel(f"compare/{slug(a)}--{slug(b)}.html")

    def compare_form(self) -> str:  # an exported site lists its compare pages instead
        return self.rel("index.html")

    def training(self, key: str) -> str:
        return self.rel(f"training/{slug(key)}.html")

    def file(self, key: str, rel: str) -> str:
        return self.rel(f"{self.run_dir(key)}/files/{site_file_name(rel)}")

    def static(self, name: str) -> str:
        return self.rel(f"static/{name}")

    def login(self) -> str:
        return "#"

    logout = pool = pool_events = pool_json = login

    def desktop(self, desktop_id: str) -> str:
        return "#"

    live_ws = desktop


# What a run-dir file may be served or exported as: never HTML, SVG or script from a run dir.
MEDIA_TYPES = {
    ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
    ".mp4": "video/mp4", ".webm": "video/webm", ".json": "text/plain; charset=utf-8",
    ".jsonl": "text/plain; charset=utf-8", ".xml": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8",
}  # fmt: skip


def site_file_name(rel: str) -> str:
    """The exported copy of a run file: its path flattened, with an extension that no browser
    runs (a11y XML and JSON become .txt)."""
    base, ext = posixpath.splitext(rel)
    ext = ext.lower()
    keep = ext if ext in (".png", ".jpg", ".jpeg", ".webp", ".mp4", ".webm") else ".txt"
    return slug(base) + keep
