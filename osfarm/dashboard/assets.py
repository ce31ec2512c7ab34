"""The dashboard's own scripts and stylesheet (``static/``), read once at import: a fixed set of
names, so no request path ever reaches the file system."""

from __future__ import annotations

from importlib import resources

STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
ASSETS: dict[str, bytes] = {
    f.name: f.read_bytes()
    for f in resources.files("osfarm.dashboard").joinpath("static").iterdir()
    if f.is_file() and any(f.name.endswith(ext) for ext in STATIC_TYPES)
}


def media_type(name: str) -> str:
    return STATIC_TYPES[name[name.rfind("."):]]
