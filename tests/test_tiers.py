"""The test tiers (tests/tiers.py): every test in exactly one, the rule that finds what starts
something real, and the guard that fails a unit test starting it anyway."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiers import TIERS, Rule, StartedInUnitTest, _forbidden

from osfarm.providers.base import DesktopSpec
from osfarm.providers.sandbox import SandboxProvider

# this module names what the rule looks for, on purpose: it says its own tier, which wins
pytestmark = pytest.mark.unit


def test_every_collected_test_is_in_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    for item in request.session.items:
        assert len([t for t in TIERS if item.get_closest_marker(t)]) == 1, item.nodeid


def _box() -> object:
    return SandboxProvider


def _helper_of_a_helper() -> object:
    return _box()


def _xvfb() -> None:
    subprocess.run(["Xvfb", "-version"], capture_output=True, timeout=30, check=False)  # exits at once if let run


def _cli_serve() -> None:
    subprocess.run([sys.executable, "-m", "osfarm.cli", "serve", "--port", "0"], check=False)


def _plain() -> int:
    return len(sys.argv)


def test_the_rule_follows_helpers_and_reads_argvs() -> None:
    rule = Rule()
    assert rule.facts(_box).why() == "uses SandboxProvider"
    assert rule.facts(_helper_of_a_helper).why() == "uses SandboxProvider"
    assert rule.facts(_xvfb).why() == "starts Xvfb"
    assert rule.facts(_cli_serve).why() == "runs osfarm serve"
    assert rule.facts(_plain).why() is None


@pytest.mark.parametrize(("argv", "what"), [
    (["Xvfb", "-displayfd", "3"], "Xvfb"),
    (["/usr/bin/unshare", "--user", "true"], "unshare"),
    ([sys.executable, "-m", "osfarm.desktop.launch.launcher", "--width", "8"],
     "python -m osfarm.desktop.launch.launcher"),
    ([sys.executable, "-m", "osfarm.cli", "policy", "serve"], "osfarm policy"),
    (["/venv/bin/osfarm", "eval", "--suite", "suites/mini"], "osfarm eval"),
    (["/venv/bin/osfarm", "eval", "--suite", "suites/mini", "--url", "http://127.0.0.1:1"], None),
    (["/venv/bin/osfarm", "--help"], None),
    ([sys.executable, "-c", "print(1)"], None),
])
def test_the_guard_knows_what_starts_a_desktop_or_service(argv: list[str], what: str | None) -> None:
    assert _forbidden(argv) == what


async def test_a_unit_test_cannot_start_a_desktop() -> None:
    with pytest.raises(StartedInUnitTest, match="unit tier but starts Xvfb"):
        _xvfb()
    with pytest.raises(StartedInUnitTest, match="starts a SandboxProvider desktop"):
        await SandboxProvider.start(object(), "t", DesktopSpec())  # the guard refuses before any self is used
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"
