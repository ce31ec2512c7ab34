"""LibreOffice Impress getters (OSWorld ``getters/impress.py``): the media of one slide of a deck
in the desktop (its audio, its background picture), embedded in the deck or linked from it."""

from __future__ import annotations

import logging
import posixpath
import xml.etree.ElementTree as ET
import zipfile
from typing import Any
from urllib.parse import unquote, urlparse

from osfarm.evaluators.archive_limits import read_member
from osfarm.evaluators.getters.env import EvalEnv
from osfarm.evaluators.getters.files import vm_file

log = logging.getLogger(__name__)

_RELS_NS = "{http://schemas.openxmlformats.org/package/2006/relationships}"
_P_NS = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
_A_NS = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
_R_EMBED = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}embed"


def _deck(env: EvalEnv, config: dict[str, Any]) -> tuple[zipfile.ZipFile, int] | None:
    """The deck ``ppt_file_path`` fetched into the cache, open, and the slide number (1-based)."""
    ppt = config["ppt_file_path"]
    local = vm_file(env, ppt, ppt.rstrip("/").rsplit("/", 1)[-1])
    if not isinstance(local, str):
        return None
    try:
        return zipfile.ZipFile(local), int(config["slide_index"]) + 1
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        log.info("%s is not a deck: %r", ppt, e)
        return None


def _slide_media(env: EvalEnv, zf: zipfile.ZipFile, n: int, pick: Any, dest: str) -> str | None:
    """The target of the first relationship of slide ``n`` that ``pick(rel)`` accepts, saved as
    ``dest``: from inside the deck, or from the desktop when the slide links a file."""
    rels_name = f"ppt/slides/_rels/slide{n}.xml.rels"
    if rels_name not in zf.namelist():
        return None
    rel = next((r for r in ET.fromstring(zf.read(rels_name)).iter(f"{_RELS_NS}Relationship") if pick(r)), None)
    if rel is None:
        return None
    target = rel.get("Target", "")
    if rel.get("TargetMode") == "External" or target.startswith("file:"):
        path = unquote(urlparse(target).path) if target.startswith("file:") else target
        return vm_file(env, path, dest)
    member = posixpath.normpath(posixpath.join("ppt/slides", target)) if not target.startswith("/") else target[1:]
    if member not in zf.namelist():
        return None
    try:
        return env.save(dest, read_member(zf, member))
    except ValueError as e:  # a member that would unpack past the limit: the agent's deck is unusable
        log.warning("%s", e)
        return None


def get_audio_in_slide(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The (first) audio of slide ``slide_index`` (0-based) of the deck ``ppt_file_path``,
    embedded or linked, saved as ``dest``; None when the slide has none."""
    deck = _deck(env, config)
    if deck is None:
        return None
    zf, n = deck
    with zf:
        return _slide_media(env, zf, n, lambda r: "audio" in r.get("Type", ""), config["dest"])


def get_background_image_in_slide(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """The picture filling the background of slide ``slide_index`` (0-based) of the deck
    ``ppt_file_path``, saved as ``dest``; None when the background is not a picture."""
    deck = _deck(env, config)
    if deck is None:
        return None
    zf, n = deck
    with zf:
        name = f"ppt/slides/slide{n}.xml"
        if name not in zf.namelist():
            return None
        bg = next(ET.fromstring(zf.read(name)).iter(f"{_P_NS}bgPr"), None)
        blip = next(bg.iter(f"{_A_NS}blip"), None) if bg is not None else None
        rid = blip.get(_R_EMBED) if blip is not None else None
        if not rid:
            return None
        return _slide_media(env, zf, n, lambda r: r.get("Id") == rid and "image" in r.get("Type", ""),
                            config["dest"])
