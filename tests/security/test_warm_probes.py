"""Warm-reset persistence (osfarm/testing/redteam/warm_probes.py) on a sandbox farm with ``reset_mode:
warm``: nothing one lease's agent leaves behind reaches the next lease after a warm reset (it is
undone, or the fingerprint sees it and the desktop is restarted cold)."""

from __future__ import annotations

import pytest

from osfarm.testing.farms import running_farm
from osfarm.testing.redteam.warm_probes import run_warm_probes

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(600)]


def test_nothing_survives_a_warm_reset() -> None:
    with running_farm(prefix="osww", pool_min=1, pool_max=1, reset_mode="warm", cold_every=0,
                      warm_reset_timeout_s=60.0) as s:
        cells = run_warm_probes(s.url, s.token)
    assert cells and all(v.startswith("held") for v in cells.values()), cells
    # what a warm reset undoes stays warm (no cold restart for these)
    for name in ("warm_daemons", "warm_mqueue", "warm_files", "warm_x_settings", "warm_xkb", "warm_x_retained"):
        assert cells[name] == "held (undone)", (name, cells[name])
