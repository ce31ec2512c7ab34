"""The one error of a warm reset (:mod:`osfarm.desktop.warm.warm`) and of its parts (the kill rounds,
the agent-side helper): the guest answers it as a refusal and the farm restarts the box cold."""

from __future__ import annotations

from osfarm.errors import InfraError


class WarmResetError(InfraError, RuntimeError):
    """The desktop cannot be put back warm; the farm restarts it cold. The message says why."""
