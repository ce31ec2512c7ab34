"""In-box red team (issue 13 item 7): an adversarial agent (osfarm/testing/redteam/adversary.py), run by the normal
runner (``run_episode``) on a leased desktop of each provider, tries every box probe of
probes.py: host secrets, the checkout, suite caches and the farm's state, another desktop's home,
the guest's token and socket, killing or tracing the guest, the host's loopback services,
another desktop's X server, box root versus host root, a full disk, a 100 GB sparse result, a
fork bomb and a memory bomb.

Each probe must be held: it reports HELD from inside the box; the farm keeps serving; a
bystander desktop leased next to it is unaffected (its guest answers, its home is intact); the
episode ends as the agent's failure or as an infra error naming the limit that stopped it, never
as a success. The desktops run with small limits so that the bombs end quickly
(osfarm/testing/redteam/farm.py; bench/redteam.py prints the same probes as a table).

The sandbox and Docker run in ``make test``; libvirt (minutes per boot under TCG) only with
OSFARM_REDTEAM_LIBVIRT=1, non-destructive probes only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from osfarm.testing.redteam.adversary import verdicts
from osfarm.testing.redteam.farm import bystander_ok, destructive_held, redteam_farm, run_adversary
from osfarm.testing.redteam.probes import box_probes

PROVIDERS = ["sandbox", "docker"] + (["libvirt"] if os.environ.get("OSFARM_REDTEAM_LIBVIRT") == "1" else [])
BOMBS = {"fork_bomb": "process limit", "memory_bomb": "memory limit"}
pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module", params=PROVIDERS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with redteam_farm(request.param, tmp_path_factory.mktemp("cache")) as s:
        yield s


def test_box_probes_are_held(setup: dict[str, Any], tmp_path: Path) -> None:
    probes = box_probes(setup["name"], destructive=False)
    res = run_adversary(setup["server"], [p.code(setup["ctx"]) for p in probes], tmp_path, setup["cache"])
    got = verdicts(res)
    table = {p.name: v for p, v in zip(probes, got, strict=False)}
    print(json.dumps(table, indent=1))
    assert len(got) == len(probes), (res.status, res.error, got)
    broken = {name: v for name, v in table.items() if v[0] != "HELD"}
    assert not broken, broken
    # the sparse "result": the evaluation refuses it, and nothing else failed on the way
    assert res.status in ("failure", "infra_error"), (res.status, res.error)
    if res.status == "infra_error":
        assert "limit" in (res.error or ""), res.error
    assert setup["listener"].accepted == 0
    assert bystander_ok(setup) is None, bystander_ok(setup)


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_bombs_end_only_their_desktop(setup: dict[str, Any], bomb: str, tmp_path: Path) -> None:
    if setup["name"] == "libvirt":
        pytest.skip("bombs are not run on VMs here (TCG boots take minutes); the VM's own kernel holds them")
    probe = next(p for p in box_probes(setup["name"], destructive=True) if p.name == bomb)
    res = run_adversary(setup["server"], [probe.code(setup["ctx"]), "import time; time.sleep(5)"], tmp_path,
                        setup["cache"])
    got = verdicts(res)
    print(bomb, res.status, res.error, got)
    assert not any(v == "BREACH" for v, _ in got), got
    # the desktop is ended, as an infra error that names the limit it ran into
    assert destructive_held(res, BOMBS[bomb]) is None, destructive_held(res, BOMBS[bomb])
    assert bystander_ok(setup) is None, bystander_ok(setup)
