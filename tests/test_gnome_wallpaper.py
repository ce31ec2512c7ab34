"""osfarm.desktop.session.gnome_wallpaper: the background key's value (the agent's) read as a local file."""

from __future__ import annotations

import pytest

from osfarm.desktop.session.gnome_wallpaper import file_uri, path_from_setting


@pytest.mark.parametrize(("value", "path"), [
    ("'file:///home/user/Pictures/green%20wall.png'\n", "/home/user/Pictures/green wall.png"),
    ("'file://localhost/tmp/a.png'", "/tmp/a.png"),
    ("'/home/user/b.jpg'", "/home/user/b.jpg"),
    ('"file:///home/user/it\'s.png"', "/home/user/it's.png"),
])
def test_local_files_are_read(value: str, path: str) -> None:
    assert path_from_setting(value) == path


@pytest.mark.parametrize("value", [
    "", "''", "'relative.png'", "'https://example.invalid/a.png'", "'file://otherhost/etc/passwd'",
    "__import__('os').system('id')", "['file:///a.png']", "42", "'file://'",
])
def test_anything_else_is_no_wallpaper(value: str) -> None:
    assert path_from_setting(value) is None


def test_file_uri_is_percent_encoded_and_round_trips() -> None:
    uri = file_uri("/home/user/Pictures/green wall#1.png")
    assert uri == "file:///home/user/Pictures/green%20wall%231.png"
    assert path_from_setting(repr(uri)) == "/home/user/Pictures/green wall#1.png"
