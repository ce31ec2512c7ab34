"""VLC getters (OSWorld ``getters/vlc.py``): VLC's settings file, what it is playing (its HTTP
interface, asked from inside the desktop, whose network namespace is its own), and which
application opens videos by default."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from osfarm.evaluators.getters.env import HOME, EvalEnv

log = logging.getLogger(__name__)

VLC_PORT = 8080
VLC_PASSWORD = "password"


def get_vlc_config(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """VLC's ``vlcrc`` saved as ``dest``; None when VLC never wrote one."""
    data = env.controller.get_file(f"{HOME}/.config/vlc/vlcrc")
    return None if data is None else env.save(config["dest"], data)


_VLC_SCRIPT = r'''
import base64, sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:%s/requests/status.xml" % sys.argv[1])
req.add_header("Authorization", "Basic " + base64.b64encode((":" + sys.argv[2]).encode()).decode())
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        sys.stdout.write(r.read().decode("utf-8", "replace"))
except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
    sys.stderr.write(repr(e))
    sys.exit(1)
'''


def get_vlc_playing_info(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """VLC's HTTP interface ``status.xml`` (password ``password``) saved as ``dest``; None when
    VLC's HTTP interface does not answer."""
    try:
        r = env.controller.execute(["python3", "-c", _VLC_SCRIPT, str(VLC_PORT), VLC_PASSWORD], timeout=30)
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("vlc_playing_info: %r", e)
        return None
    if r.get("returncode") != 0 or not r.get("output"):
        log.info("vlc_playing_info: %s", r.get("error"))
        return None
    return env.save(config["dest"], r["output"].encode())


# OSWorld's list of video/* subtypes, in its order; it lists every one twice but x-ogm+ogg, so
# those count double when the most common default app is picked (it matters only for ties).
_VIDEO_SUBTYPES = (
    "3gp", "3gpp", "3gpp2", "avi", "divx", "dv", "fli", "flv", "mp2t", "mp4", "mp4v-es", "mpeg",
    "mpeg-system", "msvideo", "ogg", "quicktime", "vnd.divx", "vnd.mpegurl", "vnd.rn-realvideo", "webm",
    "x-anim", "x-avi", "x-flc", "x-fli", "x-flv", "x-m4v", "x-matroska", "x-mpeg", "x-mpeg-system",
    "x-mpeg2", "x-ms-asf", "x-ms-asf-plugin", "x-ms-asx", "x-ms-wm", "x-ms-wmv", "x-ms-wmx", "x-ms-wvx",
    "x-msvideo", "x-nsv", "x-ogm", "x-ogm+ogg", "x-theora", "x-theora+ogg",
)
_LISTED_ONCE = {"x-ogm+ogg"}

_XDG_MIME_SCRIPT = r'''
import json, subprocess, sys
out = {}
for t in sys.argv[1:]:
    r = subprocess.run(["xdg-mime", "query", "default", "video/" + t], capture_output=True, text=True)
    out[t] = r.stdout.strip()
print(json.dumps(out))
'''


def get_default_video_player(env: EvalEnv, config: dict[str, Any]) -> str:
    """The desktop file (e.g. ``vlc.desktop``) that ``xdg-mime`` opens most video types with;
    "unknown" when none has a default."""
    try:
        r = env.controller.execute(["python3", "-c", _XDG_MIME_SCRIPT, *_VIDEO_SUBTYPES], timeout=60)
        defaults = json.loads((r.get("output") or "").strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a missing/corrupt state scores 0, never crashes
        log.info("default_video_player: %r", e)
        return "unknown"
    apps: list[str] = []
    for t in _VIDEO_SUBTYPES:
        app = defaults.get(t)
        if app:
            apps.extend([app] if t in _LISTED_ONCE else [app, app])
    return Counter(apps).most_common(1)[0][0] if apps else "unknown"
