"""OSWorld's VLC metrics (``metrics/vlc.py``): what VLC is playing (its HTTP interface's
``status.xml``), whether its window fills the screen, and its settings file ``vlcrc``. The
audio and video comparisons of OSWorld's ``vlc.py`` are in ``audio_video.py``, its
``compare_images`` in ``gimp.py``.

Names, signatures and scoring follow OSWorld; under the metric contract (``contract.py``) an
unreadable file scores 0.0 while an unknown rule ``type`` raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse
from xml.etree import ElementTree

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics.contract import bad_input_scores_zero, is_file

__all__ = ["METRICS"]


@bad_input_scores_zero
def is_vlc_playing(actual_status_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff VLC's HTTP status XML says ``playing`` and the played item matches the rule:
    ``{"type": "file_name", "file_name": ...}`` (basename or path suffix) or
    ``{"type": "url", "url": ...}`` (contained, or the same host and path)."""
    if not is_file(actual_status_path):
        return 0.0
    with open(actual_status_path, "rb") as f:
        tree = ElementTree.fromstring(f.read().decode("utf-8"))
    state = tree.find("state")
    if state is None or state.text != "playing":
        return 0.0

    def first_info(names: Sequence[str]) -> str | None:
        for name in names:
            el = tree.find(f'information/category[@name="meta"]/info[@name="{name}"]')
            if el is not None and el.text:
                return el.text
        return None

    kind = rule["type"]
    if kind == "file_name":
        info = first_info(["filename", "title", "uri", "location", "name"])
        if not info:
            return 0.0
        want = rule["file_name"]
        return float(os.path.basename(info) == want or info.endswith(want))
    if kind == "url":
        info = first_info(["url", "URI", "location", "title", "filename"])
        if not info:
            return 0.0
        want = rule["url"]
        if want in info:
            return 1.0
        parsed = urlparse(want)
        if info == os.path.basename(parsed.path):
            return 1.0
        if "://" in info:
            got = urlparse(info)
            return float(parsed.netloc == got.netloc and parsed.path in got.path)
        return 0.0
    raise UnsupportedOption(f"is_vlc_playing: unknown rule type {kind!r}")


@bad_input_scores_zero
def is_vlc_fullscreen(actual_window_size: Any, screen_size: Any) -> float:
    """1 iff the window's width and height equal the screen's."""
    if not isinstance(actual_window_size, Mapping) or not isinstance(screen_size, Mapping):
        return 0.0
    return float(
        actual_window_size.get("width") == screen_size.get("width")
        and actual_window_size.get("height") == screen_size.get("height")
        and screen_size.get("width") is not None
    )


def _vlcrc_value(path: Any, key: str) -> str | None:
    """The value of the last uncommented ``key=value`` line of a vlcrc, or None."""
    if not is_file(path):
        raise FileNotFoundError(path)
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    value = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, rest = line.partition("=")
        if sep and name.strip() == key:
            value = rest.strip()
    return value


@bad_input_scores_zero
def is_vlc_recordings_folder(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff vlcrc's ``input-record-path`` equals ``rule["recording_file_path"]``."""
    return float(_vlcrc_value(actual_config_path, "input-record-path") == rule["recording_file_path"])


def _vlcrc_check(key: str, rule_key: str, default: str) -> Callable[..., float]:
    def check(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
        value = _vlcrc_value(actual_config_path, key)
        return float((default if value is None else value) == str(rule[rule_key]))

    check.__name__ = check.__qualname__ = f"check_{key.replace('-', '_')}"
    check.__doc__ = f"1 iff vlcrc's ``{key}`` (default {default}) equals ``rule[{rule_key!r}]``."
    return bad_input_scores_zero(check)


check_qt_bgcone = _vlcrc_check("qt-bgcone", "expected_qt_bgcone", "1")
check_qt_max_volume = _vlcrc_check("qt-max-volume", "expected_qt_max_volume", "125")
check_qt_minimal_view = _vlcrc_check("qt-minimal-view", "expected_qt_minimal_view", "0")
check_one_instance_when_started_from_file = _vlcrc_check(
    "one-instance-when-started-from-file", "expected_one_instance_when_started_from_file", "1"
)
check_play_and_exit = _vlcrc_check("play-and-exit", "expected_play_and_exit", "0")


@bad_input_scores_zero
def check_global_key_play_pause(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """1 iff "a global play/pause hotkey is set" ("1" when ``global-key-play-pause`` has a value,
    else "0") equals ``rule["expected_global_key_play_pause"]``."""
    value = _vlcrc_value(actual_config_path, "global-key-play-pause")
    state = "1" if value else "0"
    return float(state == str(rule["expected_global_key_play_pause"]))


_DEFAULT_SLIDER_COLOURS = "153;210;153;20;210;20;255;199;15;245;39;29"


@bad_input_scores_zero
def check_qt_slider_colours(actual_config_path: Any, rule: Mapping[str, Any]) -> float:
    """``{"type": "match", "expected_qt_slider_colours": s}``: the vlcrc value equals s;
    ``{"type": "blackish"}``: every RGB triple of the value has all components < 100."""
    value = _vlcrc_value(actual_config_path, "qt-slider-colours") or _DEFAULT_SLIDER_COLOURS
    kind = rule["type"]
    if kind == "match":
        return float(value == rule["expected_qt_slider_colours"])
    if kind == "blackish":
        values = [int(x) for x in value.split(";")]
        triples = list(zip(values[0::3], values[1::3], values[2::3], strict=False))
        return float(all(all(v < 100 for v in rgb) for rgb in triples))
    raise UnsupportedOption(f"check_qt_slider_colours: unknown rule type {kind!r}")


METRICS: dict[str, Callable[..., float]] = {
    f.__name__: f
    for f in (
        is_vlc_playing, is_vlc_fullscreen, is_vlc_recordings_folder, check_qt_bgcone, check_qt_max_volume,
        check_qt_minimal_view, check_qt_slider_colours, check_global_key_play_pause,
        check_one_instance_when_started_from_file, check_play_and_exit,
    )
}
