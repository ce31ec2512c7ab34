"""The files a fresh home of the desktop gets: the app settings and default apps of OSWorld's VM
image that its tasks rely on (VLC's HTTP interface, no first-run dialogs, which app opens which
file type). Written by the session where the home lacks them, and put into a box's home template
by the providers.

Standard library only, like :mod:`osfarm.desktop.session.session`, which the launcher imports before the
server stack.
"""

from __future__ import annotations

import logging
from pathlib import Path

from osfarm.desktop.session import gnome

log = logging.getLogger(__name__)

# Settings from OSWorld's VM image: VLC's HTTP interface on 8080 with password "password"
# (its getters read /requests/status.xml) and no first-run privacy dialog over the player, and
# a graphical default for text files so that /setup/open_file of a .txt opens a window named
# after the file.
# Default apps as on OSWorld's Ubuntu (GNOME's defaults: Videos, i.e. Totem, plays videos and
# Document Viewer, i.e. Evince, shows PDFs), except video/mp4, which opens in VLC there (task
# 9f3bb592 opens an .mp4 and waits for "video.mp4 - VLC media player"). VLC is therefore the
# default of one video type, not of most: the default_video_player getter counts every type
# below, and task 937087b6 asks the agent to make VLC the default video player.
# (tests/test_desktop_defaults.py checks these on a real desktop.)
TOTEM_VIDEO_TYPES = (
    "3gp", "3gpp", "3gpp2", "avi", "divx", "dv", "fli", "flv", "mp2t", "mp4", "mp4v-es", "mpeg",
    "mpeg-system", "msvideo", "ogg", "quicktime", "vnd.divx", "vnd.mpegurl", "vnd.rn-realvideo", "webm",
    "x-anim", "x-avi", "x-flc", "x-fli", "x-flv", "x-m4v", "x-matroska", "x-mpeg", "x-mpeg-system",
    "x-mpeg2", "x-ms-asf", "x-ms-asf-plugin", "x-ms-asx", "x-ms-wm", "x-ms-wmv", "x-ms-wmx", "x-ms-wvx",
    "x-msvideo", "x-nsv", "x-ogm", "x-ogm+ogg", "x-theora", "x-theora+ogg",
)
DEFAULT_APPS = {
    "text/plain": "org.xfce.mousepad.desktop",
    # text/csv is a kind of text/plain: without these gio would hand it to the editor.
    "text/csv": "libreoffice-calc.desktop",
    "text/tab-separated-values": "libreoffice-calc.desktop",
    "application/pdf": "org.gnome.Evince.desktop",
    "inode/directory": "org.gnome.Nautilus.desktop",
    **{f"video/{t}": "org.gnome.Totem.desktop" for t in TOTEM_VIDEO_TYPES},
    "video/mp4": "vlc.desktop",
}


def _mimeapps(apps: dict[str, str]) -> str:
    return "[Default Applications]\n" + "".join(f"{k}={v}\n" for k, v in apps.items())


HOME_FILES = {
    ".config/vlc/vlcrc": ("[qt]\nqt-privacy-ask=0\n[core]\nextraintf=http\nhttp-port=8080\n"
                          "[lua]\nhttp-password=password\n"),
    # The box has no sound card: ALSA's default device is a sink that discards the samples, so
    # players run at normal speed instead of failing with an "audio output failed" dialog.
    ".asoundrc": "pcm.!default {\n    type null\n}\n",
    ".config/mimeapps.list": _mimeapps(DEFAULT_APPS),
    # LibreOffice as a used profile: no Tip of the Day dialog and no "what's new" bar over the
    # first document, which would cover the screen an agent (or a reference solution) sees.
    ".config/libreoffice/4/user/registrymodifications.xcu": (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" '
        'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        '<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" '
        'oor:op="fuse"><value>false</value></prop></item>\n'
        '<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="FirstRun" '
        'oor:op="fuse"><value>false</value></prop></item>\n'
        '<item oor:path="/org.openoffice.Setup/Product"><prop oor:name="ooSetupLastVersion" '
        'oor:op="fuse"><value>7.4</value></prop></item>\n'
        '</oor:items>\n'
    ),
}


def home_files(desktop: str) -> dict[str, str]:
    """The files a fresh home of ``desktop`` gets (relative path -> text)."""
    files = dict(HOME_FILES)
    if desktop == "gnome":
        files.update(gnome.HOME_FILES)
        files[".config/mimeapps.list"] = _mimeapps({**DEFAULT_APPS, **gnome.DEFAULT_APPS})
    return files


def write_missing(home: Path, desktop: str) -> None:
    """Write :func:`home_files` into ``home``, each only where the home lacks it (a fresh sandbox
    home always does)."""
    for rel, text in home_files(desktop).items():
        path = home / rel
        if path.exists():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as e:
            log.warning("cannot write %s: %s", path, e.strerror)
