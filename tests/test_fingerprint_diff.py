"""differences(): where two fingerprints differ, checked by hand on small documents."""

from __future__ import annotations

import subprocess
import sys

from osfarm.desktop.warm.fingerprint_diff import differences


def test_equal_fingerprints_have_no_differences_whatever_their_digests() -> None:
    a = {"processes": ["Xvfb :0", "openbox"], "x": {"screen": [1920, 1080]}, "digest": "aa", "timings_ms": {"x": 1}}
    b = {**a, "digest": "bb", "timings_ms": {"x": 9}}
    assert differences(a, b) == []


def test_scalar_and_nested_changes_are_named_by_path() -> None:
    a = {"x": {"screen": [1920, 1080], "pointer": {"x": 0}}, "guest": {"wallpaper": True}}
    b = {"x": {"screen": [1920, 1080], "pointer": {"x": 5}}, "guest": {"wallpaper": False}}
    assert differences(a, b) == ["guest.wallpaper: true != false", "x.pointer.x: 0 != 5"]


def test_lists_near_the_top_are_compared_as_sets_with_the_extra_entries() -> None:
    a = {"processes": ["Xvfb :0", "openbox", "sleep 100"]}
    b = {"processes": ["Xvfb :0", "openbox", "nc -l 9000"]}
    assert differences(a, b) == ['processes: only before "sleep 100"', 'processes: only after "nc -l 9000"']
    assert differences({"processes": ["a", "b"]}, {"processes": ["b", "a"]}) == ["processes: order"]


def test_a_key_on_one_side_only_and_the_limit() -> None:
    a = {"files": {f"f{i}": i for i in range(20)}}
    b = {"files": {}, "ipc": {"shm": ["1"]}}
    out = differences(a, b, limit=3)
    assert out == ["files.f0: 0 != null", "files.f1: 1 != null", "files.f10: 10 != null"]


def test_the_farm_compares_fingerprints_without_loading_xlib() -> None:
    """The farm side of a warm reset (providers) imports no X client library."""
    code = ("import sys, osfarm.providers.warm_reset, osfarm.providers.sandbox, osfarm.providers.docker; "
            "print('Xlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
