"""What a helper does when a tool it needs (redis-server, the docker daemon, root) is missing:
under pytest it skips the running test (or, where ``required_in_ci`` and ``CI`` is set, fails
it, so CI cannot pass by skipping); in a bench script or any other program it raises
:class:`Unavailable`. pytest is looked up, never imported: bench scripts run without it."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from osfarm.errors import OsfarmError


class Unavailable(OsfarmError, RuntimeError):
    """A tool the helper needs is not on this machine; the message says which and how to get it."""


def unavailable(reason: str, required_in_ci: bool = False) -> NoReturn:
    pytest = sys.modules.get("pytest")
    if pytest is not None:
        if required_in_ci and os.environ.get("CI"):
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)
    raise Unavailable(reason)
